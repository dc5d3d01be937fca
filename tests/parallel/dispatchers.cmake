# The allgather and alltoall token dispatchers against a single-process reference, as one process and under mpirun
# with 2 and 4 ranks (EP, ETP x EP and folded layouts).
add_executable(dist_dispatchers_test test_dispatchers.cpp)
target_link_libraries(dist_dispatchers_test PRIVATE moecore_model)
moecore_mpi_test(dist.dispatchers dist_dispatchers_test 1 2 4)
