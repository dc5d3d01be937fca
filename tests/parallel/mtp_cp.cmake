# Multi-Token Prediction under context parallelism (mtp_cp_main.cpp, mpirun -np 2): the depths' rolls across the CP
# chunks, their losses and every gradient against the one-process model.
add_executable(dist_mtp_cp_test mtp_cp_main.cpp)
target_link_libraries(dist_mtp_cp_test PRIVATE moecore_train)
moecore_mpi_test(dist.mtp_cp dist_mtp_cp_test 2)
