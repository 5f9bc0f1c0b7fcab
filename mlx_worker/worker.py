"""Builds each step's forward passes lazily and runs them on the device asynchronously."""

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx

from .kv_pool import KVPool
from .paged_cache import BatchLayout, make_caches
from .scheduler import StepPlan


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1).astype(mx.int32)


@dataclass
class InFlightStep:
    plan: StepPlan
    tokens: Optional[mx.array]  # one sampled token per sampling row, still lazy


class Worker:
    """Runs a StepPlan: one batched decode forward plus one forward per prefill chunk.

    `launch` only builds the graph and calls `mx.async_eval`; the next step can then be
    built on the still-lazy tokens (each decoding sequence's `next_input`) while the
    device works. `finalize` waits for the tokens and returns them as ints.
    """

    def __init__(self, model, pool: KVPool):
        self.model = model
        self.pool = pool

    def launch(self, plan: StepPlan) -> InFlightStep:
        P = self.pool.page_size
        sampled = []
        if plan.decode:
            seqs = [s for s, _ in plan.decode]
            inputs = mx.concatenate([s.next_input for s in seqs])[:, None]
            layout = BatchLayout([s.pages for s in seqs], [p for _, p in plan.decode], 1, P)
            logits = self.model(inputs, cache=make_caches(self.pool, layout))
            sampled.append(greedy(logits[:, -1, :]))
        for chunk in plan.prefills:
            seq = chunk.seq
            inputs = mx.array(seq.tokens[chunk.start : chunk.start + chunk.length])[None]
            layout = BatchLayout([seq.pages], [chunk.start], chunk.length, P)
            logits = self.model(inputs, cache=make_caches(self.pool, layout))
            if chunk.samples:
                sampled.append(greedy(logits[:, -1, :]))
        tokens = None
        if sampled:
            tokens = mx.concatenate(sampled) if len(sampled) > 1 else sampled[0]
            for i, seq in enumerate(plan.sampling_rows()):
                seq.next_input = tokens[i : i + 1]
            mx.async_eval(tokens, *self.pool.arrays())
        else:
            mx.async_eval(*self.pool.arrays())
        return InFlightStep(plan, tokens)

    def finalize(self, step: InFlightStep) -> List[int]:
        if step.tokens is None:
            mx.eval(*self.pool.arrays())
            return []
        return step.tokens.tolist()
