# The training log under data parallelism (mpirun -np 2) against one process: the global aux loss and the lm losses
# a DP2 run logs equal the one-process run's on the same global batch, the throughput figure divides by the world
# size, dp_size / dp_rank vs dp_cp_size / dp_cp_rank under context parallelism, and the params norm and number of
# zero gradients of 2-rank layouts against one process.
add_executable(dist_train_logging_test train_logging_main.cpp)
target_link_libraries(dist_train_logging_test PRIVATE moecore_train)
moecore_mpi_test(dist.train_logging dist_train_logging_test 2)
