# Context-parallel attention under bf16 / fp16 activations (cp_precision_main.cpp, mpirun -np 2 and 4): every
# --cp-comm-type keeps its partial results in fp32 and rounds what it returns once (TransformerEngine's ring
# attention), bit for bit the fp32 result rounded once, forward and backward; the fp32 output and gradients are the
# one-process attention's; value heads as wide as the query / key heads, narrower and wider (v_head_dim).
add_executable(dist_cp_precision_test cp_precision_main.cpp)
target_link_libraries(dist_cp_precision_test PRIVATE moecore_model)
moecore_mpi_test(dist.cp_precision dist_cp_precision_test 2 4)
