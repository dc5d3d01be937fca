# MoELayer under TP (sequence shards), EP, expert-TP and Parallel Folding against one process.
add_executable(dist_moe_parallel_test test_moe_parallel.cpp)
target_link_libraries(dist_moe_parallel_test PRIVATE moecore_model)
moecore_mpi_test(dist.moe_parallel dist_moe_parallel_test 1 2 4)
