"""The Serve app end to end: real Ray, real Serve, real HTTP, the real openai client."""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from conftest import reference_greedy
from mlx_lm import load as mlx_load
from serve_fixtures import ENGINE, run_apps, serving, tiny_model_dir

KEY = "sk-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    with serving() as base:  # a replica takes one of Ray's 8 CPUs: 6 replicas (tiny models)
        run_apps(base, [
            ("main", "/", dict(model=path, model_name="tiny", engine=ENGINE, router="pow2", api_key=KEY)),
            ("small", "/small", dict(model=path, model_name="tiny", engine=ENGINE, router="pow2",
                                     max_ongoing_requests=1, max_queued_requests=1)),
            ("strict", "/strict", dict(model=path, model_name="tiny", router="pow2", engine={
                **ENGINE, "max_batched_tokens": 2, "request_timeout_s": 1e-3})),  # nothing ahead is short enough
            ("pair", "/pair", dict(model=path, model_name="tiny", num_replicas=2, engine={
                **ENGINE, "max_batched_tokens": 2, "request_timeout_s": 1e-3},  # refuses whatever has work ahead
                router_kwargs={"load_weight": 0, "kv_weight": 0, "wait_weight": 0, "balance_window": 0})),  # prefix only
            ("hybrid", "/hybrid", dict(model=str(tiny_model_dir(tmp_path_factory, "qwen3_next")),
                                       model_name="tiny-hybrid", engine=ENGINE, router="pow2")),
        ])
        model, tok = mlx_load(path)
        yield base, model, tok


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0)


def greedy_text(served, messages, n):
    _, model, tok = served
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tok.decode(reference_greedy(model, ids, n), skip_special_tokens=True), ids


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def test_chat_non_stream_equals_engine_greedy(served, client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    text, ids = greedy_text(served, MSGS, 12)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_joins_to_the_same_text_with_usage(served, client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_text(served, MSGS, 12)[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_multi_turn_uses_the_chat_template(served, client):
    msgs = MSGS + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == greedy_text(served, msgs, 6)[0]


def test_multi_turn_chat_on_a_hybrid_model_hits_the_cache_from_turn_2(served, tmp_path_factory):
    """qwen3_next (linear-attention layers with recurrent state): each turn resends the
    whole conversation; from turn 2 on the prompt resumes from a state snapshot."""
    hybrid = openai.OpenAI(base_url=f"{served[0]}/hybrid/v1", api_key="none", max_retries=0)
    model, tok = mlx_load(str(tiny_model_dir(tmp_path_factory, "qwen3_next")))
    msgs = [{"role": "system", "content": "You are a patient tutor who answers in one short sentence. " * 3}]
    cached = []
    for turn in ("What is a prime number?", "Give an example.", "And a larger one?"):
        msgs.append({"role": "user", "content": turn})
        r = hybrid.chat.completions.create(model="tiny-hybrid", messages=msgs, max_tokens=8, temperature=0)
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
        assert r.choices[0].message.content == tok.decode(reference_greedy(model, ids, 8), skip_special_tokens=True)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    assert cached[0] == 0 and 0 < cached[1] < cached[2], cached
    stats = httpx.get(f"{served[0]}/hybrid/v1/stats", timeout=30).json()["replica"]
    assert stats["state_snapshots"] > 0 and stats["recurrent_state_bytes_per_request"] > 0


def test_completions_echo_scores_the_prompt(served, client):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0. The prompt comes
    back with each token's logprob under the model (the first has none)."""
    import mlx.core as mx

    _, model, tok = served
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ch = r.choices[0]
    assert ch.text == prompt and r.usage.completion_tokens == 0
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    want = [(logits[i] - mx.logsumexp(logits[i]))[ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert mx.allclose(mx.array(lp.token_logprobs[1:]), mx.array(want), atol=1e-3).item()
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    more = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, temperature=0)
    assert more.choices[0].text.startswith(prompt) and len(more.choices[0].text) > len(prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, echo=True, temperature=0, stream=True) if c.choices)
    assert streamed == more.choices[0].text


def test_embeddings_float_and_base64(served, client):
    import mlx.core as mx
    import numpy as np

    _, model, tok = served
    texts = ["hello world", "a longer sentence about the sea"]
    r = client.embeddings.create(model="tiny", input=texts)  # the SDK asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    for text, d in zip(texts, r.data):
        h = model.model(mx.array([tok.encode(text)]))[0, -1].astype(mx.float32)
        assert np.allclose(d.embedding, np.array(h / mx.linalg.norm(h)), atol=1e-4)
    plain = client.embeddings.create(model="tiny", input=[tok.encode("hello world")], encoding_format="float")
    assert np.allclose(plain.data[0].embedding, r.data[0].embedding, atol=1e-5)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny", input="")


def test_completions_stream_and_not(served, client):
    _, model, tok = served
    ref = tok.decode(reference_greedy(model, tok.encode("Once upon a time"), 10), skip_special_tokens=True)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert r.choices[0].text == ref
    s = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in s) == ref


def test_n_logprobs_and_seed(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, n=3, seed=11,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        assert all(t.logprob <= 0 for t in c.logprobs.content)
    again = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, n=3, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    other = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, n=3, seed=12)
    assert [c.message.content for c in other.choices] != [c.message.content for c in r.choices]


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40, seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_stop_string(served, client):
    full = greedy_text(served, MSGS, 20)[0]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_32_concurrent_streams_are_all_correct(served):
    base, model, tok = served
    prompts = [f"Request number {i}: tell me about topic {i * 7}." for i in range(32)]
    refs = [tok.decode(reference_greedy(model, tok.encode(p), 16), skip_special_tokens=True) for p in prompts]

    async def one(ac, p):
        text = ""
        async with ac.stream("POST", f"{base}/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0, "stream": True},
                             headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(timeout=300) as ac:
            return await asyncio.gather(*[one(ac, p) for p in prompts])

    assert asyncio.run(main()) == refs


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{served[0]}/health").json() == {"status": "ok"}


def _err(r):
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("body", [
    {"messages": MSGS, "top_p": 0},
    {"messages": MSGS, "max_tokens": -1},
    {"messages": [], "max_tokens": 4},
    {"messages": MSGS, "n": 100},
    {"messages": MSGS, "logit_bias": {"99999999": 1}},
    {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
])
def test_bad_requests_are_400_with_openai_errors(served, body):
    r = httpx.post(f"{served[0]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    assert _err(r)["type"] == "invalid_request_error"


def test_malformed_json_and_long_prompt_are_400(served):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{served[0]}/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and _err(r)
    long = {"prompt": list(range(100, 1200)), "max_tokens": 4}
    r = httpx.post(f"{served[0]}/v1/completions", json=long, headers=h)
    assert r.status_code == 400 and "context" in _err(r)["message"]


def test_unknown_model_404_and_bad_key_401(served, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MSGS, max_tokens=2)
    bad = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)


def test_overload_gives_429_with_retry_after(served):
    base = served[0]

    async def one(ac):
        return await ac.post(f"{base}/small/v1/completions", json={"prompt": "hi", "max_tokens": 40, "temperature": 0})

    async def main():
        async with httpx.AsyncClient(timeout=120) as ac:
            return await asyncio.gather(*[one(ac) for _ in range(12)])

    rs = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    for r in rs:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and _err(r)["type"] == "rate_limit_error"
        else:
            assert r.json()["choices"][0]["text"]  # the admitted ones are served in full


def test_a_replica_over_its_queue_wait_refuses_with_429_and_retry_after(served):
    """The engine refuses a request that cannot finish within its timeout behind the
    request it is serving: the client gets 429 + Retry-After in its API's error shape,
    before any stream starts, and the request already taken is served in full."""
    url = f"{served[0]}/strict/v1"

    def stats():
        return httpx.get(f"{url}/stats", timeout=10).json()["replica"]

    with ThreadPoolExecutor(1) as pool:  # ~900 prompt tokens, 2 a step: in prefill for about a second
        long = pool.submit(httpx.post, f"{url}/completions", timeout=120,
                           json={"prompt": "word " * 900, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        while stats()["steps"] < 2:  # a step with prefill has been measured
            time.sleep(0.005)
        r = httpx.post(f"{url}/completions", timeout=60, json={"prompt": "hi again", "max_tokens": 4})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        err = _err(r)
        assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
        assert "overloaded" in err["message"] and "retry later" in err["message"]
        r = httpx.post(f"{url}/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 429 and _err(r)["code"] == "overloaded"
        r = httpx.post(f"{url}/messages", timeout=60,
                       json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["type"] == "error"  # Anthropic's shape, under the app's route prefix too
        assert long.result().status_code == 200 and long.result().json()["usage"]["completion_tokens"] == 4
    st = stats()
    # Each request was offered twice: the ingress tries another replica after a refusal, and
    # the router, having no other, sends it back to this one, which refuses it again.
    assert st["refused_overloaded"] == 6 and st["running"] == 0 and st["kv_pages_used"] == 0


def test_a_refusal_sends_the_request_to_the_next_replica(served):
    """The router sends a prompt to the replica that holds its prefix; that replica, busy
    with the first prompt, refuses it (it cannot finish in time); the ingress then tries
    the other replica, which takes it: the client never sees the refusal."""
    url = f"{served[0]}/pair/v1"
    text = "word " * 900
    with ThreadPoolExecutor(1) as pool:  # ~900 prompt tokens, 2 a step: in prefill for a second or more
        first = pool.submit(httpx.post, f"{url}/completions", timeout=120,
                            json={"prompt": text, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        time.sleep(0.3)
        r = httpx.post(f"{url}/completions", timeout=120, json={"prompt": text + "and more", "max_tokens": 2})
        assert first.result().status_code == 200
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # served where nothing was cached
    engines = {}
    for _ in range(50):  # /stats reaches one replica a call: ask until both answered
        st = httpx.get(f"{url}/stats", timeout=10).json()["replica"]
        engines[st["engine_id"]] = st
        if len(engines) == 2:
            break
    assert sum(st["refused_overloaded"] for st in engines.values()) == 1  # it was refused once, then taken


def test_client_disconnect_aborts_the_request(served):
    base = served[0]
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{base}/v1/completions", headers=h, timeout=60,
                      json={"prompt": "go", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break  # closing the stream here disconnects the client
    deadline = time.time() + 30
    while time.time() < deadline:
        st = httpx.get(f"{base}/v1/stats", headers=h).json()["replica"]
        if st["running"] == 0 and st["kv_pages_used"] == 0:
            break
        time.sleep(0.2)
    assert st["running"] == 0 and st["kv_pages_used"] == 0
    assert st["steps"] < 400  # stopped long before 900 tokens
