# Saved quantized inputs (ops/linear.h): under each FP8 / FP4 recipe a run that keeps the linear layers' inputs
# quantized for the weight gradient must train bit for bit as the run that keeps them in high precision, with a
# strictly lower activation peak. The tiny DeepSeek-V3 recipe (equivalence.cmake's equiv_dsv3: MLA, a dense layer,
# routed and shared experts; without its MTP depth) under --bf16 for the per-tensor, blockwise and NVFP4 recipes, with 16-bit
# activation storage; MXFP8 needs every width divisible by 32 (the recipe's kv_down_proj is 48 wide), so it runs on
# the equivalence model (standard attention with GQA, also under tensorwise scaling); the routing-map padding gives
# the experts whole blocks of rows. Recomputation of the
# modules whose inputs are kept quantized (moe_act, mlp, mla_up_proj, layernorm) and TP2 + SP (the gathered inputs)
# run under delayed scaling, whose recompute replays the forward's scales.
add_executable(dist_quantized_inputs_test quantized_inputs_main.cpp)
target_link_libraries(dist_quantized_inputs_test PRIVATE moecore_train)

set(quantized_inputs_cases
    "dsv3_delayed\;1\;dsv3\;--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4"
    "dsv3_tensorwise\;1\;dsv3\;--bf16 --fp8-format hybrid --fp8-recipe tensorwise"
    "dsv3_blockwise\;1\;dsv3\;--bf16 --fp8-format e4m3 --fp8-recipe blockwise"
    "dsv3_nvfp4\;1\;dsv3\;--bf16 --fp4-format e2m1 --fp4-recipe nvfp4 --moe-router-padding-for-quantization"
    "equiv_mxfp8\;1\;equiv\;--bf16 --fp8-format hybrid --fp8-recipe mxfp8 --moe-token-dispatcher-type alltoall --moe-router-padding-for-quantization"
    "equiv_tensorwise\;1\;equiv\;--bf16 --fp8-format hybrid --fp8-recipe tensorwise"
    "equiv_tensorwise_recompute\;1\;equiv\;--bf16 --fp8-format hybrid --fp8-recipe tensorwise --recompute-granularity selective --recompute-modules layernorm mlp core_attn"
    "dsv3_fp32_tensorwise\;1\;dsv3\;--fp8-format e4m3 --fp8-recipe tensorwise"
    "dsv3_delayed_recompute\;1\;dsv3\;--bf16 --fp8-format hybrid --fp8-recipe delayed --recompute-granularity selective --recompute-modules mlp mla_up_proj shared_experts"
    "dsv3_tensorwise_recompute\;1\;dsv3\;--bf16 --fp8-format hybrid --fp8-recipe tensorwise --recompute-granularity selective --recompute-modules moe_act mlp mla_up_proj layernorm"
    "dsv3_delayed_tp2_sp\;2\;dsv3\;--bf16 --fp8-format hybrid --fp8-recipe delayed --tensor-model-parallel-size 2 --sequence-parallel")
# Megatron's MTP depths do not run under FP8 / FP4 yet (a one-line error), so the recipe without its MTP depth.
set(equiv_dsv3_no_mtp ${equiv_dsv3})
list(FIND equiv_dsv3_no_mtp --mtp-num-layers mtp_at)
list(REMOVE_AT equiv_dsv3_no_mtp ${mtp_at})
list(REMOVE_AT equiv_dsv3_no_mtp ${mtp_at})
foreach(case ${quantized_inputs_cases})
  list(GET case 0 name)
  list(GET case 1 np)
  list(GET case 2 model)
  list(GET case 3 flags)
  separate_arguments(flags)
  if(model STREQUAL "dsv3")
    set(model_flags ${equiv_dsv3_no_mtp})
  else()
    set(model_flags ${equiv_model} ${equiv_aux})
  endif()
  if(np EQUAL 1)
    add_test(NAME dist.quantized_inputs.${name} COMMAND dist_quantized_inputs_test -- ${model_flags} ${flags})
  elseif(MPIRUN_EXECUTABLE)
    add_test(NAME dist.quantized_inputs.${name}
             COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np}
                     $<TARGET_FILE:dist_quantized_inputs_test> -- ${model_flags} ${flags})
  else()
    continue()
  endif()
  set_tests_properties(dist.quantized_inputs.${name} PROPERTIES LABELS dist TIMEOUT 300
                       ENVIRONMENT "OMP_NUM_THREADS=1")
endforeach()
