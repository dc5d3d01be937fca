# The 16-bit gradient buffer under DP2 (mpirun -np 2): the DDP against a naive re-implementation of Megatron's order
# (accumulate, scale, reduce in 16 bits; fp16 overflow found by the unscale check), and the two bf16 spellings
# training bit-identically from configs/mixtral-tiny.args.
add_executable(dist_grad_buffer16_test ${CMAKE_CURRENT_SOURCE_DIR}/grad_buffer16_main.cpp)
target_link_libraries(dist_grad_buffer16_test PRIVATE moecore_optim)
moecore_mpi_test(dist.grad_buffer16 dist_grad_buffer16_test 2)
if(MPIRUN_EXECUTABLE AND TARGET moecore)
  add_test(NAME dist.grad_buffer16.train
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/grad_buffer16_train.sh $<TARGET_FILE:moecore> ${MPIRUN_EXECUTABLE}
                   ${CMAKE_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/grad_buffer16_train)
  set_tests_properties(dist.grad_buffer16.train PROPERTIES LABELS dist TIMEOUT 300)
endif()
