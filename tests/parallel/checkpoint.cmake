# Checkpoints across layouts (checkpoint_layouts.sh): resume bit for bit and resharding under mpirun.
if(MPIRUN_EXECUTABLE AND TARGET moecore)
  add_test(NAME dist.checkpoint.layouts
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint_layouts.sh $<TARGET_FILE:moecore> ${MPIRUN_EXECUTABLE}
                   ${CMAKE_CURRENT_BINARY_DIR}/checkpoint_layouts)
  set_tests_properties(dist.checkpoint.layouts PROPERTIES LABELS dist TIMEOUT 600)
endif()
# --profile traces (profile_trace.sh): one Perfetto-loadable JSON per rank under TP2 x EP2.
if(MPIRUN_EXECUTABLE AND TARGET moecore)
  add_test(NAME dist.profile_trace
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/profile_trace.sh $<TARGET_FILE:moecore> ${MPIRUN_EXECUTABLE}
                   ${CMAKE_CURRENT_BINARY_DIR}/profile_trace)
  set_tests_properties(dist.profile_trace PROPERTIES LABELS dist TIMEOUT 300)
endif()
# The tiny DeepSeek-V3 saved under TP2 x PP2 and continued under EP2 and in one process (checkpoint_deepseek.sh).
if(MPIRUN_EXECUTABLE AND TARGET moecore)
  add_test(NAME dist.checkpoint.deepseek
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint_deepseek.sh $<TARGET_FILE:moecore> ${MPIRUN_EXECUTABLE}
                   ${CMAKE_CURRENT_BINARY_DIR}/checkpoint_deepseek)
  set_tests_properties(dist.checkpoint.deepseek PROPERTIES LABELS dist TIMEOUT 300)
endif()
# The LatentMoE recipe saved under TP2 x EP2 and continued under EP2 and in one process (checkpoint_latent.sh).
if(MPIRUN_EXECUTABLE AND TARGET moecore)
  add_test(NAME dist.checkpoint.latent
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint_latent.sh $<TARGET_FILE:moecore> ${MPIRUN_EXECUTABLE}
                   ${CMAKE_CURRENT_BINARY_DIR}/checkpoint_latent)
  set_tests_properties(dist.checkpoint.latent PROPERTIES LABELS dist TIMEOUT 300)
endif()
