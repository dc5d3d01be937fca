# The training state (parameters, buffers, Adam moments, scheduler, progress) of a tiny MoE model under TP2 x EP2
# (sequence parallel, expert-TP 1), with and without the distributed optimizer, against the one-process state.
add_executable(dist_training_state_test ${CMAKE_CURRENT_SOURCE_DIR}/training_state_main.cpp)
target_link_libraries(dist_training_state_test PRIVATE moecore_train)
set(training_state_tests dist.training_state.np1)
add_test(NAME dist.training_state.np1 COMMAND dist_training_state_test)
if(MPIRUN_EXECUTABLE)
  add_test(NAME dist.training_state.tp2_ep2
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np 4
                   $<TARGET_FILE:dist_training_state_test>)
  add_test(NAME dist.training_state.tp2_ep2_distopt
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np 4
                   $<TARGET_FILE:dist_training_state_test> --use-distributed-optimizer)
  list(APPEND training_state_tests dist.training_state.tp2_ep2 dist.training_state.tp2_ep2_distopt)
endif()
set_tests_properties(${training_state_tests} PROPERTIES LABELS dist TIMEOUT 300
                     ENVIRONMENT "OMP_NUM_THREADS=1;MOECORE_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
