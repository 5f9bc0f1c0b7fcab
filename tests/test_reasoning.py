"""Reasoning models: thinking text (the model's own markers, as mlx-lm detects them) goes
to `reasoning_content` (chat), `delta.reasoning_content` (streamed) and thinking blocks
(Anthropic), never into the content; chat_template_kwargs reach the template."""

import json

import anthropic
import openai
import pytest
from mlx_lm.utils import load_tokenizer
from serve_fixtures import ENGINE, run_app, serving
from tiny_models import VOCAB, save_tiny_model

from mlx_worker.models.gguf import default_model_path
from serve_app.api.harmony import HarmonyParser, is_harmony
from serve_app.api.output_parser import OutputParser, ThinkFormat
from serve_app.api.tools import FunctionDef, Tool, call_format

THINK = ThinkFormat("<think>", "</think>")


def test_thinking_content_and_calls_split_whatever_the_chunking():
    text = 'plan it</think>Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call><think>more</think> done'
    tools = [Tool(type="function", function=FunctionDef(name="f"))]
    for size in (1, 3, 7, len(text)):
        p = OutputParser(THINK, call_format(object()), tools, in_reasoning=True)
        parsed = [p.feed(text[i:i + size]) for i in range(0, len(text), size)] + [p.finish("stop")]
        assert "".join(x.reasoning for x in parsed) == "plan itmore", size
        assert "".join(x.content for x in parsed) == "Sure.  done", size
        assert [c.function.name for x in parsed for c in x.calls] == ["f"]
    p = OutputParser(THINK)  # the prompt left no block open: thinking starts at the marker
    assert p.whole("<think>a</think>b", "stop")[:2] == ("b", "a")


HARMONY = ('<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary '
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')


def test_harmony_channels_map_to_reasoning_content_and_calls_whatever_the_chunking():
    """gpt-oss: analysis -> reasoning, final -> content, commentary to=functions.X -> a call
    (its <|call|> is a stop token, so the call ends with the text)."""
    tok = load_tokenizer(default_model_path())._tokenizer
    tok.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]})
    assert is_harmony(tok) and not is_harmony(load_tokenizer(default_model_path()))
    for size in (1, 4, 9, len(HARMONY)):
        p = HarmonyParser()
        parsed = [p.feed(HARMONY[i:i + size]) for i in range(0, len(HARMONY), size)] + [p.finish("stop")]
        assert "".join(x.reasoning for x in parsed) == "The user wants weather."
        assert "".join(x.content for x in parsed) == ""
        assert [(c.function.name, c.function.arguments) for x in parsed for c in x.calls] == \
            [("get_weather", '{"city": "Paris"}')]
    final = '<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>Sunny.'
    assert HarmonyParser().whole(final, "stop")[:2] == ("Sunny.", "hm")
    assert HarmonyParser().whole("no harmony here", "length")[0] == "no harmony here"


def thinking_model_dir(path):
    """A tiny model whose tokenizer has <think> and </think> tokens and whose template
    opens a thinking block in the generation prompt (as DeepSeek-R1's and Qwen3's do),
    passing `enable_thinking` through."""
    save_tiny_model("llama", path, vocab_size=VOCAB + 8)
    tok = load_tokenizer(default_model_path())._tokenizer
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is false %}<think>\n\n</think>\n{% else %}<think>\n{% endif %}{% endif %}")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = thinking_model_dir(tmp_path_factory.mktemp("thinking"))
    assert load_tokenizer(path).has_thinking
    with serving() as url:
        run_app(url, "thinking", "/", model=str(path), model_name="tiny", engine=ENGINE, router="pow2")
        yield url


MSGS = [{"role": "user", "content": "Why is the sky blue?"}]


def test_chat_puts_thinking_in_reasoning_content(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    kw = dict(model="tiny", messages=MSGS, max_tokens=12, extra_body={"temperature": 0})
    whole = client.chat.completions.create(**kw).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and not whole.content
    pieces = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in pieces) == reasoning
    assert "".join(d.content or "" for d in pieces) == ""
    off = client.chat.completions.create(**{**kw, "extra_body": {"temperature": 0, "chat_template_kwargs": {
        "enable_thinking": False}}})
    assert off.choices[0].message.content and not off.choices[0].message.model_extra.get("reasoning_content")
    on = client.chat.completions.create(**kw)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template rendered the closed block


def test_anthropic_stream_has_a_thinking_block(base):
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    kw = dict(model="tiny", messages=MSGS, max_tokens=12, extra_body={"temperature": 0})
    whole = client.messages.create(**kw)
    assert [b.type for b in whole.content][:1] == ["thinking"] and whole.content[0].thinking
    with client.messages.stream(**kw) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and final.content[0].thinking == whole.content[0].thinking
    assert json.dumps(final.model_dump()).count("<think>") == 0
