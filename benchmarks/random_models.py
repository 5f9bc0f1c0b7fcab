"""Random-weight models of mlx-lm architectures at about SmolLM2-135M's size, for
benchmarking architectures whose weights can't be downloaded here (e.g. hybrid models).
Speed depends on shapes, not on the weights' values."""

import importlib

import mlx.core as mx
from mlx.utils import tree_map

VOCAB = 49152  # the embedded default model's tokenizer

_COMMON = dict(vocab_size=VOCAB, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536, max_position_embeddings=32768, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True)

CONFIGS = {
    # Dense attention with heads that divide by 2 and 4 (tensor parallel; SmolLM2's 3 KV heads do not).
    "llama": dict(_COMMON, model_type="llama", num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4),
    # Gated DeltaNet linear attention, one full-attention layer in four.
    "qwen3_next": dict(_COMMON, model_type="qwen3_next", num_hidden_layers=24, full_attention_interval=4,
                       linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
                       linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=1, num_experts_per_tok=1,
                       decoder_sparse_step=1, shared_expert_intermediate_size=1536,
                       mlp_only_layers=list(range(24)), moe_intermediate_size=1536, partial_rotary_factor=0.25),
    # Mamba-2 layers and MLPs, an attention layer in every eight.
    "nemotron_h": dict(_COMMON, model_type="nemotron_h", hybrid_override_pattern=list("M-M-M*-" "M-M-M*-" "M-M-M*-"),
                       attention_bias=False, mamba_num_heads=18, mamba_head_dim=64, mamba_proj_bias=False,
                       ssm_state_size=64, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True),
    # Short convolutions, attention in one layer of three.
    "lfm2": dict(_COMMON, model_type="lfm2", num_hidden_layers=18, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                 block_dim=576, block_ff_dim=1536, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, full_attn_idxs=list(range(2, 18, 3)),
                 layer_types=["full_attention" if i % 3 == 2 else "conv" for i in range(18)]),
}


def random_model(arch: str, dtype=mx.float32, seed: int = 0):
    """A random-weight model of mlx-lm's own class for `arch`, sized as CONFIGS says."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(CONFIGS[arch]))
    model.update(tree_map(lambda w: w * 4.0 if w.ndim == 2 else w, model.parameters()))  # peaked logits
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model
