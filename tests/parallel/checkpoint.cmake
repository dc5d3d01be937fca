# Checkpoints across layouts (checkpoint_layouts.sh): resume bit for bit and resharding under mpirun.
if(MPIRUN_EXECUTABLE AND TARGET moecore)
  add_test(NAME dist.checkpoint.layouts
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint_layouts.sh $<TARGET_FILE:moecore> ${MPIRUN_EXECUTABLE}
                   ${CMAKE_CURRENT_BINARY_DIR}/checkpoint_layouts)
  set_tests_properties(dist.checkpoint.layouts PROPERTIES LABELS dist TIMEOUT 600)
endif()
