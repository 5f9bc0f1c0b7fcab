"""Prefix-cache reuse of an agent loop on the deployed app: `serve run deploy/app.yaml` as
shipped (the embedded SmolLM2; only the HTTP port moved to loopback), a tool-using loop of
N turns over a ~2,000-token system prompt, through the OpenAI chat API and Anthropic's
Messages API. Each turn resends the whole conversation plus the tool's result.

    python benchmarks/agent_cache.py [--turns 10]

Prints, per turn, the prompt tokens and how many came from the prefix cache
(`usage.prompt_tokens_details.cached_tokens`; Anthropic `cache_read_input_tokens`).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import anthropic
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import deployed_app  # noqa: E402  (benchmarks/common.py)

SYSTEM = " ".join(f"Rule {i}: answer tersely, cite the tool's result, never guess the weather." for i in range(140))
WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
                          "required": ["city"]}}


def openai_loop(base, turns):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris, Rome and Oslo?"}]
    rows = []
    for turn in range(turns):
        t = time.perf_counter()
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=40,
                                           tools=[{"type": "function", "function": WEATHER}], tool_choice="required",
                                           temperature=0)
        call = r.choices[0].message.tool_calls[0]
        rows.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, time.perf_counter() - t))
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"turn": turn, "sky": "sunny"})}]
    return rows


def anthropic_loop(base, turns):
    client = anthropic.Anthropic(base_url=base, api_key="none")
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    msgs = [{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}]
    rows = []
    for turn in range(turns):
        t = time.perf_counter()
        r = client.messages.create(model="SmolLM2-135M-Instruct", system=SYSTEM, messages=msgs, max_tokens=40,
                                   tools=[tool], tool_choice={"type": "any"}, extra_body={"temperature": 0})
        use = next(b for b in r.content if b.type == "tool_use")
        u = r.usage
        rows.append((u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens, time.perf_counter() - t))
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": json.dumps({"turn": turn, "sky": "sunny"})}]}]
    return rows


def report(name, rows):
    print(f"\n## {name}")
    print(f"{'turn':>4}{'prompt':>8}{'cached':>8}{'share':>7}{'latency s':>11}")
    for i, (prompt, cached, dt) in enumerate(rows, 1):
        print(f"{i:>4}{prompt:>8}{cached:>8}{cached / prompt:>7.2f}{dt:>11.2f}")
    later = [c / p for p, c, _ in rows[1:]]
    print(f"turns 2..{len(rows)}: min share {min(later):.3f}, mean {sum(later) / len(later):.3f} (target >= 0.90)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=10)
    a = ap.parse_args()
    with deployed_app() as base:
        report("OpenAI chat completions", openai_loop(base, a.turns))
        report("Anthropic Messages", anthropic_loop(base, a.turns))


if __name__ == "__main__":
    main()
