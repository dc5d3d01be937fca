# The allgather and alltoall token dispatchers against a single-process reference, as one process and under mpirun
# with 2 and 4 ranks (EP, ETP x EP and folded layouts).
add_executable(dist_dispatchers_test test_dispatchers.cpp)
target_link_libraries(dist_dispatchers_test PRIVATE moecore_model)
moecore_mpi_test(dist.dispatchers dist_dispatchers_test 1 2 4)
# The flex dispatcher across pretend hosts (MOECORE_PRETEND_HOSTS): 2 ranks on 2 hosts, 4 ranks on 2 hosts of 2 (the
# shared-memory fan-out and the inter-host rail both used) and on 4 hosts of one.
if(MPIRUN_EXECUTABLE)
  foreach(case "2;2" "4;2" "4;4")
    list(GET case 0 np)
    list(GET case 1 hosts)
    add_test(NAME dist.dispatchers.np${np}_hosts${hosts}
             COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np} -x MOECORE_PRETEND_HOSTS
                     $<TARGET_FILE:dist_dispatchers_test>)
    set_tests_properties(dist.dispatchers.np${np}_hosts${hosts} PROPERTIES LABELS dist TIMEOUT 300
                         ENVIRONMENT "OMP_NUM_THREADS=1;MOECORE_PRETEND_HOSTS=${hosts}")
  endforeach()
endif()
