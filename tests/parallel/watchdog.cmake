# The collective watchdog. watchdog_main.cpp: rank 1 of 2 stays out of MPI while rank 0 waits, with a 1 s timeout;
# rank 0's one line names the operation, the group and rank 1 (the job is aborted: the tests match the line).
# watchdog_timeout.sh: a stopped rank ends a 2-rank `moecore train` within --distributed-timeout-minutes + 30 s.
add_executable(dist_watchdog_test ${CMAKE_CURRENT_SOURCE_DIR}/watchdog_main.cpp)
target_link_libraries(dist_watchdog_test PRIVATE moecore_parallel)
if(MPIRUN_EXECUTABLE)
  set(group "on process group dp \\(ranks 0,1\\) did not complete within 0.0166667 minutes: ")
  set(last "\\(last collectives: .*all_reduce on dp #1 \\(16 elements\\) completed")
  set(watchdog_expect
      all_reduce "error: collective all_reduce ${group}ranks 1 did not arrive ${last}.*all_reduce on dp #3 \\(16 elements\\) timed out\\)"
      async "error: collective all_reduce_async ${group}ranks 1 did not arrive ${last}.*all_reduce_async on dp #3 \\(16 elements\\) timed out\\)"
      recv "error: recv from rank 1 ${group}rank 1 did not post the matching send ${last}")
  set(names)
  while(watchdog_expect)
    list(POP_FRONT watchdog_expect mode expected)
    add_test(NAME dist.watchdog.${mode}
             COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np 2 $<TARGET_FILE:dist_watchdog_test>
                     ${mode})
    set_tests_properties(dist.watchdog.${mode} PROPERTIES PASS_REGULAR_EXPRESSION "${expected}")
    list(APPEND names dist.watchdog.${mode})
  endwhile()
  add_test(NAME dist.watchdog.healthy
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np 2 $<TARGET_FILE:dist_watchdog_test>
                   healthy)
  list(APPEND names dist.watchdog.healthy)
  set_tests_properties(${names} PROPERTIES LABELS dist TIMEOUT 60 ENVIRONMENT "OMP_NUM_THREADS=1")
endif()
if(TARGET moecore)
  add_test(NAME dist.watchdog_timeout
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/watchdog_timeout.sh $<TARGET_FILE:moecore> ${CMAKE_SOURCE_DIR}
                   ${CMAKE_CURRENT_BINARY_DIR}/watchdog_timeout ${MPIRUN_EXECUTABLE})
  # Exits 77 when mpirun is missing: ctest reports it skipped, not passed.
  set_tests_properties(dist.watchdog_timeout PROPERTIES LABELS dist TIMEOUT 400 SKIP_RETURN_CODE 77)
endif()
