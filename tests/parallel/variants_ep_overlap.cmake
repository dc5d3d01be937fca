# The EP all-to-all overlap is exact: Megatron's combined 1F1B schedule (--overlap-moe-expert-parallel-comm, with and
# without --delay-wgrad-compute) against the same layout without it, with recompute_main.cpp's runner (losses and
# every final parameter bit-identical). bf16, as Megatron requires; the equivalence model on 4 layers (two MoE) with
# the alltoall dispatcher. The layouts without the overlap match one process within the bf16 tolerances
# (equivalence.cmake: bf16_tp2_ep2 and the ep_overlap equivalences below).
set(ep_overlap_model ${equiv_model} ${equiv_pp_4l} --moe-token-dispatcher-type alltoall)
set(ep_overlap_tests)
function(moecore_ep_overlap name np)
  if(NOT MPIRUN_EXECUTABLE)
    return()
  endif()
  add_test(NAME dist.ep_overlap.${name}
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np}
                   $<TARGET_FILE:dist_recompute_test> --variants ep_overlap ep_overlap_delay_wgrad --
                   ${ep_overlap_model} ${ARGN})
  set(ep_overlap_tests ${ep_overlap_tests} dist.ep_overlap.${name} PARENT_SCOPE)
endfunction()
moecore_ep_overlap(ep2 2 --bf16 --expert-model-parallel-size 2)
moecore_ep_overlap(tp2_sp_ep2 4 --bf16 --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2)
# Interleaved PP2 x VPP2 with 8 micro-batches per rank: the steady state pairs after one extra warm-up forward.
moecore_ep_overlap(pp2_vpp2_ep2 4 --bf16 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1
                   --expert-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16)
# fp16 with its loss scaler, and top-1 with expert tensor parallelism (the combine's fp32 partial sums).
moecore_ep_overlap(ep2_fp16 2 --expert-model-parallel-size 2 --fp16)
moecore_ep_overlap(ep2_etp2 4 --bf16 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2)
# FP8 delayed scaling (amax histories recorded by both lanes) and one Multi-Token Prediction depth (Megatron's limit).
moecore_ep_overlap(ep2_fp8_delayed 2 --bf16 --expert-model-parallel-size 2 --fp8-format hybrid --fp8-recipe delayed
                   --fp8-amax-history-len 4)
moecore_ep_overlap(ep2_mtp1 2 --bf16 --expert-model-parallel-size 2 --mtp-num-layers 1)
set_tests_properties(${ep_overlap_tests} PROPERTIES LABELS dist TIMEOUT 300 ENVIRONMENT "OMP_NUM_THREADS=1")
