# Layout equivalence: a tiny MoE GPT (dropout, input jitter, sigmoid router with expert bias, aux + seq-aux +
# z losses, gated shared experts, one dense and one MoE layer) trained 5 steps in one process, then under each
# layout with mpirun; every iteration's lm loss within relative 1e-5 and the final parameters within 1e-4.
add_executable(dist_equivalence_test equivalence_main.cpp)
target_link_libraries(dist_equivalence_test PRIVATE moecore_train)

set(equiv_model
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --seq-length 16 --max-position-embeddings 16 --normalization RMSNorm --swiglu --disable-bias-linear
    --position-embedding-type rope --attention-dropout 0.1 --hidden-dropout 0.1 --ffn-hidden-size 64
    --micro-batch-size 2 --global-batch-size 8 --train-iters 5 --lr 1e-3 --clip-grad 1.0 --log-interval 1
    --eval-interval 100 --eval-iters 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 200 --seed 7
    --num-experts 8 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-layer-freq [0,1] --moe-grouped-gemm
    --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate --moe-input-jitter-eps 0.01 --adam-eps 1e-6)
# --adam-eps 1e-6 instead of Megatron's 1e-8: Adam turns a gradient element far below eps into a step of about
# lr x sign, so the rounding of an almost-vanishing gradient (an expert that got few tokens, where the sum cancels)
# could move a parameter by lr; with eps 1e-6 such elements step in proportion to their (tiny) gradient, while every
# gradient of ordinary size (~1e-3 here) is still normalised and any real gradient error still shows.
# Every auxiliary loss that is layout-invariant under data parallelism (global_aux_loss is a running average over
# the micro-batches one DP rank sees, so it differs with DP by Megatron's definition; it gets TP-only layouts).
set(equiv_aux --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01
    --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.01 --moe-z-loss-coeff 0.001)
set(equiv_global_aux --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss --moe-aux-loss-coeff 0.01 0.01 0.01
    --moe-z-loss-coeff 0.001)
set(equiv_capacity --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001
    --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --moe-token-dispatcher-type alltoall)

# Pipeline layouts: the same model with 8 layers (dense, then MoE, alternating), so that PP 4 x VPP 2 has a layer per
# chunk; references with 4 micro-batches (mbs 2), 8 micro-batches (mbs 1) and untied embeddings.
set(equiv_pp --num-layers 8 --moe-layer-freq [0,1,0,1,0,1,0,1] ${equiv_aux})
set(equiv_pp_mb8 ${equiv_pp} --micro-batch-size 1)
set(equiv_pp_untied ${equiv_pp} --untie-embeddings-and-output-weights)
set(equiv_pp_global_aux --num-layers 8 --moe-layer-freq [0,1,0,1,0,1,0,1] ${equiv_global_aux})
# Pipelines with tensor parallelism on 4 layers: with 8, the tensor-parallel reduction order alone moves a parameter
# by up to 2e-4 relative after 5 Adam steps in the sanitizer build (the same for TP2 without a pipeline).
set(equiv_pp_4l --num-layers 4 --moe-layer-freq [0,1,0,1] ${equiv_aux})
# Packed sequences: mock documents of at most 8 tokens, so each 16-token sequence packs several (EOD-separated).
# (No --eod-mask-loss: under CP each rank's loss is its own token mean, as Megatron, which equals the one-process
# objective only when every rank has as many unmasked tokens.)
set(equiv_packed ${equiv_aux} --mock-max-sequence-length 8 --reset-position-ids --reset-attention-mask)
# bf16 mixed precision: 16-bit weights and activations, compared by the size of the updates (equivalence_main.cpp,
# Tolerances: loss 1e-3, RMS difference over RMS update + one bf16 ulp 0.25; measured at most 0.13).
set(equiv_bf16 ${equiv_aux} --bf16)
# The probabilities applied to the experts' output instead of fc2's input (--no-moe-memory-efficient-permutation).
set(equiv_no_mep ${equiv_aux} --no-moe-memory-efficient-permutation)
# Multi-Token Prediction: two depths after the MoE last layer (MoE depth layers, their embedding and layer dropout).
set(equiv_mtp ${equiv_aux} --mtp-num-layers 2 --mtp-loss-scaling-factor 0.5)
# MTP under pipelines: 4 layers (the last MoE), tied and untied (the loss stage keeps a copy of the word embedding
# for the MTP input, summed over the embedding group).
set(equiv_pp_mtp --num-layers 4 --moe-layer-freq [0,1,0,1] ${equiv_mtp})
set(equiv_pp_mtp_untied ${equiv_pp_mtp} --untie-embeddings-and-output-weights)
# Megatron's per-token loss over packed documents with their EOD tokens masked (uneven loss tokens per rank and
# micro-batch): the objective is the global token mean, so every layout (CP and DP included) equals one process.
set(equiv_per_token ${equiv_packed} --eod-mask-loss --calculate-per-token-loss)
set(equiv_per_token_mtp ${equiv_per_token} --mtp-num-layers 1)
# MTP over packed documents (the depths shift over the whole sequence, as Megatron's roll_tensor without THD).
set(equiv_mtp_packed ${equiv_packed} --mtp-num-layers 2)
# LatentMoE: the routed experts in a width of 16 (hidden 32) between fc1_latent_proj and fc2_latent_proj.
set(equiv_latent ${equiv_aux} --moe-latent-size 16)
set(equiv_latent_bf16 ${equiv_bf16} --moe-latent-size 16)
# Whole variable-length samples (train/packed_samples.h): data/rl_samples.jsonl holds 24 samples of 3 to 16 tokens
# with their prompt tokens masked; one per micro-batch (the reference) or packed into bins (Megatron-RL's packer), the
# per-token loss over the same tokens. No dropout, router jitter or balancing losses: those depend on how the tokens
# are grouped into micro-batches, not on the samples alone.
string(REPLACE "--mock-data;" "" equiv_samples_model "${equiv_model}")
set(equiv_samples --micro-batch-size 1 --eval-iters 0 --attention-dropout 0 --hidden-dropout 0
    --moe-input-jitter-eps 0 --moe-router-load-balancing-type none --moe-aux-loss-coeff 0 --calculate-per-token-loss
    --sample-data-path ${CMAKE_CURRENT_SOURCE_DIR}/data/rl_samples.jsonl)

set(equiv_dir ${CMAKE_CURRENT_BINARY_DIR}/equivalence)
file(MAKE_DIRECTORY ${equiv_dir})
set(equiv_tests)
# moecore_equiv_reference(CONFIG ARGS...): the one-process run of a configuration.
# (The whole-sample configurations replace the model's --mock-data by their samples.)
function(moecore_equiv_reference config)
  set(model ${equiv_model})
  if(config MATCHES "^samples")
    set(model ${equiv_samples_model})
  endif()
  add_test(NAME dist.equiv.${config}.reference
           COMMAND dist_equivalence_test --out ${equiv_dir}/${config}.bin -- ${model} ${ARGN})
  set_tests_properties(dist.equiv.${config}.reference PROPERTIES FIXTURES_SETUP equiv_${config})
  set(equiv_tests ${equiv_tests} dist.equiv.${config}.reference PARENT_SCOPE)
endfunction()
# moecore_equiv(NAME CONFIG NP ARGS...): the same configuration under mpirun -np NP with layout flags ARGS.
function(moecore_equiv name config np)
  if(NOT MPIRUN_EXECUTABLE)
    return()
  endif()
  set(config_args ${equiv_aux})
  if(config STREQUAL "global_aux")
    set(config_args ${equiv_global_aux})
  elseif(config STREQUAL "capacity")
    set(config_args ${equiv_capacity})
  elseif(config MATCHES "^pp" OR config STREQUAL "packed" OR config STREQUAL "bf16" OR config MATCHES "^mtp" OR
         config STREQUAL "no_mep" OR config MATCHES "^per_token" OR config MATCHES "^latent" OR config STREQUAL "samples")
    set(config_args ${equiv_${config}})
  endif()
  set(model ${equiv_model})
  if(config MATCHES "^samples")
    set(model ${equiv_samples_model})
  endif()
  add_test(NAME dist.equiv.${name}
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np}
                   $<TARGET_FILE:dist_equivalence_test> --compare ${equiv_dir}/${config}.bin -- ${model}
                   ${config_args} ${ARGN})
  set_tests_properties(dist.equiv.${name} PROPERTIES FIXTURES_REQUIRED equiv_${config})
  set(equiv_tests ${equiv_tests} dist.equiv.${name} PARENT_SCOPE)
endfunction()

moecore_equiv_reference(aux ${equiv_aux})
moecore_equiv_reference(global_aux ${equiv_global_aux})
moecore_equiv_reference(capacity ${equiv_capacity})
moecore_equiv_reference(pp ${equiv_pp})
moecore_equiv_reference(pp_mb8 ${equiv_pp_mb8})
moecore_equiv_reference(pp_untied ${equiv_pp_untied})
moecore_equiv_reference(pp_global_aux ${equiv_pp_global_aux})
moecore_equiv_reference(pp_4l ${equiv_pp_4l})
moecore_equiv_reference(packed ${equiv_packed})
moecore_equiv_reference(bf16 ${equiv_bf16})
moecore_equiv_reference(per_token ${equiv_per_token})
moecore_equiv_reference(per_token_mtp ${equiv_per_token_mtp})
moecore_equiv_reference(no_mep ${equiv_no_mep})
moecore_equiv_reference(mtp ${equiv_mtp})
moecore_equiv_reference(pp_mtp ${equiv_pp_mtp})
moecore_equiv_reference(mtp_packed ${equiv_mtp_packed})
moecore_equiv_reference(pp_mtp_untied ${equiv_pp_mtp_untied})
moecore_equiv_reference(latent ${equiv_latent})
moecore_equiv_reference(latent_bf16 ${equiv_latent_bf16})
moecore_equiv_reference(samples ${equiv_samples})

moecore_equiv(dp2 aux 2)
moecore_equiv(dp2_overlap aux 2 --overlap-grad-reduce --ddp-bucket-size 2000)
moecore_equiv(dp2_distopt aux 2 --use-distributed-optimizer)
moecore_equiv(dp2_distopt_overlap aux 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
              --ddp-bucket-size 2000)
moecore_equiv(tp2 aux 2 --tensor-model-parallel-size 2)
moecore_equiv(tp2_sp aux 2 --tensor-model-parallel-size 2 --sequence-parallel)
moecore_equiv(tp2_global_aux global_aux 2 --tensor-model-parallel-size 2)
moecore_equiv(tp2_sp_global_aux global_aux 2 --tensor-model-parallel-size 2 --sequence-parallel)
moecore_equiv(ep2 aux 2 --expert-model-parallel-size 2)
moecore_equiv(ep2_capacity_pad capacity 2 --expert-model-parallel-size 2)
moecore_equiv(tp2_sp_ep2_no_mep no_mep 2 --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2
              --expert-tensor-parallel-size 1)
moecore_equiv(tp2_ep2_folded aux 2 --tensor-model-parallel-size 2 --sequence-parallel
              --expert-model-parallel-size 2 --expert-tensor-parallel-size 1)
moecore_equiv(ep4_allgather aux 4 --expert-model-parallel-size 4 --moe-token-dispatcher-type allgather)
moecore_equiv(ep4_alltoall aux 4 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall)
# The flex dispatcher on two pretend hosts (variants_flex.cmake sets MOECORE_PRETEND_HOSTS=2).
moecore_equiv(flex_ep4_hosts2 aux 4 --expert-model-parallel-size 4 --moe-token-dispatcher-type flex)
moecore_equiv(tp2_ep4_folded aux 4 --tensor-model-parallel-size 2 --sequence-parallel
              --expert-model-parallel-size 4 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall)
moecore_equiv(etp2_ep2 aux 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2
              --expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall)
moecore_equiv(dp2_ep2_tp2_np8 aux 8 --tensor-model-parallel-size 2 --sequence-parallel
              --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer
              --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000)

# Pipeline parallelism: 1F1B, interleaved, uneven and layout-string splits, and PP composed with every other dimension.
moecore_equiv(pp2 pp 2 --pipeline-model-parallel-size 2)
moecore_equiv(pp4 pp 4 --pipeline-model-parallel-size 4)
moecore_equiv(pp2_mb8 pp_mb8 2 --pipeline-model-parallel-size 2)
moecore_equiv(pp2_vpp2 pp 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
moecore_equiv(pp2_vpp2_mb8 pp_mb8 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2)
moecore_equiv(pp4_vpp2 pp 4 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2)
moecore_equiv(pp4_vpp2_no_overlap pp_mb8 4 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2
              --no-overlap-p2p-communication --microbatch-group-size-per-virtual-pipeline-stage 4)
moecore_equiv(pp4_uneven pp 4 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1
              --decoder-last-pipeline-num-layers 3)
moecore_equiv(pp2_layout_vpp pp 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E|tttt|tttt|L)
moecore_equiv(pp4_layout pp 4 --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout E|ttt|ttttt|L)
moecore_equiv(pp2_account pp 2 --pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split
              --account-for-loss-in-pipeline-split)
moecore_equiv(pp2_untied pp_untied 2 --pipeline-model-parallel-size 2)
moecore_equiv(pp2_global_aux pp_global_aux 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
moecore_equiv(pp2_tp2_sp pp_4l 4 --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
moecore_equiv(pp2_ep2 pp 4 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2
              --moe-token-dispatcher-type alltoall)
moecore_equiv(pp2_ep2_allgather pp 4 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2
              --moe-token-dispatcher-type allgather)
moecore_equiv(pp2_dp2_distopt pp 4 --pipeline-model-parallel-size 2 --use-distributed-optimizer
              --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000)
moecore_equiv(pp2_tp2_ep2_np8 pp_4l 8 --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2
              --sequence-parallel --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall)

# Context parallelism: each sequence in 2 x CP chunks (rank r holds r and 2CP-1-r), every attention comm type, and CP
# composed with TP + SP, EP folded over the CP ranks, DP with the distributed optimizer, and packed sequences.
moecore_equiv(cp2_p2p aux 2 --context-parallel-size 2 --cp-comm-type p2p)
moecore_equiv(cp4_p2p aux 4 --context-parallel-size 4)
moecore_equiv(cp2_a2a aux 2 --context-parallel-size 2 --cp-comm-type a2a)
moecore_equiv(cp2_allgather aux 2 --context-parallel-size 2 --cp-comm-type all_gather)
moecore_equiv(cp2_tp2_sp aux 4 --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
moecore_equiv(cp2_ep2 aux 2 --context-parallel-size 2 --expert-model-parallel-size 2
              --moe-token-dispatcher-type alltoall)
moecore_equiv(cp2_packed packed 2 --context-parallel-size 2)
moecore_equiv(cp2_packed_a2a packed 2 --context-parallel-size 2 --cp-comm-type a2a)
moecore_equiv(pp2_cp2 pp_4l 4 --pipeline-model-parallel-size 2 --context-parallel-size 2)
moecore_equiv(cp2_dp2_distopt aux 4 --context-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce
              --ddp-bucket-size 2000)


# Multi-Token Prediction under DP with the distributed optimizer, TP (eh_proj column-parallel, gathered, then the
# sequence shard under SP), EP and TP x EP.
# Megatron-FSDP (optim/fsdp.h): each sharding strategy under DP2 (two micro-batches per rank, so optim_grads and
# optim_grads_params accumulate reduce-scattered micro-batches into the shards), EP2 over 4 ranks (dense parameters
# sharded over dp-cp 4, experts over expert-DP 2) and over 2 (experts whole: expert-DP 1), TP2 + SP x DP2, TP2 x EP2
# x DP2 on 8 ranks (dense over dp-cp 2, experts over expert-DP 2), PP2 x DP2 (with VPP 2: the tied embedding's copies
# outside the units), CP2 x DP2 (dense over dp-cp 4) and MTP (its depths outside the units); the default strategy is
# optim_grads_params.
moecore_equiv(fsdp_dp2_no_shard aux 2 --use-megatron-fsdp --data-parallel-sharding-strategy no_shard)
moecore_equiv(fsdp_dp2_optim aux 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim)
moecore_equiv(fsdp_dp2_optim_grads aux 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads)
moecore_equiv(fsdp_dp2_optim_grads_params aux 2 --use-megatron-fsdp)
moecore_equiv(fsdp_dp4_ep2 aux 4 --use-megatron-fsdp --expert-model-parallel-size 2
              --moe-token-dispatcher-type alltoall)
moecore_equiv(fsdp_tp2_sp_dp2 aux 4 --use-megatron-fsdp --tensor-model-parallel-size 2 --sequence-parallel)
moecore_equiv(fsdp_dp2_ep2 aux 2 --use-megatron-fsdp --expert-model-parallel-size 2
              --moe-token-dispatcher-type alltoall)
moecore_equiv(fsdp_tp2_ep2_dp2_np8 aux 8 --use-megatron-fsdp --tensor-model-parallel-size 2 --sequence-parallel
              --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall)
moecore_equiv(fsdp_pp2_dp2 pp 4 --use-megatron-fsdp --pipeline-model-parallel-size 2)
moecore_equiv(fsdp_pp2_vpp2_dp2 pp 4 --use-megatron-fsdp --pipeline-model-parallel-size 2
              --num-virtual-stages-per-pipeline-rank 2)
moecore_equiv(fsdp_cp2_dp2 aux 4 --use-megatron-fsdp --context-parallel-size 2)
moecore_equiv(fsdp_dp2_optim_overlap aux 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim
              --overlap-grad-reduce --overlap-param-gather)
moecore_equiv(fsdp_dp2_optim_grads_params_overlap aux 2 --use-megatron-fsdp --overlap-grad-reduce
              --overlap-param-gather)
moecore_equiv(fsdp_mtp_dp2 mtp 2 --use-megatron-fsdp)
# bf16 weights under Megatron-FSDP: bf16 gradients (Megatron-FSDP's main grads dtype auto) reduce-scattered and
# accumulated in bf16, against the one-process bf16 run (fp32 gradients) with the bf16 tolerances.
moecore_equiv(fsdp_bf16_dp2 bf16 2 --use-megatron-fsdp)
moecore_equiv(fsdp_bf16_dp4_ep2 bf16 4 --use-megatron-fsdp --expert-model-parallel-size 2
              --moe-token-dispatcher-type alltoall)
moecore_equiv(fsdp_bf16_dp2_optim bf16 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim)
# optim_grads: whole bf16 weights gathered after the step through a wire the unit's bucket holds only meanwhile.
moecore_equiv(fsdp_bf16_dp2_optim_grads bf16 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads)
moecore_equiv(fsdp_bf16_dp2_optim_grads_overlap bf16 2 --use-megatron-fsdp --data-parallel-sharding-strategy
              optim_grads --overlap-param-gather)

moecore_equiv(mtp_dp2_distopt mtp 2 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 2000)
moecore_equiv(mtp_tp2 mtp 2 --tensor-model-parallel-size 2)
moecore_equiv(mtp_tp2_sp mtp 2 --tensor-model-parallel-size 2 --sequence-parallel)
moecore_equiv(mtp_ep2 mtp 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall)
moecore_equiv(mtp_tp2_sp_ep2_folded mtp 2 --tensor-model-parallel-size 2 --sequence-parallel
              --expert-model-parallel-size 2 --expert-tensor-parallel-size 1)
moecore_equiv(mtp_etp2_ep2 mtp 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2
              --expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall)
moecore_equiv(mtp_packed_dp2 mtp_packed 2)
moecore_equiv(mtp_packed_tp2_sp mtp_packed 2 --tensor-model-parallel-size 2 --sequence-parallel)
moecore_equiv(mtp_pp2 pp_mtp 2 --pipeline-model-parallel-size 2)
moecore_equiv(mtp_pp2_untied pp_mtp_untied 2 --pipeline-model-parallel-size 2)
moecore_equiv(mtp_pp2_vpp2 pp_mtp 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
moecore_equiv(mtp_pp2_layout_untied pp_mtp_untied 2 --pipeline-model-parallel-size 2
              --pipeline-model-parallel-layout Et|tttmmL)
moecore_equiv(mtp_pp2_tp2_sp pp_mtp 4 --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2
              --sequence-parallel)
moecore_equiv(mtp_pp2_dp2_distopt_untied pp_mtp_untied 4 --pipeline-model-parallel-size 2 --use-distributed-optimizer
              --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000)

# bf16 under the layouts, against the one-process bf16 run: the distributed optimizer with gradients reduced in bf16,
# TP2 + SP with EP2 folded, CP2, and TP2 x EP2 over 4 ranks.
moecore_equiv(bf16_dp2_distopt_grad_bf16 bf16 2 --use-distributed-optimizer --grad-reduce-in-bf16)
moecore_equiv(bf16_tp2_ep2_folded bf16 2 --tensor-model-parallel-size 2 --sequence-parallel
              --expert-model-parallel-size 2 --expert-tensor-parallel-size 1)
moecore_equiv(bf16_cp2 bf16 2 --context-parallel-size 2)
moecore_equiv(bf16_tp2_ep2 bf16 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2
              --moe-token-dispatcher-type alltoall)
# --calculate-per-token-loss with uneven loss masks: DP2 (distributed optimizer), CP2, DP2 x CP2 with EP2, TP2 x EP2,
# PP2, and one MTP depth under DP2. (Not the MTP depth under CP: Megatron rescales a depth's loss by this rank's
# main / depth token counts, "exact parity for packed or uneven valid-token distributions across DP/CP ranks would
# require all-reduced counts", multi_token_prediction.py.)
moecore_equiv(per_token_dp2 per_token 2 --use-distributed-optimizer)
moecore_equiv(per_token_cp2 per_token 2 --context-parallel-size 2)
moecore_equiv(per_token_dp2_cp2_ep2 per_token 4 --context-parallel-size 2 --expert-model-parallel-size 2)
moecore_equiv(per_token_tp2_ep2 per_token 4 --tensor-model-parallel-size 2 --sequence-parallel
              --expert-model-parallel-size 2)
moecore_equiv(per_token_pp2 per_token 2 --pipeline-model-parallel-size 2)
moecore_equiv(per_token_mtp_dp2 per_token_mtp 2)
# LatentMoE under EP2 (the dispatcher moves latent rows), TP2 + SP (the replicated projections' gradients summed over
# TP) and TP2 x EP2 with the experts' latent width sharded over expert-TP 2.
moecore_equiv(latent_ep2 latent 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall)
moecore_equiv(latent_tp2_sp latent 2 --tensor-model-parallel-size 2 --sequence-parallel)
# With the EP overlap (combined 1F1B, delayed weight gradients), which needs 16-bit weights.
moecore_equiv(latent_bf16_ep2_overlap latent_bf16 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
              --overlap-moe-expert-parallel-comm --delay-wgrad-compute)
moecore_equiv(latent_tp2_ep2 latent 4 --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2
              --moe-token-dispatcher-type alltoall)
# Packed whole samples against each sample alone: one process, DP2 (fifo and round-robin bins, padding bins), CP2 (slots
# aligned to 2 x CP), PP2 in the serpentine order, EP2.
moecore_equiv(samples_packed samples 1 --rl-use-sequence-packing)
moecore_equiv(samples_packed_dp2 samples 2 --rl-use-sequence-packing)
moecore_equiv(samples_packed_dp2_round_robin samples 2 --rl-use-sequence-packing --rl-sequence-packing-algo round-robin
              --rl-sequence-packing-max-sequences-per-bin 2)
moecore_equiv(samples_packed_cp2 samples 2 --rl-use-sequence-packing --context-parallel-size 2)
moecore_equiv(samples_packed_pp2_serpentine samples 2 --rl-use-sequence-packing --pipeline-model-parallel-size 2
              --rl-microbatch-order serpentine)
moecore_equiv(samples_packed_ep2 samples 2 --rl-use-sequence-packing --expert-model-parallel-size 2
              --moe-token-dispatcher-type alltoall)
# Dynamic context parallelism (Megatron's BalancedCPScheduler) on 4 ranks: samples of up to 16 tokens with at most 4
# per rank run on groups of 1, 2 and 4 ranks; as DP4 and as DP2 x CP2.
moecore_equiv(samples_hybrid_cp_dp4 samples 4 --hybrid-context-parallel --max-seqlen-per-dp-cp-rank 4)
moecore_equiv(samples_hybrid_cp_dp2_cp2 samples 4 --hybrid-context-parallel --max-seqlen-per-dp-cp-rank 4
              --context-parallel-size 2)
# Megatron's EP all-to-all overlap (combined 1F1B, weight gradients delayed) against one process.
moecore_equiv(bf16_ep2_overlap bf16 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
              --overlap-moe-expert-parallel-comm --delay-wgrad-compute)

# The tiny DeepSeek-V3 recipe (configs/deepseek-v3-tiny.args: multi-latent attention with YaRN, sigmoid group-limited
# routing with expert bias, a shared expert, a dense first layer), 5 steps of 8 sequences of 64 tokens, under the
# layouts DeepSeek-V3 trains with: TP2 + SP, CP2 (p2p and a2a), EP2 folded over TP2, DP2 with the distributed
# optimizer, PP2 with the MTP depth on the last stage (by default and by a layout string with m).
file(STRINGS ${CMAKE_SOURCE_DIR}/configs/deepseek-v3-tiny.args dsv3_recipe_lines REGEX "^[^#]")
set(equiv_dsv3)
foreach(line IN LISTS dsv3_recipe_lines)
  separate_arguments(words UNIX_COMMAND "${line}")
  list(APPEND equiv_dsv3 ${words})
endforeach()
# 1023 tokens + EOD = 1024 rows under any TP <= 8 (the recipe's 1024 + 1 pads to 1152 rows on one rank, 1280 on TP2:
# a different model, as in Megatron).
list(APPEND equiv_dsv3 --train-iters 5 --lr-warmup-iters 1 --eval-interval 100 --eval-iters 1 --log-interval 1
     --micro-batch-size 2 --global-batch-size 8 --seq-length 64 --vocab-size 1023 --adam-eps 1e-6 --seed 7)
add_test(NAME dist.equiv.dsv3.reference COMMAND dist_equivalence_test --out ${equiv_dir}/dsv3.bin -- ${equiv_dsv3})
set_tests_properties(dist.equiv.dsv3.reference PROPERTIES FIXTURES_SETUP equiv_dsv3)
set(equiv_tests ${equiv_tests} dist.equiv.dsv3.reference)
function(moecore_equiv_dsv3 name np)
  if(NOT MPIRUN_EXECUTABLE)
    return()
  endif()
  add_test(NAME dist.equiv.dsv3_${name}
           COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np ${np}
                   $<TARGET_FILE:dist_equivalence_test> --compare ${equiv_dir}/dsv3.bin -- ${equiv_dsv3} ${ARGN})
  set_tests_properties(dist.equiv.dsv3_${name} PROPERTIES FIXTURES_REQUIRED equiv_dsv3)
  set(equiv_tests ${equiv_tests} dist.equiv.dsv3_${name} PARENT_SCOPE)
endfunction()
moecore_equiv_dsv3(tp2_sp 2 --tensor-model-parallel-size 2 --sequence-parallel)
moecore_equiv_dsv3(tp2_sp_ep2_folded 2 --tensor-model-parallel-size 2 --sequence-parallel
                   --expert-model-parallel-size 2 --expert-tensor-parallel-size 1)
moecore_equiv_dsv3(dp2_distopt 2 --use-distributed-optimizer)
# Context parallelism without the MTP depth: Megatron's MTP loss under CP is each CP rank's own token mean, and the
# rank holding the sequence's end shifts fewer positions in, so the objective is not the one-process one by
# definition (dist.mtp_cp checks MTP under CP with a mask that gives the ranks equal counts).
add_test(NAME dist.equiv.dsv3_no_mtp.reference
         COMMAND dist_equivalence_test --out ${equiv_dir}/dsv3_no_mtp.bin -- ${equiv_dsv3} --mtp-num-layers 0)
set_tests_properties(dist.equiv.dsv3_no_mtp.reference PROPERTIES FIXTURES_SETUP equiv_dsv3_no_mtp)
set(equiv_tests ${equiv_tests} dist.equiv.dsv3_no_mtp.reference)
foreach(comm p2p a2a)
  if(MPIRUN_EXECUTABLE)
    add_test(NAME dist.equiv.dsv3_cp2_${comm}
             COMMAND ${MPIRUN_EXECUTABLE} --allow-run-as-root --oversubscribe -np 2 $<TARGET_FILE:dist_equivalence_test>
                     --compare ${equiv_dir}/dsv3_no_mtp.bin -- ${equiv_dsv3} --mtp-num-layers 0
                     --context-parallel-size 2 --cp-comm-type ${comm})
    set_tests_properties(dist.equiv.dsv3_cp2_${comm} PROPERTIES FIXTURES_REQUIRED equiv_dsv3_no_mtp)
    set(equiv_tests ${equiv_tests} dist.equiv.dsv3_cp2_${comm})
  endif()
endforeach()
# The MTP depth on the last pipeline stage (the default) and placed by a layout string beside the loss.
moecore_equiv_dsv3(pp2 2 --pipeline-model-parallel-size 2)
moecore_equiv_dsv3(pp2_layout_m 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttmL)

set_tests_properties(${equiv_tests} PROPERTIES LABELS dist TIMEOUT 300 ENVIRONMENT "OMP_NUM_THREADS=1")
