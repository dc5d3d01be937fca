# Megatron-FSDP (optim/fsdp.h); its layout equivalence runs are in equivalence.cmake (dist.equiv.fsdp_*).
# Bytes per rank under optim_grads_params at DP1, DP2 and DP4 (with EP2, experts over expert-DP 2), against what the
# strategy keeps by the parameters' sizes (fsdp_memory_main.cpp).
add_executable(dist_fsdp_memory_test ${CMAKE_CURRENT_SOURCE_DIR}/fsdp_memory_main.cpp)
target_link_libraries(dist_fsdp_memory_test PRIVATE moecore_train)
set(fsdp_memory_model
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16
    --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope --ffn-hidden-size 128
    --micro-batch-size 1 --global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer
    --vocab-size 60 --seed 7 --num-experts 4 --moe-ffn-hidden-size 64 --moe-router-topk 2 --moe-layer-freq [0,1]
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --eval-iters 0 --use-megatron-fsdp)
set(fsdp_tests dist.fsdp.memory.dp1)
add_test(NAME dist.fsdp.memory.dp1 COMMAND dist_fsdp_memory_test -- ${fsdp_memory_model})
if(MPIRUN_EXECUTABLE)
  add_test(NAME dist.fsdp.memory.dp2
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np 2
                   $<TARGET_FILE:dist_fsdp_memory_test> -- ${fsdp_memory_model})
  add_test(NAME dist.fsdp.memory.dp4_ep2
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np 4
                   $<TARGET_FILE:dist_fsdp_memory_test> -- ${fsdp_memory_model} --expert-model-parallel-size 2)
  list(APPEND fsdp_tests dist.fsdp.memory.dp2 dist.fsdp.memory.dp4_ep2)
endif()
# Checkpoints between FSDP and other layouts (fsdp_checkpoint.sh).
if(MPIRUN_EXECUTABLE AND TARGET moecore)
  add_test(NAME dist.fsdp.checkpoint
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/fsdp_checkpoint.sh $<TARGET_FILE:moecore> ${MPIRUN_EXECUTABLE}
                   ${CMAKE_CURRENT_BINARY_DIR}/fsdp_checkpoint)
  list(APPEND fsdp_tests dist.fsdp.checkpoint)
endif()
set_tests_properties(${fsdp_tests} PROPERTIES LABELS dist TIMEOUT 300 ENVIRONMENT "OMP_NUM_THREADS=1")
