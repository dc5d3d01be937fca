# Activation recomputation is exact (recompute_main.cpp): the equivalence model (equivalence.cmake: a dense and a
# MoE layer with gated shared experts, grouped experts, dropout, router input jitter, expert bias, aux / seq-aux /
# z losses) trained 5 steps without recomputation and with each recompute option, in one process and under
# TP2 + SP x EP2, PP2, CP2 and Megatron-FSDP (ZeRO-3, also with PP2), and with multi-latent attention, Multi-Token Prediction (full recomputation
# checkpoints each depth), global_aux_loss, --bf16 and FP8 delayed scaling; losses and parameters bit-identical, in one
# process the activation peak lower.
add_executable(dist_recompute_test recompute_main.cpp)
target_link_libraries(dist_recompute_test PRIVATE moecore_train)

set(recompute_variants core_attn layernorm mlp moe moe_act shared_experts selective_all full_uniform1 full_uniform2
    full_block1)
# Multi-latent attention (the report's DeepSeek-V3 attention) with q / kv latents and their norms, in place of the
# equivalence model's grouped-query attention.
string(REPLACE "--group-query-attention;--num-query-groups;2;" "" recompute_mla_model "${equiv_model}")
set(recompute_mla ${recompute_mla_model} ${equiv_aux} --multi-latent-attention --qk-layernorm --q-lora-rank 16
    --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8)
# global_aux_loss accumulates over the micro-batches: a recompute must not count them again.
set(recompute_global_aux ${equiv_model} ${equiv_global_aux})
# FP8 delayed scaling: the recompute quantizes with the scales the forward logged (amax histories untouched);
# Megatron refuses moe_act and layernorm recompute under it.
set(recompute_fp8 ${equiv_model} ${equiv_aux} --bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4)

set(recompute_tests)
# moecore_recompute(NAME NP CONFIG flags... VARIANTS v...): the variants on the configuration under mpirun -np NP.
function(moecore_recompute name np)
  cmake_parse_arguments(R "" "" "CONFIG;VARIANTS" ${ARGN})
  if(np EQUAL 1)
    set(launcher)
  elseif(MPIRUN_EXECUTABLE)
    set(launcher ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np})
  else()
    return()
  endif()
  add_test(NAME dist.recompute.${name}
           COMMAND ${launcher} $<TARGET_FILE:dist_recompute_test> --variants ${R_VARIANTS} -- ${R_CONFIG})
  set(recompute_tests ${recompute_tests} dist.recompute.${name} PARENT_SCOPE)
endfunction()

# In one process the model has four layers (two MoE): a recompute rebuilds one layer's (or checkpoint's) activations
# just before its backward, so the peak falls only where what the other layers dropped outweighs that rebuild.
moecore_recompute(np1 1 CONFIG ${equiv_model} ${equiv_pp_4l} VARIANTS ${recompute_variants})
moecore_recompute(np1_mla 1 CONFIG ${recompute_mla} VARIANTS core_attn mla_up_proj layernorm selective_all_mla
                  full_uniform1)
moecore_recompute(np1_global_aux 1 CONFIG ${recompute_global_aux} --num-layers 4 --moe-layer-freq [0,1,0,1] VARIANTS moe
                  full_uniform1)
moecore_recompute(np1_fp8_delayed 1 CONFIG ${recompute_fp8} --num-layers 4 --moe-layer-freq [0,1,0,1] VARIANTS mlp moe
                  shared_experts full_uniform2)
# LatentMoE: the MoE recompute rebuilds fc2_latent_proj's input (the combined output) even where it skips the output.
moecore_recompute(np1_latent 1 CONFIG ${equiv_model} ${equiv_latent} --num-layers 4 --moe-layer-freq [0,1,0,1]
                  VARIANTS moe moe_act shared_experts selective_all full_uniform1)
moecore_recompute(np1_mtp 1 CONFIG ${equiv_model} ${equiv_mtp} VARIANTS selective_all full_uniform1 full_block1)
moecore_recompute(np1_bf16 1 CONFIG ${equiv_model} ${equiv_pp_4l} --bf16 VARIANTS selective_all moe full_uniform1)
moecore_recompute(tp2_sp_ep2 2 CONFIG ${equiv_model} ${equiv_aux} --tensor-model-parallel-size 2 --sequence-parallel
                  --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 VARIANTS ${recompute_variants})
moecore_recompute(tp2_distributed 2 CONFIG ${equiv_model} ${equiv_aux} --tensor-model-parallel-size 2
                  VARIANTS full_uniform1 full_distributed)
moecore_recompute(dp2_distopt_overlap 2 CONFIG ${equiv_model} ${equiv_aux} --use-distributed-optimizer
                  --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000
                  VARIANTS full_uniform1 moe selective_all)
moecore_recompute(dp2_fsdp 2 CONFIG ${equiv_model} ${equiv_aux} --use-megatron-fsdp
                  VARIANTS full_uniform1 full_uniform2 moe selective_all)
moecore_recompute(pp2_dp2_fsdp 4 CONFIG ${equiv_model} ${equiv_pp_4l} --pipeline-model-parallel-size 2
                  --use-megatron-fsdp VARIANTS full_uniform1 selective_all)
moecore_recompute(pp2 2 CONFIG ${equiv_model} ${equiv_pp_4l} --pipeline-model-parallel-size 2 VARIANTS ${recompute_variants})
moecore_recompute(cp2 2 CONFIG ${equiv_model} ${equiv_aux} --context-parallel-size 2 VARIANTS ${recompute_variants})
set_tests_properties(${recompute_tests} PROPERTIES LABELS dist TIMEOUT 300 ENVIRONMENT "OMP_NUM_THREADS=1")
