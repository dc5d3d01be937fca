# FP8 delayed scaling under DP2 against one process (the amax reduction over TP x DP x CP).
add_executable(dist_delayed_scaling_test test_delayed_scaling.cpp)
target_link_libraries(dist_delayed_scaling_test PRIVATE moecore_model)
moecore_mpi_test(dist.delayed_scaling dist_delayed_scaling_test 1 2)
