# Data parallelism (bucketed gradient reduction, distributed optimizer) against a single-process AdamW reference.
add_executable(dist_ddp_test ${CMAKE_CURRENT_SOURCE_DIR}/test_ddp.cpp)
target_link_libraries(dist_ddp_test PRIVATE moecore_optim)
moecore_mpi_test(dist.ddp dist_ddp_test 1 2 4)
