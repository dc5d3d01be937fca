# The precision-aware optimizer under DP2 with the distributed optimizer (mpirun -np 2): bf16 / fp8 moments and bf16
# main gradients train as the fp32-state runs do, within the rounding of the stored states.
add_executable(dist_precision_aware_test precision_aware_main.cpp)
target_link_libraries(dist_precision_aware_test PRIVATE moecore_train)
moecore_mpi_test(dist.precision_aware dist_precision_aware_test 2)
