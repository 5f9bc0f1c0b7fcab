"""Speculative method mtp: a checkpoint's own multi-token-prediction head drafts.

The checkpoints are tiny ones written as Hugging Face writes them: Qwen3-Next, Qwen3.5
and Qwen3.5-MoE (experts one by one or fused, zero-centred norms, `mtp.*` tensors),
GLM-4 MoE and DeepSeek-V3 (the MTP layer after the last, experts one by one); mlx-lm's
loader drops the heads and the engine reads them back. The head's drafts at every
verify equal a plain implementation's (mlx-lm's own KVCache over the whole sequence, the
target's hidden states from its own forward): so its paged KV, one position behind the
target, kept up through batching, chunked prefill, replays of rejected drafts (Qwen's are
hybrid) and prefix hits. The tokens are mlx-lm's own greedy generation, as always.
"""

import asyncio
import json

import mlx.core as mx
import pytest
from conftest import collect, reference_greedy
from mlx.utils import tree_flatten, tree_map
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import KVCache, make_prompt_cache
from test_speculative import prompts
from tiny_models import VOCAB, WEIGHT_SCALE, config, make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.models.gguf import default_model_path
from mlx_worker.models.output_head import split_output_head
from mlx_worker.speculative.mtp_head import HEADS
from mlx_worker.speculative.mtp_qwen import text_model

HF_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
            ".k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "mtp.norm.weight")


def as_hugging_face(weights: dict, fused_experts: bool) -> dict:
    """MLX-named weights as a Hugging Face Qwen3-Next / Qwen3.5 checkpoint names and stores
    them: experts one by one (Qwen3-Next) or fused gate and up (Qwen3.5-MoE), the
    convolutions' axes, zero-centred norms."""
    out = {}
    for name, v in weights.items():
        k = name.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
        if ".switch_mlp." in k and fused_experts:
            base, proj = k.split(".switch_mlp.")
            if proj.startswith("down_proj"):
                out[f"{base}.experts.down_proj"] = v
            elif proj.startswith("gate_proj"):
                up = weights[name.replace("gate_proj", "up_proj")]
                out[f"{base}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
        elif ".switch_mlp." in k:
            for e in range(v.shape[0]):
                out[k.replace(".switch_mlp.", f".experts.{e}.")] = v[e]
        elif "conv1d.weight" in k:
            out[k] = v.moveaxis(2, 1)
        elif v.ndim == 1 and k.endswith(HF_NORMS):
            out[k] = v - 1.0
        else:
            out[k] = v
    return out


def unstacked(key, v):
    """A stacked expert tensor as Hugging Face stores it: one per expert."""
    return {key.replace(".switch_mlp.", f".experts.{e}."): v[e] for e in range(v.shape[0])} if ".switch_mlp." in key \
        else {key: v}


def as_layer_after_the_last(head, N):
    """A DeepSeek-style head's tensors as the checkpoint's layer N (experts one by one),
    with the copies of the embedding and output head that checkpoints carry."""
    out = {}
    for k, v in tree_flatten(head.parameters()):
        out.update(unstacked(f"model.layers.{N}.{k[len('layers.0.'):] if k.startswith('layers.0.') else k}", v))
    out[f"model.layers.{N}.embed_tokens.weight"] = mx.zeros((VOCAB, head.eh_proj.weight.shape[0]))
    out[f"model.layers.{N}.shared_head.head.weight"] = mx.zeros((VOCAB, head.eh_proj.weight.shape[0]))
    return out


def save_with_mtp(arch, path, seed=0, repeating=False, **overrides):
    """A tiny checkpoint of `arch` with an MTP head; `repeating`: a model that repeats
    its last token and a head that drafts it, so drafts are accepted."""
    model = make_tiny_model(arch, seed, **overrides)
    mx.random.seed(seed + 1)
    head = HEADS[model.args.model_type](model, 1)
    head.update(tree_map(lambda w: w * WEIGHT_SCALE if w.ndim == 2 else w, head.parameters()))
    if repeating:
        from mlx.utils import tree_unflatten

        for m in (model, head):
            flat = dict(tree_flatten(m.parameters()))
            flat.update({k: mx.zeros_like(v) for k, v in flat.items()
                         if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))})
            m.update(tree_unflatten(list(flat.items())))
        holder = getattr(model, "language_model", model)
        holder.lm_head.weight = holder.model.embed_tokens.weight
        H = holder.args.hidden_size
        pass_hidden = mx.concatenate([mx.zeros((H, H)), mx.eye(H)], axis=1)
        if hasattr(head, "fc"):
            head.fc.weight = pass_hidden
        else:
            head.eh_proj.weight = pass_hidden
    weights = dict(tree_flatten(model.parameters()))
    path.mkdir(parents=True)
    if hasattr(head, "fc"):  # Qwen: the whole checkpoint as Hugging Face writes it, and mtp.*
        weights.update({f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
        weights = as_hugging_face(weights, arch == "qwen3_5_moe")
    else:  # DeepSeek-style: the model as mlx-lm names it, its MTP layer as Hugging Face does
        weights.update(as_layer_after_the_last(head, model.args.num_hidden_layers))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    cfg = {**config(arch), **overrides}
    if "text_config" in cfg:  # Qwen3.5 names its MTP layer count in the text config
        cfg = {**cfg, "text_config": {**cfg["text_config"], "mtp_num_hidden_layers": 1}}
    else:
        cfg = {**cfg, "num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    for f in default_model_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (path / f.name).write_bytes(f.read_bytes())
    return head


# DeepSeek-V3's loader drops its MTP layer by number (61): the tiny one has as many.
@pytest.fixture(scope="module", params=[("qwen3_next", "repeating", {}), ("qwen3_5", "random", {}),
                                        ("qwen3_5_moe", "repeating", {}), ("glm4_moe", "random", {}),
                                        ("deepseek_v3", "repeating", {"num_hidden_layers": 61})],
                ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request, tmp_path_factory):
    arch, kind, overrides = request.param
    path = tmp_path_factory.mktemp("mtp") / arch
    head = save_with_mtp(arch, path, repeating=kind == "repeating", **overrides)
    model, _ = mlx_load(str(path))
    return path, model, head, kind, 1 if arch == "deepseek_v3" else 3  # prompts: its 61 layers are slow here


def reference_drafts(model, head, tokens, k):
    """The head's k greedy drafts after `tokens`, computed plainly: the target's hidden
    states over all but the last token, the head over (token i + 1, hidden i) pairs."""
    body, output_head = text_model(model)[0], split_output_head(model)[1]
    hidden = body(mx.array([tokens[:-1]]), cache=make_prompt_cache(model))
    caches = [KVCache() for _ in head.layers]
    embeddings = body.embed_tokens(mx.array([tokens[1:]]))
    if head.zero_first_position:
        embeddings = mx.concatenate([mx.zeros_like(embeddings[:, :1]), embeddings[:, 1:]], axis=1)
    out = head(embeddings, hidden, caches)
    drafts = []
    for _ in range(k):
        token = int(mx.argmax(head.logits(out[:, -1:], output_head)))
        drafts.append(token)
        out = head(body.embed_tokens(mx.array([[token]])), out[:, -1:], caches)
    return drafts


def run(eng, ps, n, stagger=0.0):
    async def one(i, p):
        await asyncio.sleep(stagger * i)
        req = Request(rid=f"m{i}", prompt_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
        return (await collect(eng, req))[0]

    async def main():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(ps)])

    return asyncio.run(main())


def test_the_loaded_head_is_the_checkpoints(checkpoint):
    path, model, head, _, _ = checkpoint
    eng = Engine(EngineConfig(model=str(path), speculative={"method": "mtp"}, max_total_tokens=2048))
    loaded = dict(tree_flatten(eng.worker.draft.head.parameters()))
    for k, v in tree_flatten(head.parameters()):
        assert mx.allclose(loaded[k], v, atol=1e-6).item(), k
    eng.shutdown()


def test_mtp_drafts_are_the_heads_own_and_tokens_mlx_lms(checkpoint):
    path, model, head, kind, n = checkpoint
    shared = prompts(1, 40, 41, seed=30)[0]
    ps = [shared + p for p in prompts(n, 3, 30, seed=31)]
    eng = Engine(EngineConfig(model=str(path), speculative={"method": "mtp", "adaptive": False, "num_draft_tokens": 3},
                              max_total_tokens=2048, max_batched_tokens=32))
    eng.speculator.log = []
    outs = run(eng, ps[:1], 16) + run(eng, ps[1:], 16, stagger=0.02)
    assert outs == [reference_greedy(model, p, 16) for p in ps]
    st = eng.stats()
    assert st["kv_pages_used"] == 0 and (n == 1 or st["prefix_hit_tokens"] > 0)
    log = eng.speculator.log
    assert len(log) >= 3
    for tokens, drafts in log:
        assert drafts == reference_drafts(model, head, tokens, len(drafts)), len(tokens)
    acceptance = st["speculative"]["acceptance_rate"]
    assert acceptance > 0.9 if kind == "repeating" else acceptance < 0.2
    eng.shutdown()


def test_a_checkpoint_without_mtp_weights_is_refused(tmp_path):
    from tiny_models import save_tiny_model

    path = save_tiny_model("qwen3_next", tmp_path / "plain", tokenizer_dir=default_model_path())
    with pytest.raises(ValueError, match="has no MTP weights"):
        Engine(EngineConfig(model=str(path), speculative={"method": "mtp"}, max_total_tokens=1024))
    path = save_tiny_model("llama", tmp_path / "llama", tokenizer_dir=default_model_path())
    with pytest.raises(ValueError, match="built for qwen3_next, qwen3_5, qwen3_5_moe, deepseek_v3, glm4_moe, not llama"):
        Engine(EngineConfig(model=str(path), speculative={"method": "mtp"}, max_total_tokens=1024))


def test_the_heads_kv_comes_back_from_disk_with_the_pages(tmp_path):
    """With the prefix cache on the SSD (kv_tiers/): a restarted engine reads the
    prompt's pages back, the head's KV in them too, and its drafts are still the head's
    own (computed plainly over the whole prompt)."""
    path = tmp_path / "glm4_moe"
    head = save_with_mtp("glm4_moe", path)
    model, _ = mlx_load(str(path))
    p = prompts(1, 200, 201, seed=32)[0]
    config = dict(model=str(path), speculative={"method": "mtp", "adaptive": False, "num_draft_tokens": 3},
                  max_total_tokens=2048, prefix_cache_dir=str(tmp_path / "kv"))
    first = Engine(EngineConfig(**config))
    try:
        run(first, [p], 4)
        first.disk.flush()
    finally:
        first.shutdown()
    again = Engine(EngineConfig(**config))
    try:
        again.speculator.log = []
        assert run(again, [p], 12) == [reference_greedy(model, p, 12)]
        assert again.stats()["prefix_cache_disk"]["hit_tokens"] == 200 // 16 * 16
        assert again.speculator.log
        for tokens, drafts in again.speculator.log:
            assert drafts == reference_drafts(model, head, tokens, len(drafts)), len(tokens)
    finally:
        again.shutdown()
