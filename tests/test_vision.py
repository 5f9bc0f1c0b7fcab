"""Images in prompts: a vision-language checkpoint (mlx-vlm's classes: a tiny random
Gemma 3, a Gemma 4 (per-layer inputs, KV shared across layers) and one of the larger
Gemma 4s' layout, whose image tokens attend to each other both ways, a Qwen2.5-VL, whose
M-RoPE positions the engine makes per row, a Qwen3-VL, whose first layers add image
features too (deepstack), a Qwen3.5 (hybrid: recurrent layers
between the attention ones), an Idefics3, a SmolVLM (and one that tiles its images), a
Mistral 3 with its Pixtral tower, a Pixtral and an LFM2-VL (hybrid too, its images tiled))
served by the engine gives mlx-vlm's own greedy tokens, alone and batched with text and
other images, with prefill chunks across the image tokens and prefix hits, and a page
that shows an image matches only a page that shows the same image."""

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from conftest import collect
from PIL import Image
from tiny_models import make_tiny_model
from tiny_vision import (save_tiny_gemma3_vision, save_tiny_gemma4_vision, save_tiny_idefics3_vision,
                         save_tiny_lfm2_vl_vision, save_tiny_mistral3_vision, save_tiny_qwen2_5_vision,
                         save_tiny_qwen3_5_vision, save_tiny_qwen3_vision)

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.memory.paging import page_hashes
from mlx_worker.vision.image_inputs import image_spans

N = 10


@pytest.fixture(scope="module", params=["gemma3", "gemma4", "gemma4_bidirectional", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "idefics3",
                                                "smolvlm", "smolvlm_tiles", "mistral3", "pixtral", "lfm2_vl"])
def checkpoint(request, tmp_path_factory):
    save = {"gemma3": save_tiny_gemma3_vision, "gemma4": save_tiny_gemma4_vision,
            "gemma4_bidirectional": lambda path: save_tiny_gemma4_vision(path, bidirectional=True),
            "qwen2_5_vl": save_tiny_qwen2_5_vision,
            "idefics3": save_tiny_idefics3_vision,
            "smolvlm": lambda path: save_tiny_idefics3_vision(path, model_type="smolvlm"),
            "smolvlm_tiles": lambda path: save_tiny_idefics3_vision(path, model_type="smolvlm", tiles=True),
            "mistral3": save_tiny_mistral3_vision, "qwen3_vl": save_tiny_qwen3_vision,
            "qwen3_5": save_tiny_qwen3_5_vision,
            "pixtral": lambda path: save_tiny_mistral3_vision(path, model_type="pixtral"),
            "lfm2_vl": save_tiny_lfm2_vl_vision}[request.param]
    return str(save(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """mlx-vlm's own greedy generation: (messages, images) -> token ids."""
    from mlx_vlm import load

    vlm, processor = load(checkpoint)
    return lambda messages, images: vlm_greedy(vlm, processor, messages, images)


def vlm_greedy(vlm, processor, messages, images, n=N):
    """mlx-vlm's own n greedy tokens for a conversation and its images."""
    from mlx_vlm import stream_generate

    return [r.token for r in stream_generate(vlm, processor, render(processor, messages), image=images or None,
                                             max_tokens=n, temperature=0.0)][:n]


def picture(seed, size=(40, 50)):
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype(np.uint8))


def render(processor, messages):
    return processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def user(*parts):
    return {"role": "user", "content": [{"type": "image"} if not isinstance(p, str) else {"type": "text", "text": p}
                                        for p in parts]}



def request(eng, rid, messages, images):
    text = render(eng.model.processor, messages)
    if images:
        ids, inputs = eng.model.prompt(text, images)
    else:
        ids, inputs = eng.tokenizer.encode(text, add_special_tokens=False), None
    return Request(rid=rid, prompt_ids=ids, images=inputs, params=SamplingParams(max_tokens=N, temperature=0.0))


def run(eng, reqs):
    async def main():
        return await asyncio.gather(*[collect(eng, r) for r in reqs])

    return asyncio.run(main())


CONVERSATIONS = [
    ([user("Look at this:", None, "What is in this picture?")], [picture(0)]),
    ([user("Two of them.", None, None, "Which is brighter?")], [picture(1), picture(2, (30, 30))]),
    ([user("No picture here, just words to continue.")], []),
    ([user(None, "Describe it in one line, then list the colours you see, in order of area.")], [picture(3, (64, 20))]),
]


def test_greedy_tokens_equal_mlx_vlm_batched_with_text_and_other_images(checkpoint, reference):
    """In 16-token prefill chunks (whole prompts in one chunk: the tests below)."""
    eng = Engine(EngineConfig(model=checkpoint, max_total_tokens=4096, max_batched_tokens=16))
    try:
        reqs = [request(eng, f"r{i}", m, ims) for i, (m, ims) in enumerate(CONVERSATIONS)]
        # A chunk boundary falls inside an image's tokens.
        assert any(s // 16 != (e - 1) // 16 for r in reqs if r.images for s, e in r.images.spans)
        outs = run(eng, reqs)
        for (messages, images), (toks, last) in zip(CONVERSATIONS, outs):
            assert toks == reference(messages, images)
        assert outs[0][1].num_prompt_tokens == len(reqs[0].prompt_ids) > 4  # image tokens counted
        assert eng.stats()["kv_pages_used"] == 0
    finally:
        eng.shutdown()


def test_a_second_turn_with_the_same_image_is_a_prefix_hit_and_another_image_never_is(checkpoint, reference):
    eng = Engine(EngineConfig(model=checkpoint, max_total_tokens=4096))
    try:
        lead = "A long description of the scene comes first, so that the first page is text only:"
        first = [user(lead, None, "What is it? Say it in a few words, and then say what colour it is.")]
        (toks, last), = run(eng, [request(eng, "t1", first, [picture(5)])])
        assert toks == reference(first, [picture(5)]) and last.num_cached_tokens == 0
        answer = eng.tokenizer.decode(toks)
        second = first + [{"role": "assistant", "content": [{"type": "text", "text": answer}]}, user("And its colour?")]
        req = request(eng, "t2", second, [picture(5)])
        (toks, last), = run(eng, [req])
        assert toks == reference(second, [picture(5)])
        span_end = req.images.spans[0][1]
        assert last.num_cached_tokens >= span_end // 16 * 16 + 16  # past the image's pages (the question fills one)
        # The same words about another picture: only the text-only pages before it hit.
        other = request(eng, "t3", second, [picture(6)])
        (toks, last), = run(eng, [other])
        assert toks == reference(second, [picture(6)])
        before_image = other.images.spans[0][0] // 16 * 16
        # A model with recurrent layers resumes only at a state snapshot: the first prompt
        # to branch off there leaves one (for the next), it gets none.
        assert last.num_cached_tokens == (0 if eng.snapshots is not None else before_image) and before_image > 0
    finally:
        eng.shutdown()


def test_page_hashes_mix_in_the_images_each_page_shows():
    ids = list(range(100, 148))  # 3 pages; an image's tokens at 20..27 (page 1)
    spans = image_spans([0] * 20 + [7] * 8 + [0] * 20, 7, 1)
    assert spans == [(20, 28)]
    from mlx_worker.vision.image_inputs import ImageInputs

    a = ImageInputs(arrays={}, hashes=["aa" * 16], spans=spans).page_salts(48, 16)
    b = ImageInputs(arrays={}, hashes=["bb" * 16], spans=spans).page_salts(48, 16)
    ha, hb, plain = page_hashes(ids, 16, None, a), page_hashes(ids, 16, None, b), page_hashes(ids, 16)
    assert ha[0] == hb[0] == plain[0] and len({ha[1], hb[1], plain[1]}) == 3 and ha[2] != hb[2]
    # Tiles of one image split by other tokens: the image spans them all.
    assert image_spans([7, 7, 0, 7, 7, 0], 7, 1) == [(0, 5)]
    assert image_spans([7, 7, 0, 7, 7, 0], 7, 2) == [(0, 2), (3, 5)]
    assert image_spans([7, 0, 7, 0, 7, 0, 7], 7, 2, crops=[3, 1]) == [(0, 5), (6, 7)]  # tiles, then the whole


def test_a_text_model_refuses_images():
    eng = Engine(EngineConfig(max_total_tokens=1024), model=make_tiny_model("llama"))
    try:
        from mlx_worker.vision.image_inputs import ImageInputs

        req = Request(rid="x", prompt_ids=[1, 2, 3], images=ImageInputs(arrays={}, hashes=[], spans=[]))
        with pytest.raises(ValueError, match="reads no images"):
            run(eng, [req])
    finally:
        eng.shutdown()


def test_an_image_sent_again_past_another_prefix_is_not_encoded_again(checkpoint, reference):
    """The prefix differs before the image (no page hit on it): its features come from
    the image cache, and the tokens are still mlx-vlm's."""
    import json
    from pathlib import Path

    from mlx_worker.vision.image_features import image_features

    assert image_features(json.loads((Path(checkpoint) / "config.json").read_text())["model_type"]) is not None
    eng = Engine(EngineConfig(model=checkpoint, max_total_tokens=4096))
    try:
        first = [user("First words.", None, "What is it?")]
        (toks, _), = run(eng, [request(eng, "a", first, [picture(7)])])
        assert toks == reference(first, [picture(7)])
        second = [user("Other words before them this time, long enough to fill a page:", None, "and", None, "?")]
        large = picture(8, (600, 800))  # tiled, where the family tiles (LFM2-VL; SmolVLM, tiling)
        (toks, last), = run(eng, [request(eng, "b", second, [large, picture(7)])])
        assert toks == reference(second, [large, picture(7)])
        assert last.num_cached_tokens == 0
        assert eng.stats()["images"]["images_encoded"] == 2 and eng.stats()["images"]["image_hits"] == 1
    finally:
        eng.shutdown()


def test_the_image_cache_is_a_setting_and_zero_turns_it_off(tmp_path):
    from tiny_vision import save_tiny_gemma3_vision

    eng = Engine(EngineConfig(model=str(save_tiny_gemma3_vision(tmp_path)), max_total_tokens=4096, image_cache_bytes=0))
    try:
        for rid, words in (("a", "First words."), ("b", "Other words before the image this time, to fill a page:")):
            run(eng, [request(eng, rid, [user(words, None, "What is it?")], [picture(7)])])
        st = eng.stats()["images"]
        assert st["max_bytes"] == 0 and st["cached_images"] == 0
        assert st["images_encoded"] == 2 and st["image_hits"] == 0
    finally:
        eng.shutdown()


def test_the_images_of_prompts_arriving_together_share_one_call_of_the_tower(checkpoint, reference):
    """Three prompts whose images one step shows first: where the family's images batch
    (`gather`), one call of the vision tower for all of them, the same image once, and
    every prompt's embeddings equal to those of its images encoded alone; served
    together (in however many steps they arrive), the tokens are mlx-vlm's."""
    import json
    from pathlib import Path

    from mlx_worker.vision.image_features import image_features
    from mlx_worker.vision.vision_model import load_vision_model

    family = image_features(json.loads((Path(checkpoint) / "config.json").read_text())["model_type"])
    convs = [([user("One:", None, "Say what it is.")], [picture(11)]),
             ([user(None, "And these two?", None)], [picture(12, (30, 60)), picture(11)]),
             ([user("Last:", None)], [picture(13, (50, 30))])]
    alone, _ = load_vision_model(checkpoint)
    together, _ = load_vision_model(checkpoint)
    prompts = [alone.prompt(render(alone.processor, m), ims) for m, ims in convs]
    fresh = together.encode_new_images([images for _, images in prompts])
    assert together.tower_calls == (1 if hasattr(family, "gather") else 0) and len(fresh) == (3 if fresh else 0)
    for ids, images in prompts:
        batched = together.prompt_embeddings(ids, images, fresh)
        assert mx.allclose(batched, alone.prompt_embeddings(ids, images), atol=1e-5).item()
    assert together.tower_calls == (1 if hasattr(family, "gather") else len(convs))
    assert together.stats()["images_encoded"] == 3  # picture 11 once

    eng = Engine(EngineConfig(model=checkpoint, max_total_tokens=4096))
    try:
        outs = run(eng, [request(eng, f"p{i}", m, ims) for i, (m, ims) in enumerate(convs)])
        for (messages, images), (toks, _) in zip(convs, outs):
            assert toks == reference(messages, images)
        assert eng.stats()["images"]["images_encoded"] == 3
    finally:
        eng.shutdown()


def test_image_tokens_attending_both_ways_resume_from_a_prefix_hit_inside_the_image(tmp_path):
    """Gemma 4's larger checkpoints: the image's tokens attend to each other both ways.
    A second prompt that shares the first's image but not its question hits the pages up
    to one inside the image's tokens (their keys were computed with the whole image in
    view); the rest of the image is computed seeing all of it, as mlx-vlm's one forward."""
    from mlx_vlm import load
    from tiny_vision import save_tiny_gemma4_vision

    checkpoint = str(save_tiny_gemma4_vision(tmp_path, bidirectional=True))
    vlm, processor = load(checkpoint)
    eng = Engine(EngineConfig(model=checkpoint, max_total_tokens=4096))
    try:
        lead = "Words before the picture:"  # its image's tokens at 10 .. 21: the first page ends inside
        for rid, question in (("a", "What is it?"), ("b", "Its colours?")):
            messages = [user(lead, None, question)]
            req = request(eng, rid, messages, [picture(9)])
            (toks, last), = run(eng, [req])
            assert toks == vlm_greedy(vlm, processor, messages, [picture(9)])
        (start, end), = req.images.blocks
        assert start < last.num_cached_tokens < end
    finally:
        eng.shutdown()


def test_a_step_with_decode_rows_runs_one_prompts_images_through_the_tower_beyond_its_gap(tmp_path):
    """Rows decoding while three prompts with images arrive at once, the token gap too
    short for any image: a step that decodes encodes the images of one prompt at most
    (before, all three went with the step's prefill floor), the step cost counts the
    tower's time, and every answer is still mlx-vlm's."""
    from mlx_vlm import load
    from tiny_vision import save_tiny_gemma3_vision

    checkpoint = str(save_tiny_gemma3_vision(tmp_path))
    vlm, processor = load(checkpoint)
    eng = Engine(EngineConfig(model=checkpoint, max_total_tokens=4096, max_token_gap_s=0.0005))
    steps, finish = [], eng._finish_step

    def record(step):
        finish(step)
        steps.append((len(step.plan.decode), [c.image_tokens for c in step.plan.prefills if c.image_tokens]))

    eng._finish_step = record
    texts = [[user(f"Count to twenty, {w} and slowly.")] for w in ("one by one", "in French")]
    convs = [([user("What is this?", None)], [picture(20 + i, (40 + 8 * i, 50))]) for i in range(3)]
    try:
        async def main():
            long = [request(eng, f"t{i}", m, []) for i, m in enumerate(texts)]
            for r in long:
                r.params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
            rows = [asyncio.create_task(collect(eng, r)) for r in long]
            while len(steps) < 8:  # decoding, the step cost fitted
                await asyncio.sleep(0.005)
            shown = [asyncio.create_task(collect(eng, request(eng, f"i{i}", m, ims)))
                     for i, (m, ims) in enumerate(convs)]
            return await asyncio.gather(*shown), await asyncio.gather(*rows)

        answers, _ = asyncio.run(main())
    finally:
        eng.shutdown()
    for (messages, images), (toks, _) in zip(convs, answers):
        assert toks == vlm_greedy(vlm, processor, messages, images)
    encoded = [tokens for decode, tokens in steps if tokens]
    assert sum(len(t) for t in encoded) == 3  # each prompt's images once
    assert all(decode and len(tokens) == 1 for decode, tokens in steps if tokens), steps
    assert "image_token_ms" in eng.stats()["step_cost"]  # the fit has the tower among its features


def test_prompts_whose_images_go_in_whole_never_wait_on_each_others_pages(tmp_path):
    """Gemma 4's larger layout, a pool of 3 pages and 8-token steps: two prompts of ~33
    tokens, each with an image at 10 .. 21. Had both been admitted on part of their
    pages, each would wait at its image for a page the other holds (they did: no step
    ever ran again); a prompt is admitted with pages for all of it, so they take turns."""
    from mlx_vlm import load
    from tiny_vision import save_tiny_gemma4_vision

    checkpoint = str(save_tiny_gemma4_vision(tmp_path, bidirectional=True))
    vlm, processor = load(checkpoint)
    eng = Engine(EngineConfig(model=checkpoint, max_total_tokens=48, max_batched_tokens=8, min_prefill_tokens=8,
                              step_budget="tokens"))
    convs = [([user("Words before the picture:", None, q)], [picture(30 + i)])
             for i, q in enumerate(("What is it?", "Which colour?"))]
    try:
        reqs = [request(eng, f"r{i}", m, ims) for i, (m, ims) in enumerate(convs)]
        assert eng.stats()["kv_pages_total"] == 3 and all(r.images.blocks == [(10, 22)] for r in reqs)
        from mlx_worker.memory.activations import activation_budget

        assert eng.activation_bytes == activation_budget(eng.model, 16, eng.config.max_running_requests,
                                                         eng.vocab_size)  # an image (up to 16 tokens) in one chunk

        async def main():
            return await asyncio.wait_for(asyncio.gather(*[collect(eng, r) for r in reqs]), 30)

        outs = asyncio.run(main())
    finally:
        eng.shutdown()
    for (messages, images), (toks, _) in zip(convs, outs):
        assert toks == vlm_greedy(vlm, processor, messages, images)


def test_speculative_decoding_on_a_vision_model_gives_its_tokens(tmp_path):
    """`speculative: {method: suffix}` on Qwen2.5-VL, the same conversations sent twice
    (the second time drafted from the first's answers): verify rows run at their M-RoPE
    positions past the prompt (its images' grids shift them), and the tokens, batched
    with text and other images, are still mlx-vlm's."""
    from mlx_vlm import load
    from tiny_vision import save_tiny_qwen2_5_vision

    checkpoint = str(save_tiny_qwen2_5_vision(tmp_path))
    vlm, processor = load(checkpoint)
    eng = Engine(EngineConfig(model=checkpoint, max_total_tokens=4096,
                              speculative={"method": "suffix", "adaptive": False, "num_draft_tokens": 3}))
    try:
        outs = []
        for turn in range(2):
            reqs = [request(eng, f"r{turn}-{i}", m, ims) for i, (m, ims) in enumerate(CONVERSATIONS)]
            for r in reqs:
                r.params = SamplingParams(max_tokens=2 * N, temperature=0.0)
            outs += run(eng, reqs)
        drafts = eng.stats()["speculative"]
    finally:
        eng.shutdown()
    for (messages, images), (toks, _) in zip(CONVERSATIONS * 2, outs):
        assert toks == vlm_greedy(vlm, processor, messages, images, 2 * N)
    assert drafts["verify_rows"] > 0 and drafts["accepted_tokens"] > 0, drafts
