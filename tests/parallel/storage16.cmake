# 16-bit activation storage under --bf16 / --fp16 (ops/staging.h): the equivalence model (equivalence.cmake) trained
# with activations in fp32 tensors and in bf16 / fp16 tensors must agree bit for bit, in one process and under the
# two-rank layouts (tensor + sequence parallel with expert parallel, context parallel, pipeline parallel).
add_executable(dist_storage16_test storage16_main.cpp)
target_link_libraries(dist_storage16_test PRIVATE moecore_train)

set(storage16_layouts
    "bf16\;1\;--bf16"
    "fp16\;1\;--fp16"
    "bf16_alltoall\;1\;--bf16 --moe-token-dispatcher-type alltoall"
    "bf16_tp2_sp_ep2\;2\;--bf16 --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1"
    "fp16_tp2_sp_ep2\;2\;--fp16 --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1"
    "bf16_cp2\;2\;--bf16 --context-parallel-size 2"
    "bf16_cp2_a2a\;2\;--bf16 --context-parallel-size 2 --cp-comm-type a2a"
    "bf16_cp2_all_gather\;2\;--bf16 --context-parallel-size 2 --cp-comm-type all_gather"
    "bf16_ep2_alltoall\;2\;--bf16 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
    "bf16_pp2\;2\;--bf16 --num-layers 4 --moe-layer-freq [0,1,0,1] --pipeline-model-parallel-size 2"
    "bf16_recompute\;1\;--bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    "bf16_fp8_delayed\;1\;--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4"
    "bf16_fp8_tensorwise\;1\;--bf16 --fp8-format e4m3 --fp8-recipe tensorwise"
    "bf16_mtp\;1\;--bf16 --mtp-num-layers 2 --mtp-loss-scaling-factor 0.5")
foreach(layout ${storage16_layouts})
  list(GET layout 0 name)
  list(GET layout 1 np)
  list(GET layout 2 flags)
  separate_arguments(flags)
  if(np EQUAL 1)
    add_test(NAME dist.storage16.${name} COMMAND dist_storage16_test -- ${equiv_model} ${equiv_aux} ${flags})
  elseif(MPIRUN_EXECUTABLE)
    add_test(NAME dist.storage16.${name}
             COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np}
                     $<TARGET_FILE:dist_storage16_test> -- ${equiv_model} ${equiv_aux} ${flags})
  else()
    continue()
  endif()
  set_tests_properties(dist.storage16.${name} PROPERTIES LABELS dist TIMEOUT 300 ENVIRONMENT "OMP_NUM_THREADS=1")
endforeach()
