# --fp8-param-gather / --fp4-param-gather: quantized weights gathered as codes (2 and 4 ranks: the weights equal the
# one-process quantization of the main parameters, the bytes the hand count; 2 ranks: training runs' [comm] bytes
# and losses against the same recipe without the flag).
add_executable(dist_quantized_param_gather_test quantized_param_gather_main.cpp)
target_link_libraries(dist_quantized_param_gather_test PRIVATE moecore_train)
moecore_mpi_test(dist.quantized_param_gather dist_quantized_param_gather_test 2 4)
