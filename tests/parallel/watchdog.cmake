# The collective watchdog (watchdog_timeout.sh): a stopped rank ends a 2-rank run within
# --distributed-timeout-minutes + 30 s with one line naming the collective and the missing rank.
if(TARGET moecore)
  add_test(NAME dist.watchdog_timeout
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/watchdog_timeout.sh $<TARGET_FILE:moecore> ${CMAKE_SOURCE_DIR}
                   ${CMAKE_CURRENT_BINARY_DIR}/watchdog_timeout ${MPIRUN_EXECUTABLE})
  # Exits 77 when mpirun is missing: ctest reports it skipped, not passed.
  set_tests_properties(dist.watchdog_timeout PROPERTIES LABELS dist TIMEOUT 400 SKIP_RETURN_CODE 77)
endif()
