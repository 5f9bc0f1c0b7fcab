"""What a replica declares it will hold (serve_app.models.placement), from the model's files
before it is loaded: a draft model (speculative method draft) adds its weights and its KV,
a vision model its image cache."""

from serve_app.models.placement import replica_memory_bytes
from tiny_models import save_tiny_model


def test_a_draft_model_adds_its_weights_and_kv(tmp_path):
    target = save_tiny_model("llama", tmp_path / "target", num_hidden_layers=4)
    draft = save_tiny_model("llama", tmp_path / "draft")
    engine = {"max_total_tokens": 4096, "dtype": "float32"}
    alone = replica_memory_bytes(str(target), engine, 16 * 2**30)
    spec = {"method": "draft", "draft_model": str(draft)}
    with_draft = replica_memory_bytes(str(target), {**engine, "speculative": spec}, 16 * 2**30)
    weights = (draft / "model.safetensors").stat().st_size
    kv = 4096 * 2 * 2 * 2 * 16 * 4  # tokens x (K, V) x 2 layers x 2 KV heads x head_dim 16 x float32
    assert alone and with_draft >= alone + weights + kv


def test_a_vision_model_adds_its_image_cache(tmp_path):
    from tiny_vision import save_tiny_gemma3_vision

    vision = str(save_tiny_gemma3_vision(tmp_path / "vision"))
    engine = {"max_total_tokens": 4096, "dtype": "float32"}
    cached = replica_memory_bytes(vision, {**engine, "image_cache_bytes": 1 << 30}, 16 * 2**30)
    uncached = replica_memory_bytes(vision, {**engine, "image_cache_bytes": 0}, 16 * 2**30)
    assert uncached and cached >= uncached + (1 << 30)
