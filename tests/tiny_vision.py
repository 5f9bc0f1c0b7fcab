"""Tiny random-weight vision-language checkpoints of mlx-vlm's own classes, written as
users have them (config.json, safetensors, tokenizer, processor configs), with the
default model's tokenizer plus the family's image tokens."""

import importlib
import json
from pathlib import Path

import mlx_worker  # noqa: F401  (before mlx: binds MLX to OpenBLAS on Linux)
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from transformers import AutoTokenizer

from mlx_worker.models.gguf import default_model_path

WEIGHT_SCALE = 4.0
IMAGE_SIZE = 56  # 4 x 4 patches of 14 pixels

# A Gemma-like chat template: an image part renders as the processor's placeholder.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def write_random_weights(path: Path, config: dict, seed: int = 0, scale: float = WEIGHT_SCALE) -> Path:
    """mlx-vlm's own model class of `config` (its text config at the root, as Qwen's, or
    under text_config) with random weights, saved as the checkpoint's."""
    module = importlib.import_module(f"mlx_vlm.models.{config['model_type'].replace('-', '_')}")
    model_config = module.ModelConfig.from_dict(dict(config))
    model_config.text_config = module.TextConfig.from_dict(config.get("text_config", model_config.text_config))
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)  # before the model: the weights it keeps from its own init (biases) are random too
    model = module.Model(model_config)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.02 * scale
                          if w.ndim >= 2 and mx.issubdtype(w.dtype, mx.floating) else w, model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def tiny_tokenizer(path: Path, tokens, placeholder: str):
    """The default model's tokenizer with the family's image tokens, and a chat template
    that renders an image part as `placeholder`, saved in `path` (made)."""
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    tok.chat_template = CHAT_TEMPLATE.replace("<start_of_image>", placeholder)
    tok.save_pretrained(str(path))
    return tok


TINY_TEXT = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                 sliding_window_pattern=2)
TINY_VISION = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2)


def save_tiny_gemma3_vision(path: Path, seed: int = 0, tokens_per_image: int = 16, image_size: int = IMAGE_SIZE,
                            text: dict = TINY_TEXT, vision: dict = TINY_VISION, scale: float = WEIGHT_SCALE) -> Path:
    """A Gemma 3 vision checkpoint: SigLIP tower (by default 2 layers), projector, a text
    model (by default 4 layers, sliding-window layers of window 8)."""
    path = Path(path)
    tok = tiny_tokenizer(path, GEMMA3_TOKENS.values(), "<start_of_image>")
    config_file = path / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config["extra_special_tokens"] = GEMMA3_TOKENS
    config_file.write_text(json.dumps(tok_config))
    image_token = tok.convert_tokens_to_ids(GEMMA3_TOKENS["image_token"])
    vocab = len(tok)
    config = {
        "model_type": "gemma3", "image_token_index": image_token, "vocab_size": vocab, "hidden_size": text["hidden_size"],
        # As Gemma's <pad>: a token no prompt holds (mlx-vlm zeroes its embedding in prompts with images).
        "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>"), "eos_token_id": [tok.eos_token_id],
        "text_config": dict(model_type="gemma3_text", vocab_size=vocab, mm_tokens_per_image=tokens_per_image, **text),
        "vision_config": dict(model_type="siglip_vision_model", patch_size=14, image_size=image_size, **vision),
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": image_size, "width": image_size}, "do_resize": True, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
        "do_pan_and_scan": False}))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                             "image_seq_length": tokens_per_image}))
    return write_random_weights(path, config, seed, scale)


QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def save_tiny_qwen2_5_vision(path: Path, seed: int = 0) -> Path:
    """A Qwen2.5-VL checkpoint: its windowed vision tower (2 blocks), patch merger, and a
    2-layer text model whose attention takes M-RoPE positions (sections 2/3/3)."""
    path = Path(path)
    tok = tiny_tokenizer(path, QWEN_TOKENS, QWEN_PLACEHOLDER)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    config = {
        "model_type": "qwen2_5_vl", "vocab_size": len(tok), "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "eos_token_id": [tok.eos_token_id], "bos_token_id": None,
        "vision_config": {"model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                          "out_hidden_size": 64, "num_heads": 2, "patch_size": 14, "spatial_patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                          "fullatt_block_indexes": [1], "in_channels": 3},
    }
    (path / "config.json").write_text(json.dumps(config))
    write_qwen_processor(path, "Qwen2_5_VLProcessor", "Qwen2VLImageProcessor", patch=14)
    return write_random_weights(path, config, seed)


def write_qwen_processor(path: Path, processor: str, image_processor: str, patch: int) -> None:
    """Qwen-VL processor configs: images of 8 x 8 to 8 x 12 patches."""
    side = 8 * patch
    image = {"min_pixels": side * side, "max_pixels": side * side * 3 // 2, "patch_size": patch,
             "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "image_processor_type": image_processor, "processor_class": processor}
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    (path / "video_preprocessor_config.json").write_text(json.dumps({k: v for k, v in image.items()
                                                                      if k not in ("min_pixels", "max_pixels")}))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor}))


IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


def save_tiny_idefics3_vision(path: Path, seed: int = 0, model_type: str = "idefics3", tiles: bool = False) -> Path:
    """An Idefics3 checkpoint (or `smolvlm`: the same layout, SmolVLM's processor):
    SigLIP-like tower (2 layers, 112 px, 64 patches), pixel-shuffle connector (scale 2: 16
    image tokens), a 2-layer llama. `tiles`: an image over 112 px is cut into tiles of
    112 px (up to 2 x 2) shown before the whole image, as SmolVLM does with large ones."""
    processor = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[model_type]
    path = Path(path)
    tok = tiny_tokenizer(path, IDEFICS3_TOKENS, "<image>")
    vocab = len(tok)
    config = {
        "model_type": model_type, "image_token_id": tok.convert_tokens_to_ids("<image>"), "vocab_size": vocab,
        "scale_factor": 2, "eos_token_id": [tok.eos_token_id],
        "text_config": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
                            rope_theta=10000.0),
        "vision_config": dict(model_type="idefics3_vision", hidden_size=32, num_hidden_layers=2,
                              intermediate_size=64, num_attention_heads=2, patch_size=14, image_size=112),
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": f"{processor}ImageProcessor", "processor_class": f"{processor}Processor",
        "do_image_splitting": tiles, "size": {"longest_edge": 224 if tiles else 112},
        "max_image_size": {"longest_edge": 112},
        "do_resize": True, "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True, "do_convert_rgb": True}))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": f"{processor}Processor",
                                                             "image_seq_len": 16}))
    return write_random_weights(path, config, seed)


MISTRAL3_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def save_tiny_mistral3_vision(path: Path, seed: int = 0, model_type: str = "mistral3") -> Path:
    """A Mistral Small 3 checkpoint: Pixtral tower (2 layers, 14 px patches, 2-D RoPE),
    patch merger (2 x 2), a 2-layer Mistral text model; an image of up to 112 px is rows
    of [IMG] tokens ended by [IMG_BREAK], the last by [IMG_END]. Or (`pixtral`) a Pixtral
    (12B's layout): 16 px patches, no merge, a two-layer projector."""
    path = Path(path)
    tok = tiny_tokenizer(path, MISTRAL3_TOKENS, "[IMG]")
    vocab = len(tok)
    patch, merge, size = (14, 2, 112) if model_type == "mistral3" else (16, 1, 96)
    processor = {"mistral3": "Mistral3Processor", "pixtral": "PixtralProcessor"}[model_type]
    config = {
        "model_type": model_type, "image_token_index": tok.convert_tokens_to_ids("[IMG]"), "vocab_size": vocab,
        "eos_token_id": [tok.eos_token_id], **({"spatial_merge_size": merge} if merge > 1 else {}),
        "text_config": dict(model_type="mistral", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                            vocab_size=vocab, rope_theta=1e6, max_position_embeddings=4096),
        "vision_config": dict(model_type="pixtral", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                              num_attention_heads=2, head_dim=16, patch_size=patch, image_size=size),
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "processor_class": processor,
        "patch_size": {"height": patch, "width": patch}, "size": {"longest_edge": size}, "do_resize": True,
        "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor,
                                                             "spatial_merge_size": merge, "patch_size": patch}))
    return write_random_weights(path, config, seed)


def save_tiny_qwen3_vision(path: Path, seed: int = 0) -> Path:
    """A Qwen3-VL checkpoint: its vision tower (2 blocks, 16 px patches, learned position
    embeddings) whose first block's merged patches also go into the text model's first
    layer (deepstack), and a 2-layer text model with M-RoPE (sections 2/3/3, interleaved)."""
    path = Path(path)
    tok = tiny_tokenizer(path, QWEN_TOKENS, QWEN_PLACEHOLDER)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    config = {
        "model_type": "qwen3_vl", "vocab_size": len(tok), "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "eos_token_id": [tok.eos_token_id],
        "text_config": {"model_type": "qwen3_vl_text", "vocab_size": len(tok), "hidden_size": 64,
                        "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 5e6,
                        "max_position_embeddings": 4096, "tie_word_embeddings": False,
                        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                         "mrope_interleaved": True}},
        "vision_config": {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                          "out_hidden_size": 64, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 64, "in_channels": 3,
                          "deepstack_visual_indexes": [0]},
    }
    (path / "config.json").write_text(json.dumps(config))
    write_qwen_processor(path, "Qwen3VLProcessor", "Qwen2VLImageProcessorFast", patch=16)
    return write_random_weights(path, config, seed)


def save_tiny_qwen3_5_vision(path: Path, seed: int = 0) -> Path:
    """A Qwen3.5 checkpoint (vision): Qwen3-VL's tower without deepstack, and a hybrid text
    model of 4 layers (gated delta net, then full attention with M-RoPE, twice)."""
    path = save_tiny_qwen3_vision(path, seed)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "qwen3_5"
    config["text_config"] = {
        "model_type": "qwen3_5_text", "vocab_size": config["vocab_size"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e7,
                            "partial_rotary_factor": 0.5, "mrope_interleaved": True}}
    config["vision_config"] = {**config["vision_config"], "model_type": "qwen3_5", "deepstack_visual_indexes": []}
    (path / "config.json").write_text(json.dumps(config))
    return write_random_weights(path, config, seed)


LFM2_VL_TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>",
                  *[f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11)]]


def save_tiny_lfm2_vl_vision(path: Path, seed: int = 0) -> Path:
    """An LFM2-VL checkpoint: its SigLIP2 (NaFlex) tower (2 layers, 16 px patches), pixel
    unshuffle (2 x 2) and projector, a hybrid LFM2 text model (short convolutions between
    the attention layers); an image is tiled (with a thumbnail) when it is large."""
    path = Path(path)
    tok = tiny_tokenizer(path, LFM2_VL_TOKENS, "<image>")
    vocab = len(tok)
    config = {
        "model_type": "lfm2-vl", "image_token_id": tok.convert_tokens_to_ids("<image>"), "vocab_size": vocab,
        "eos_token_id": tok.eos_token_id, "downsample_factor": 2, "encoder_patch_size": 16,
        "projector_hidden_size": 64, "min_image_tokens": 16, "max_image_tokens": 32, "tile_size": 64,
        "text_config": dict(model_type="lfm2", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, conv_dim=64,
                            conv_dim_out=64, block_dim=64, block_ff_dim=128, block_auto_adjust_ff_dim=False,
                            eos_token_id=tok.eos_token_id, norm_eps=1e-5,
                            layer_types=["conv", "full_attention", "conv", "full_attention"]),
        "vision_config": dict(model_type="lfm2_vl", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, patch_size=16, num_patches=64),
    }
    (path / "config.json").write_text(json.dumps(config))
    image = {"downsample_factor": 2, "encoder_patch_size": 16, "min_image_tokens": 16, "max_image_tokens": 32,
             "tile_size": 64, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "image_processor_type": "Siglip2ImageProcessor", "processor_class": "Lfm2VlProcessor"}
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor",
                                                             "use_image_special_tokens": True}))
    return write_random_weights(path, config, seed)


GEMMA4_TOKENS = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>"}


def save_tiny_gemma4_vision(path: Path, seed: int = 0, bidirectional: bool = False) -> Path:
    """A Gemma 4 checkpoint: its vision tower (2 layers, 16 px patches, pooled 2 x 2) and a
    4-layer text model with per-layer inputs and its last 2 layers reading earlier layers'
    KV (E2B/E4B's layout); an image is at most 16 soft tokens. `bidirectional`: the 26B /
    31B layout instead (no per-layer inputs, no shared KV, full-attention keys that are
    their values), whose image tokens attend to each other both ways."""
    path = Path(path)
    tok = tiny_tokenizer(path, GEMMA4_TOKENS.values(), GEMMA4_TOKENS["image_token"])
    config_file = path / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config["extra_special_tokens"] = GEMMA4_TOKENS
    config_file.write_text(json.dumps(tok_config))
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA4_TOKENS.items()}
    vocab = len(tok)
    config = {
        "model_type": "gemma4", "vocab_size": vocab, "image_token_id": ids["image_token"],
        "boi_token_id": ids["boi_token"], "eoi_token_id": ids["eoi_token"], "audio_token_id": vocab + 1,
        "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>"), "eos_token_id": [tok.eos_token_id],
        "hidden_size": 64, "vision_soft_tokens_per_image": 16,
        "text_config": dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                            rms_norm_eps=1e-6, vocab_size=vocab, vocab_size_per_layer_input=vocab,
                            hidden_size_per_layer_input=16, num_kv_shared_layers=2, sliding_window=8,
                            sliding_window_pattern=2, max_position_embeddings=4096),
        "vision_config": dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, head_dim=16, global_head_dim=16,
                              patch_size=16, position_embedding_size=64, pooling_kernel_size=2,
                              default_output_length=16, rope_parameters={"rope_theta": 100.0}),
    }
    if bidirectional:
        config["text_config"].update(hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=True,
                                     use_bidirectional_attention="vision")
    (path / "config.json").write_text(json.dumps(config))
    image = {"patch_size": 16, "max_soft_tokens": 16, "pooling_kernel_size": 2, "do_resize": True,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False}
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor",
                                                             "image_processor": image, "image_seq_length": 16}))
    return write_random_weights(path, config, seed)
