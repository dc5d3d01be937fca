# The flex dispatcher (mpiep) is the alltoall dispatcher's bits: the equivalence model on 4 layers (two MoE) trained
# with --moe-token-dispatcher-type alltoall and with flex (recompute_main.cpp's runner: losses and every final
# parameter bit-identical), under EP2, EP4 and ETP2 x EP2 on one host and on two pretend hosts (MOECORE_PRETEND_HOSTS),
# fp32 and bf16, and with the EP overlap on top; and against one process (equivalence.cmake's tolerances).
set(flex_model ${equiv_model} ${equiv_pp_4l} --moe-token-dispatcher-type alltoall)
set(flex_tests)
function(moecore_flex name np hosts)
  if(NOT MPIRUN_EXECUTABLE)
    return()
  endif()
  add_test(NAME dist.flex.${name}
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np}
                   $<TARGET_FILE:dist_recompute_test> --variants flex -- ${flex_model} ${ARGN})
  set_tests_properties(dist.flex.${name} PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=1;MOECORE_PRETEND_HOSTS=${hosts}")
  set(flex_tests ${flex_tests} dist.flex.${name} PARENT_SCOPE)
endfunction()
moecore_flex(ep2_hosts1 2 1 --expert-model-parallel-size 2)
moecore_flex(ep2_hosts2 2 2 --expert-model-parallel-size 2)
moecore_flex(ep4_hosts1 4 1 --expert-model-parallel-size 4)
moecore_flex(ep4_hosts2 4 2 --expert-model-parallel-size 4)
moecore_flex(etp2_ep2_hosts1 4 1 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2)
moecore_flex(etp2_ep2_hosts2 4 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2)
moecore_flex(bf16_ep4_hosts2 4 2 --bf16 --expert-model-parallel-size 4)
set_tests_properties(${flex_tests} PROPERTIES LABELS dist TIMEOUT 300)
# The EP overlap over the flex dispatcher, on two pretend hosts.
if(MPIRUN_EXECUTABLE)
  add_test(NAME dist.ep_overlap.flex_ep2_hosts2
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np 2
                   $<TARGET_FILE:dist_recompute_test> --variants ep_overlap ep_overlap_delay_wgrad -- ${equiv_model}
                   ${equiv_pp_4l} --bf16 --moe-token-dispatcher-type flex --expert-model-parallel-size 2)
  set_tests_properties(dist.ep_overlap.flex_ep2_hosts2 PROPERTIES LABELS dist TIMEOUT 300
                       ENVIRONMENT "OMP_NUM_THREADS=1;MOECORE_PRETEND_HOSTS=2")
  set_property(TEST dist.equiv.flex_ep4_hosts2 APPEND PROPERTY ENVIRONMENT "MOECORE_PRETEND_HOSTS=2")
endif()
