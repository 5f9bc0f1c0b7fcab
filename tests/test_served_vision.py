"""`deploy/app.yaml`'s args with `model:` a vision checkpoint (a tiny random Gemma 3 of
mlx-vlm's classes), on the local cluster the served tests share (`serve run` of the same
file is test_serve_run's; a cluster of its own costs 30 s): a screenshot sent from the openai
and anthropic SDKs gets mlx-vlm's own answer, the second turn about it comes back from
the prefix cache (cached_tokens, streamed usage too), and bad images get a 400 in each
API's own error shape, before any event of a stream, losing nothing else."""

import base64
import io
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest
import yaml
from PIL import Image
from serve_fixtures import run_app, serving
from tiny_vision import save_tiny_gemma3_vision

ROOT = Path(__file__).resolve().parents[1]
N = 8


def screenshot(seed):
    pixels = (np.random.RandomState(seed).rand(40, 60, 3) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return Image.fromarray(pixels), base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gemma3_vision(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def deployed(checkpoint):
    args = yaml.safe_load((ROOT / "deploy" / "app.yaml").read_text())["applications"][0]["args"]
    with serving() as base:
        run_app(base, "vision", "/vision", **{**args, "model": str(checkpoint)})
        httpx.get(f"{base}/vision/v1/stats", timeout=60)
        yield f"{base}/vision"


@pytest.fixture(scope="module")
def mlx_vlm_answer(checkpoint):
    from mlx_vlm import load, stream_generate

    vlm, processor = load(str(checkpoint))

    def answer(messages, images):
        prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tokens = [r.token for r in stream_generate(vlm, processor, prompt, image=images, max_tokens=N,
                                                   temperature=0.0)][:N]
        return processor.tokenizer.decode(tokens)

    return answer


QUESTION = "What does this screenshot show?"


def test_a_screenshot_from_the_sdks_gets_mlx_vlms_answer_and_the_second_turn_hits_the_cache(deployed, mlx_vlm_answer):
    image, b64 = screenshot(0)
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    expected = mlx_vlm_answer(template, [image])
    client = openai.OpenAI(base_url=f"{deployed}/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}", "detail": "high"}},
        {"type": "text", "text": QUESTION}]}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == expected
    assert chat.usage.prompt_tokens > 16  # the image's tokens counted
    message = anthropic.Anthropic(base_url=deployed, api_key="unused").messages.create(
        model=model, max_tokens=N, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == expected
    assert message.usage.cache_read_input_tokens > 0  # the same image and words: a prefix hit
    response = client.responses.create(model=model, max_output_tokens=N, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": f"data:image/png;base64,{b64}"},
                                    {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected
    # The second turn about the same screenshot: its image's pages come from the cache.
    second = messages + [{"role": "assistant", "content": expected}, {"role": "user", "content": "And the colours?"}]
    stream = client.chat.completions.create(model=model, messages=second, max_tokens=N, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens // 16 * 16
    # Another screenshot with the same words: no hit past the text before it.
    _, other = screenshot(1)
    messages[0]["content"][0]["image_url"]["url"] = f"data:image/png;base64,{other}"
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0)
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) < 16


def test_bad_images_get_a_400_in_each_apis_shape_and_lose_nothing_else(deployed):
    client = openai.OpenAI(base_url=f"{deployed}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id

    def chat(url, **kw):
        return client.chat.completions.create(model=model, max_tokens=4, **kw, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}])

    for url, why in [("data:image/png;base64,bm90IGFuIGltYWdl", "could not be decoded"),
                     ("https://example.com/cat.png", "does not fetch image URLs"),
                     ("file:///etc/passwd", "not file")]:
        with pytest.raises(openai.BadRequestError, match=why) as e:
            chat(url)
        assert e.value.body["code"] == "invalid_image"
    with pytest.raises(openai.BadRequestError, match="could not be decoded"):
        chat("data:image/png;base64,bm90IGFuIGltYWdl", stream=True)  # a JSON 400, before any event
    with pytest.raises(anthropic.BadRequestError, match="not valid base64") as e:
        anthropic.Anthropic(base_url=deployed, api_key="unused", max_retries=0).messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    _, b64 = screenshot(2)
    ok = chat(f"data:image/png;base64,{b64}")  # the replica took no harm
    assert ok.choices[0].finish_reason in ("length", "stop")
