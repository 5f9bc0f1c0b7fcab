"""Minimal configs of every mlx-lm architecture a tiny text-only config can build; CACHE_KINDS
records which cache classes each uses.

Keys are module names under mlx_lm.models (mlx-lm 0.32.2); build one with
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(ARCH_CONFIGS[arch]))
Hybrid models have at least one layer of each kind (recurrent/SSM/linear and attention), MoE models a few
32-wide experts, sliding-window layers a window of 8 (shorter than a 20-token prompt). Random init as is:
talkie's lm_head starts at zero (flat logits) until its weights are randomised.
"""

VOCAB = 49152

# Shared fields of a plain tiny decoder (hidden 64, 4 heads of 16, 2 kv heads, 2 layers); keys a
# ModelArgs does not declare are dropped by its from_dict.
_B = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB,
          max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)
# Small MoE: 4 experts of width 32, 2 per token (the field names vary by family).
_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32)
# Small multi-head latent attention (DeepSeek style).
_MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
_SWA4 = ["sliding_attention", "full_attention"] * 2
_LFM2 = dict(num_hidden_layers=3, norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64,
             block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
             block_ff_dim=128)
_GDN = dict(full_attention_interval=2, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)


def _c(*bases, **fields):
    """Merge base dicts and fields (later wins) into a new config dict; nested lists/dicts are copied."""
    out = {}
    for b in bases:
        out.update(b)
    out.update(fields)
    return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
            for k, v in out.items()}


def _m4_rope():  # ministral3 / mistral4 attention scaling needs these two keys
    return {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4096}


def _qwen35_rope():
    return {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


def _per_type_rope():  # one rope per layer type
    return {"sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 10000.0}}


ARCH_CONFIGS = {
    # ---- dense decoders ----
    "llama": _c(_B, model_type="llama"),
    "qwen2": _c(_B, model_type="qwen2"),
    "qwen3": _c(_B, model_type="qwen3"),
    "phi3": _c(_B, model_type="phi3"),
    "gemma": _c(_B, model_type="gemma"),
    "gemma2": _c(_B, model_type="gemma2", num_hidden_layers=4, query_pre_attn_scalar=16.0),
    "gemma3_text": _c(_B, model_type="gemma3_text", num_hidden_layers=4, num_key_value_heads=1,
                      query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2),
    "starcoder2": _c(_B, model_type="starcoder2", norm_epsilon=1e-5),
    "olmo2": _c(_B, model_type="olmo2"),
    "olmo3": _c(_B, model_type="olmo3", num_hidden_layers=4, sliding_window=8, layer_types=_SWA4),
    "cohere": _c(_B, model_type="cohere", layer_norm_eps=1e-5, use_qk_norm=True),
    "cohere2": _c(_B, model_type="cohere2", num_hidden_layers=4, layer_norm_eps=1e-5, sliding_window=8,
                  sliding_window_pattern=2),
    "internlm2": _c(_B, model_type="internlm2", bias=False),
    "internlm3": _c(_B, model_type="internlm3"),
    "granite": _c(_B, model_type="granite", logits_scaling=1.0, attention_multiplier=0.0625,
                  embedding_multiplier=1.0, residual_multiplier=1.0, attention_bias=False, mlp_bias=False),
    "exaone": _c(_B, model_type="exaone", num_layers=2, layer_norm_epsilon=1e-5),
    "exaone4": _c(_B, model_type="exaone4", num_hidden_layers=4, rope_scaling=None, sliding_window=8,
                  sliding_window_pattern="LLLG"),
    "minicpm": _c(_B, model_type="minicpm", dim_model_base=64, scale_depth=1.4, scale_emb=12),
    "minicpm3": _c(_B, _MLA, model_type="minicpm3", dim_model_base=64, scale_depth=1.4, scale_emb=12,
                   rope_scaling={"original_max_position_embeddings": 4096, "short_factor": 1.0,
                                 "long_factor": 1.0}),
    "stablelm": _c(_B, model_type="stablelm", use_qkv_bias=False, partial_rotary_factor=0.25,
                   layer_norm_eps=1e-5),
    "phi": _c(_B, model_type="phi", layer_norm_eps=1e-5, partial_rotary_factor=0.5),
    "gpt2": dict(model_type="gpt2", n_ctx=1024, n_embd=64, n_head=4, n_layer=2, n_positions=1024,
                 layer_norm_epsilon=1e-5, vocab_size=VOCAB),
    "gpt_bigcode": dict(model_type="gpt_bigcode", n_embd=64, n_layer=2, n_inner=128, n_head=4,
                        n_positions=1024, layer_norm_epsilon=1e-5, vocab_size=VOCAB),
    "gpt_neox": _c(_B, model_type="gpt_neox", layer_norm_eps=1e-5, rotary_emb_base=10000, rotary_pct=0.25),
    "gptj": dict(model_type="gptj", n_embd=64, vocab_size=VOCAB, n_positions=1024, n_head=4, rotary_dim=8,
                 n_layer=2),
    "glm": _c(_B, model_type="glm"),
    "glm4": _c(_B, model_type="glm4", attention_bias=False, partial_rotary_factor=0.5),
    "smollm3": _c(_B, model_type="smollm3", num_hidden_layers=4, no_rope_layer_interval=2),
    "ernie4_5": _c(_B, model_type="ernie4_5", use_bias=False),
    "hunyuan_v1_dense": _c(_B, model_type="hunyuan_v1_dense"),
    "helium": _c(_B, model_type="helium", attention_bias=False, mlp_bias=False),
    "apertus": _c(_B, model_type="apertus", mlp_bias=False, attention_bias=False, post_norm=False,
                  qk_norm=True),
    "seed_oss": _c(_B, model_type="seed_oss"),
    "telechat3": _c(_B, model_type="telechat3"),
    "nanbeige": _c(_B, model_type="nanbeige"),
    "nanochat": _c(_B, model_type="nanochat", num_key_value_heads=4),
    "talkie": _c(_B, model_type="talkie"),
    "mimo": _c(_B, model_type="mimo", num_nextn_predict_layers=0),
    "nemotron": _c(_B, model_type="nemotron", hidden_act="relu2", norm_eps=1e-5),
    "ministral3": _c(_B, model_type="ministral3", rope_parameters=_m4_rope()),
    "qwen": _c(_B, model_type="qwen", kv_channels=16, layer_norm_epsilon=1e-6),
    "plamo": _c(_B, model_type="plamo", n_shared_head=2),
    "iquestloopcoder": _c(_B, model_type="iquestloopcoder", loop_num=2, loop_window_size=8),
    "openelm": dict(model_type="openelm", head_dim=16, num_transformer_layers=2, model_dim=64,
                    vocab_size=VOCAB, ffn_dim_divisor=16, num_query_heads=[4, 4], num_kv_heads=[2, 2],
                    ffn_multipliers=[2.0, 2.0]),
    "lille-130m": dict(model_type="lille-130m", block_size=1024, layer_norm_eps=1e-5, n_embd=64, n_head=4,
                       n_kv_heads=2, n_layer=2, rope_theta=10000.0, vocab_size=VOCAB),
    "afm7": dict(model_type="afm7", vocab_size=VOCAB, hidden_dim=64, num_layers=4, num_kv_reuse_layers=2,
                 num_heads=4, num_kv_heads=2),
    "llama4_text": _c(_B, model_type="llama4_text", num_hidden_layers=4, intermediate_size_mlp=128,
                      no_rope_layers=[1, 1, 1, 0], use_qk_norm=True),
    "llama4": dict(model_type="llama4", text_config=_c(
        _B, _MOE, model_type="llama4_text", num_hidden_layers=4, attention_bias=False, attention_chunk_size=8,
        interleave_moe_layer_step=2, intermediate_size=32, intermediate_size_mlp=128, num_experts_per_tok=1,
        rope_scaling=None, use_qk_norm=True)),
    "baichuan_m1": _c(_B, model_type="baichuan_m1", sliding_window=8, sliding_window_layers=[1],
                      conv_window=2),
    "gear": _c(_B, model_type="gear", num_hidden_layers=4, sliding_window=8, layer_types=_SWA4),
    "muse_glimmer": _c(_B, model_type="muse_glimmer", num_hidden_layers=4, sliding_window=8, layer_types=_SWA4),
    "spark2_5": _c(_B, model_type="spark2_5", num_hidden_layers=4, sliding_window=8, layer_types=_SWA4,
                   rope_parameters=_per_type_rope()),
    "plamo3": _c(_B, model_type="plamo3", num_hidden_layers=4, window_size=8, sliding_window=8,
                 sliding_window_pattern=2),
    "gemma4_text": _c(_B, model_type="gemma4_text", num_hidden_layers=4, num_key_value_heads=1,
                      global_head_dim=32, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                      num_kv_shared_layers=2, sliding_window=8, sliding_window_pattern=2),
    "nemotron-nas": _c(_B, model_type="nemotron-nas", num_hidden_layers=3, block_configs=[
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"replace_with_linear": True}}]),
    # ---- multimodal wrappers, text part only ----
    "gemma3": dict(model_type="gemma3", vocab_size=VOCAB, text_config=_c(
        _B, model_type="gemma3_text", num_hidden_layers=4, num_key_value_heads=1, query_pre_attn_scalar=16,
        sliding_window=8, sliding_window_pattern=2)),
    "gemma3n": dict(model_type="gemma3n", text_config=_c(
        _B, model_type="gemma3n_text", num_hidden_layers=4, num_key_value_heads=1, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, sliding_window=8, rope_local_base_freq=10000.0,
        final_logit_softcapping=30.0, layer_types=_SWA4, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        hidden_size_per_layer_input=16, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=8)),
    "gemma4": dict(model_type="gemma4", vocab_size=VOCAB, text_config=_c(
        _B, model_type="gemma4_text", num_hidden_layers=4, num_key_value_heads=1, global_head_dim=32,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
        sliding_window=8, sliding_window_pattern=2)),
    "mistral3": dict(model_type="mistral3", text_config=_c(_B, model_type="ministral3",
                                                          rope_parameters=_m4_rope())),
    "pixtral": dict(model_type="pixtral", text_config=_c(_B, model_type="mistral")),
    "qwen2_vl": dict(model_type="qwen2_vl", text_config=_c(_B, model_type="qwen2")),
    "qwen3_vl": dict(model_type="qwen3_vl", text_config=_c(_B, model_type="qwen3")),
    "qwen3_vl_moe": dict(model_type="qwen3_vl_moe", text_config=_c(
        _B, _MOE, model_type="qwen3_vl_moe_text", decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True)),
    "kimi_vl": dict(model_type="kimi_vl", text_config=_c(
        _B, _MOE, _MLA, model_type="deepseek_v3", n_shared_experts=1, first_k_dense_replace=1)),
    "kimi_k25": dict(model_type="kimi_k25", text_config=_c(
        _B, _MOE, _MLA, model_type="deepseek_v3", n_shared_experts=1, first_k_dense_replace=1)),
    "lfm2-vl": dict(model_type="lfm2-vl", text_config=_c(
        _B, _LFM2, model_type="lfm2", layer_types=["conv", "full_attention", "conv"])),
    # ---- MoE ----
    "mixtral": _c(_B, _MOE, model_type="mixtral"),
    "phimoe": _c(_B, _MOE, model_type="phimoe"),
    "qwen2_moe": _c(_B, _MOE, model_type="qwen2_moe", shared_expert_intermediate_size=64),
    "qwen3_moe": _c(_B, _MOE, model_type="qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True),
    "olmoe": _c(_B, _MOE, model_type="olmoe"),
    "granitemoe": _c(_B, _MOE, model_type="granitemoe", logits_scaling=1.0, attention_multiplier=0.0625,
                     embedding_multiplier=1.0, residual_multiplier=1.0, attention_bias=False),
    "Klear": _c(_B, _MOE, model_type="Klear", attention_bias=False, mlp_only_layers=[], decoder_sparse_step=1,
                n_shared_experts=1, norm_topk_prob=True),
    "deepseek": _c(_B, _MOE, model_type="deepseek", n_shared_experts=1, first_k_dense_replace=1),
    "glm4_moe": _c(_B, _MOE, model_type="glm4_moe", norm_topk_prob=True, n_group=1, topk_group=1,
                   n_shared_experts=1, routed_scaling_factor=1.0, first_k_dense_replace=1, rope_scaling=None,
                   use_qk_norm=True, attention_bias=False, partial_rotary_factor=0.5),
    "dots1": _c(_B, _MOE, model_type="dots1", first_k_dense_replace=1, n_shared_experts=1, norm_topk_prob=True,
                routed_scaling_factor=1.0),
    "ernie4_5_moe": _c(_B, model_type="ernie4_5_moe", use_bias=False, moe_num_experts=4, moe_k=2,
                       moe_intermediate_size=32, moe_layer_start_index=1, moe_num_shared_experts=1),
    "hunyuan": _c(_B, model_type="hunyuan", attention_bias=False, moe_topk=2, num_experts=4,
                  num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=True,
                  cla_share_factor=2, moe_intermediate_size=32,
                  rope_scaling={"type": "dynamic", "factor": 1.0, "alpha": 1.0}),
    "bailing_moe": _c(_B, _MOE, model_type="bailing_moe", num_shared_experts=1, norm_topk_prob=True,
                      first_k_dense_replace=1),
    "solar_open": _c(_B, _MOE, model_type="solar_open", n_shared_experts=1, routed_scaling_factor=1.0,
                     first_k_dense_replace=1, norm_topk_prob=True, partial_rotary_factor=1.0),
    "gpt_oss": _c(_B, _MOE, model_type="gpt_oss", sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"]),
    "minimax": _c(_B, _MOE, model_type="minimax", shared_intermediate_size=0, rotary_dim=8),
    "phixtral": dict(model_type="phixtral", num_vocab=VOCAB, model_dim=64, num_heads=4, num_layers=2,
                     rotary_dim=8, num_experts_per_tok=2, num_local_experts=4),
    "dbrx": dict(model_type="dbrx", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4,
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0)),
    "afmoe": _c(_B, _MOE, model_type="afmoe", num_hidden_layers=4, num_shared_experts=1, num_dense_layers=1,
                sliding_window=8, layer_types=_SWA4),
    "exaone_moe": _c(_B, _MOE, model_type="exaone_moe", num_hidden_layers=4, num_shared_experts=1,
                     sliding_window=8, layer_types=_SWA4, is_moe_layer=[False, True, True, True]),
    "laguna": _c(_B, _MOE, model_type="laguna", num_hidden_layers=4, shared_expert_intermediate_size=32,
                 sliding_window=8, layer_types=_SWA4),
    "mellum": _c(_B, _MOE, model_type="mellum", num_hidden_layers=4, norm_topk_prob=True, sliding_window=8,
                 layer_types=_SWA4, rope_parameters=_per_type_rope()),
    "step3p5": _c(_B, model_type="step3p5", num_hidden_layers=4, num_attention_groups=2, sliding_window=8,
                  layer_types=_SWA4, moe_num_experts=4, moe_top_k=2, moe_intermediate_size=32,
                  share_expert_dim=32, moe_layers_enum="1,2,3"),
    "mimo_v2_flash": _c(_B, _MOE, model_type="mimo_v2_flash", hybrid_layer_pattern=[1, 0],
                        moe_layer_freq=[0, 1], add_swa_attention_sink_bias=True,
                        add_full_attention_sink_bias=False, sliding_window_size=8, n_shared_experts=None,
                        routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
                        norm_topk_prob=True, n_group=1, topk_group=1, layernorm_epsilon=1e-5,
                        swa_rope_theta=10000.0, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                        v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16, partial_rotary_factor=0.5),
    "minimax_m3_vl": dict(model_type="minimax_m3_vl", text_config=_c(
        _B, _MOE, model_type="minimax_m3", num_hidden_layers=4, dense_intermediate_size=128,
        shared_intermediate_size=32, intermediate_size=32, rotary_dim=8,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["full_attention", "sparse_attention"] * 2,
        sparse_attention_config={"sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": 4,
                                 "sparse_topk_blocks": 2, "sparse_local_block": 1})),
    # ---- multi-head latent attention (and its sparse-index variants) ----
    "deepseek_v2": _c(_B, _MOE, _MLA, model_type="deepseek_v2", n_shared_experts=1, first_k_dense_replace=1,
                      n_group=1, topk_group=1, rope_scaling={"type": "yarn", "factor": 1.0}),
    "deepseek_v3": _c(_B, _MOE, _MLA, model_type="deepseek_v3", n_shared_experts=1, first_k_dense_replace=1),
    "deepseek_v32": _c(_B, _MOE, _MLA, model_type="deepseek_v32", n_shared_experts=1, first_k_dense_replace=1,
                       index_head_dim=32, index_n_heads=2, index_topk=8),
    "deepseek_v41": dict(model_type="deepseek_v41", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
                         num_attention_heads=4, head_dim=32, q_lora_rank=32, qk_rope_head_dim=16, o_groups=2,
                         o_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                         rms_norm_eps=1e-6, sliding_window=8, compress_ratios=[0, 4, 4, 0],
                         kv_source_layer_ids=[1, 2], index_source_layer_ids=[1], index_n_heads=2,
                         index_head_dim=32, index_topk=8, candidate_topk_blocks=0, hc_mult=2,
                         hc_sinkhorn_iters=4, max_position_embeddings=4096),
    "glm4_moe_lite": _c(_B, _MOE, _MLA, model_type="glm4_moe_lite", n_shared_experts=1,
                        first_k_dense_replace=1, num_nextn_predict_layers=0),
    "glm_moe_dsa": _c(_B, _MOE, _MLA, model_type="glm_moe_dsa", index_head_dim=32, index_n_heads=2,
                      index_topk=8, n_shared_experts=1, routed_scaling_factor=1.0, topk_method="noaux_tc",
                      scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1, moe_layer_freq=1,
                      first_k_dense_replace=1, attention_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mistral4": _c(_B, _MOE, _MLA, model_type="mistral4", n_shared_experts=1, routed_scaling_factor=1.0,
                   norm_topk_prob=True, topk_group=1, n_group=1, first_k_dense_replace=1,
                   rope_parameters=_m4_rope()),
    "youtu_llm": _c(_B, _MLA, model_type="youtu_llm"),
    "longcat_flash": dict(model_type="longcat_flash", attention_method="MLA", zero_expert_type="identity",
                          hidden_size=64, ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=32,
                          n_routed_experts=4, zero_expert_num=2, num_layers=2, vocab_size=VOCAB,
                          max_position_embeddings=4096, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=32,
                          qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=1.0,
                          rms_norm_eps=1e-5, rope_theta=10000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
                          attention_bias=False),
    "longcat_flash_ngram": dict(model_type="longcat_flash_ngram", hidden_size=64, ffn_hidden_size=128,
                                moe_topk=2, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2,
                                num_layers=2, vocab_size=VOCAB, max_position_embeddings=4096,
                                num_attention_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
                                qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=1.0,
                                rms_norm_eps=1e-5, rope_theta=10000.0, mla_scale_q_lora=True,
                                mla_scale_kv_lora=True, ngram_vocab_size_ratio=2, emb_neighbor_num=2,
                                emb_split_num=2),
    # ---- hybrid / recurrent ----
    "qwen3_next": _c(_B, _MOE, _GDN, model_type="qwen3_next", num_hidden_layers=4, decoder_sparse_step=1,
                     shared_expert_intermediate_size=64, mlp_only_layers=[], partial_rotary_factor=0.5),
    "qwen3_5": dict(model_type="qwen3_5", text_config=_c(
        _B, _GDN, model_type="qwen3_5_text", rope_parameters=_qwen35_rope())),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=_c(
        _B, _MOE, _GDN, model_type="qwen3_5_moe_text", shared_expert_intermediate_size=64,
        rope_parameters=_qwen35_rope())),
    # A 2-bit Hadamard-rotated pack of qwen3_5: one packed module, a down_proj whose 512-wide input fits
    # the smallest Hadamard block; its frozen packed weights start at zero.
    "prism_hadamard_qwen35": dict(
        model_type="prism_hadamard_qwen35", text_config=_c(
            _B, _GDN, model_type="qwen3_5_text", intermediate_size=512, rope_parameters=_qwen35_rope()),
        schema_version=2, tensor_namespace="mlx-vlm-qwen3_5", gdn_activation_layout="grouped",
        quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": "model.layers.0.mlp.down_proj", "embedding": False, "dtype": "float16",
                  "block": 512}]),
    "nemotron_h": _c(_B, model_type="nemotron_h", hybrid_override_pattern=["M", "*", "-", "E"],
                     attention_bias=False, mamba_num_heads=8, mamba_head_dim=16, mamba_proj_bias=False,
                     ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                     use_bias=False, use_conv_bias=True, moe_intermediate_size=32,
                     moe_shared_expert_intermediate_size=64, n_group=1, n_routed_experts=4, n_shared_experts=1,
                     topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=1.0),
    "lfm2": _c(_B, _LFM2, model_type="lfm2", layer_types=["conv", "full_attention", "conv"]),
    "lfm2_moe": _c(_B, _MOE, model_type="lfm2_moe", num_hidden_layers=3, norm_topk_prob=True,
                   use_expert_bias=True, num_dense_layers=1, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                   layer_types=["conv", "full_attention", "conv"]),
    "granitemoehybrid": _c(_B, _MOE, model_type="granitemoehybrid", attention_bias=False,
                           embedding_multiplier=1.0, attention_multiplier=0.0625, logits_scaling=1.0,
                           residual_multiplier=1.0, layer_types=["mamba", "attention"],
                           shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16, mamba_proj_bias=False,
                           mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True),
    # Every falcon_h1 layer runs attention and mamba side by side.
    "falcon_h1": _c(_B, model_type="falcon_h1", mamba_chunk_size=16, mamba_d_head=16, mamba_d_ssm=128,
                    mamba_d_state=16, mamba_n_heads=8, mamba_n_groups=1),
    "mamba": dict(model_type="mamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, state_size=16,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8),
    "mamba2": dict(model_type="mamba2", num_heads=8, head_dim=16, vocab_size=VOCAB, hidden_size=64,
                   intermediate_size=128, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
                   conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                   time_step_limit=[0.0, float("inf")], time_step_rank=8),
    "jamba": _c(_B, model_type="jamba", num_hidden_layers=4, attn_layer_offset=1, attn_layer_period=2,
                expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4, mamba_d_state=16,
                mamba_expand=2, num_experts=4, num_experts_per_tok=2),
    "kimi_linear": _c(_B, _MLA, model_type="kimi_linear", num_hidden_layers=4, model_max_length=4096,
                      linear_attn_config=dict(num_heads=4, head_dim=16, kda_layers=[1, 3],
                                              full_attn_layers=[2, 4], short_conv_kernel_size=4),
                      num_experts=4, moe_intermediate_size=32, num_experts_per_token=2, num_shared_experts=1,
                      first_k_dense_replace=1),
    "kimi_k3": dict(model_type="kimi_k3", text_config=_c(
        _B, _MLA, model_type="kimi_linear", num_hidden_layers=4, num_key_value_heads=4, attn_res_block_size=2,
        linear_attn_config=dict(num_heads=4, head_dim=16, kda_layers=[1, 3], full_attn_layers=[2, 4],
                                short_conv_kernel_size=4),
        num_experts=4, moe_intermediate_size=32, num_experts_per_token=2, num_shared_experts=1,
        first_k_dense_replace=1)),
    "bailing_moe_linear": _c(_B, _MOE, model_type="bailing_moe_linear", num_hidden_layers=4,
                             num_shared_experts=1, norm_topk_prob=True, first_k_dense_replace=1,
                             layer_group_size=2, group_norm_size=1),
    "bailing_hybrid": _c(_B, _MOE, _MLA, model_type="bailing_hybrid", num_hidden_layers=4, num_shared_experts=1,
                         n_group=1, topk_group=1, first_k_dense_replace=1, layer_group_size=2,
                         group_norm_size=1, routed_scaling_factor=1.0),
    # model_type bailing_hybrid with architectures BailingMoeV3ForCausalLM loads this module.
    "bailing_moe_v3": _c(_B, _MOE, _MLA, model_type="bailing_hybrid", num_hidden_layers=4, num_shared_experts=1,
                         moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1,
                         first_k_dense_replace=1, layer_group_size=2, routed_scaling_factor=1.0),
    "olmo_hybrid": _c(_B, model_type="olmo_hybrid", linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                      linear_allow_neg_eigval=True, attention_bias=False,
                      layer_types=["linear_attention", "full_attention"]),
    "plamo2": _c(_B, model_type="plamo2", hidden_size_per_head=16, attention_window_size=8, mamba_d_state=16,
                 mamba_d_conv=4, mamba_num_heads=8, mamba_step=2, mamba_chunk_size=16),
    "rwkv7": dict(model_type="rwkv7", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, norm_eps=1e-5,
                  head_dim=16, num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=16,
                  decay_low_rank_dim=8),
    "recurrent_gemma": _c(_B, model_type="recurrent_gemma", attention_bias=False, conv1d_width=4,
                          logits_soft_cap=30.0, num_key_value_heads=1, attention_window_size=8,
                          block_types=["recurrent", "attention"]),
}

# The cache classes each ARCH_CONFIGS model's make_prompt_cache returns (children of a CacheList included).
CACHE_KINDS = {
    "llama": ["KVCache"], "qwen2": ["KVCache"], "qwen3": ["KVCache"], "phi3": ["KVCache"],
    "gemma": ["KVCache"], "gemma2": ["KVCache"], "gemma3_text": ["KVCache", "RotatingKVCache"],
    "starcoder2": ["KVCache"], "olmo2": ["KVCache"], "olmo3": ["KVCache", "RotatingKVCache"],
    "cohere": ["KVCache"], "cohere2": ["KVCache", "RotatingKVCache"], "internlm2": ["KVCache"],
    "internlm3": ["KVCache"], "granite": ["KVCache"], "exaone": ["KVCache"],
    "exaone4": ["KVCache", "RotatingKVCache"], "minicpm": ["KVCache"], "minicpm3": ["KVCache"],
    "stablelm": ["KVCache"], "phi": ["KVCache"], "gpt2": ["KVCache"], "gpt_bigcode": ["KVCache"],
    "gpt_neox": ["KVCache"], "gptj": ["KVCache"], "glm": ["KVCache"], "glm4": ["KVCache"],
    "smollm3": ["KVCache"], "ernie4_5": ["KVCache"], "hunyuan_v1_dense": ["KVCache"], "helium": ["KVCache"],
    "apertus": ["KVCache"], "seed_oss": ["KVCache"], "telechat3": ["KVCache"], "nanbeige": ["KVCache"],
    "nanochat": ["KVCache"], "talkie": ["KVCache"], "mimo": ["KVCache"], "nemotron": ["KVCache"],
    "ministral3": ["KVCache"], "qwen": ["KVCache"], "plamo": ["KVCache"],
    "iquestloopcoder": ["KVCache", "RotatingKVCache"], "openelm": ["KVCache"], "lille-130m": ["KVCache"],
    "afm7": ["KVCache"], "llama4_text": ["KVCache"], "llama4": ["ChunkedKVCache", "KVCache"],
    "baichuan_m1": ["ArraysCache", "CacheList", "KVCache", "RotatingKVCache"],
    "gear": ["KVCache", "RotatingKVCache"], "muse_glimmer": ["KVCache", "RotatingKVCache"],
    "spark2_5": ["KVCache", "RotatingKVCache"], "plamo3": ["KVCache", "RotatingKVCache"],
    "gemma4_text": ["KVCache", "RotatingKVCache"], "nemotron-nas": ["KVCache"],
    "gemma3": ["KVCache", "RotatingKVCache"], "gemma3n": ["KVCache", "RotatingKVCache"],
    "gemma4": ["KVCache", "RotatingKVCache"], "mistral3": ["KVCache"], "pixtral": ["KVCache"],
    "qwen2_vl": ["KVCache"], "qwen3_vl": ["KVCache"], "qwen3_vl_moe": ["KVCache"], "kimi_vl": ["KVCache"],
    "kimi_k25": ["KVCache"], "lfm2-vl": ["ArraysCache", "KVCache"], "mixtral": ["KVCache"],
    "phimoe": ["KVCache"], "qwen2_moe": ["KVCache"], "qwen3_moe": ["KVCache"], "olmoe": ["KVCache"],
    "granitemoe": ["KVCache"], "Klear": ["KVCache"], "deepseek": ["KVCache"], "glm4_moe": ["KVCache"],
    "dots1": ["KVCache"], "ernie4_5_moe": ["KVCache"], "hunyuan": ["KVCache"], "bailing_moe": ["KVCache"],
    "solar_open": ["KVCache"], "gpt_oss": ["KVCache", "RotatingKVCache"], "minimax": ["KVCache"],
    "phixtral": ["KVCache"], "dbrx": ["KVCache"], "afmoe": ["KVCache", "RotatingKVCache"],
    "exaone_moe": ["KVCache", "RotatingKVCache"], "laguna": ["KVCache", "RotatingKVCache"],
    "mellum": ["KVCache", "RotatingKVCache"], "step3p5": ["KVCache", "RotatingKVCache"],
    "mimo_v2_flash": ["KVCache", "RotatingKVCache"], "minimax_m3_vl": ["CacheList", "KVCache"],
    "deepseek_v2": ["KVCache"], "deepseek_v3": ["KVCache"], "deepseek_v32": ["CacheList", "KVCache"],
    "deepseek_v41": ["LayerCache"], "glm4_moe_lite": ["KVCache"], "glm_moe_dsa": ["CacheList", "KVCache"],
    "mistral4": ["KVCache"], "youtu_llm": ["KVCache"], "longcat_flash": ["CacheList", "KVCache"],
    "longcat_flash_ngram": ["ArraysCache", "CacheList", "KVCache"], "qwen3_next": ["ArraysCache", "KVCache"],
    "qwen3_5": ["ArraysCache", "KVCache"], "qwen3_5_moe": ["ArraysCache", "KVCache"],
    "prism_hadamard_qwen35": ["ArraysCache", "KVCache"], "nemotron_h": ["ArraysCache", "KVCache"],
    "lfm2": ["ArraysCache", "KVCache"], "lfm2_moe": ["ArraysCache", "KVCache"],
    "granitemoehybrid": ["ArraysCache", "KVCache"], "falcon_h1": ["ArraysCache", "CacheList", "KVCache"],
    "mamba": ["ArraysCache"], "mamba2": ["ArraysCache"], "jamba": ["ArraysCache", "KVCache"],
    "kimi_linear": ["ArraysCache", "KVCache"], "kimi_k3": ["ArraysCache", "KVCache"],
    "bailing_moe_linear": ["ArraysCache", "KVCache"], "bailing_hybrid": ["ArraysCache", "KVCache"],
    "bailing_moe_v3": ["ArraysCache", "KVCache"], "olmo_hybrid": ["ArraysCache", "KVCache"],
    "plamo2": ["ArraysCache", "KVCache"], "rwkv7": ["ArraysCache"],
    "recurrent_gemma": ["ArraysCache", "RotatingKVCache"],
}

# Configs kept out of ARCH_CONFIGS for the reason UNBUILDABLE gives: they build, but cannot generate on
# Linux (Metal-only kernels) or cannot use VOCAB.
EXCLUDED_CONFIGS = {
    "phi3small": _c(_B, model_type="phi3small", vocab_size=100352, dense_attention_every_n_layers=2,
                    ff_intermediate_size=128, gegelu_limit=20.0, layer_norm_epsilon=1e-5,
                    blocksparse_block_size=32, blocksparse_num_local_blocks=1, blocksparse_vert_stride=2),
    "bitnet": _c(_B, model_type="bitnet"),
    "muse_spark": dict(model_type="muse_spark", text_config=dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
        vocab_size=VOCAB, rms_norm_eps=1e-5, post_norm_eps=1e-8, rope_parameters={"rope_theta": 10000.0},
        layer_rope_theta=[10000.0, 0, 10000.0, 0], layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8, final_logit_softcapping=30.0, output_multiplier=1.0, num_local_experts=4,
        num_experts_per_tok=2, moe_hidden_size=64, moe_intermediate_size=32)),
}

# Architecture modules under mlx_lm/models with no working tiny text-only config in ARCH_CONFIGS.
UNBUILDABLE = {
    "olmo": "imports the external ai2-olmo package (hf_olmo), not installed: the module exits on import",
    "phi3small": "its forward writes -inf at hard-coded token ids 100256..100351, out of bounds (a segfault) "
                 "unless vocab_size > 100351; EXCLUDED_CONFIGS has one with vocab 100352",
    "bitnet": "BitLinear runs a Metal-only kernel (mx.fast.metal_kernel): generation fails off Apple silicon",
    "muse_spark": "its fused qk-norm/rope and expert-routing kernels are Metal-only: generation fails off "
                  "Apple silicon",
}
