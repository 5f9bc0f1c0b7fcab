"""Sampling parameters and the in-graph sampler: penalties, bias, temperature, top-k/p,
min-p, seeded Gumbel-max noise, logprobs. Greedy rows stay an exact argmax."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, Field, field_validator, model_validator

from .grammar import GrammarSpec

MAX_N = 16
MAX_TOP_LOGPROBS = 20


class SamplingParams(BaseModel):
    """OpenAI's sampling surface (plus vLLM's usual extras), validated."""

    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Optional[int] = None
    stop: List[str] = Field(default_factory=list)
    stop_token_ids: List[int] = Field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Dict[int, float] = Field(default_factory=dict)
    n: int = Field(1, ge=1, le=MAX_N)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    structured: Optional[GrammarSpec] = None  # JSON schema / JSON object / regex / choice

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Union[str, List[str], None]):
        v = [v] if isinstance(v, str) else (v or [])
        if any(not isinstance(s, str) or s == "" for s in v):
            raise ValueError("stop strings must be non-empty strings")
        if len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: Dict[int, float]):
        for tok, b in v.items():
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias for token {tok} must be in [-100, 100], got {b}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")


def _fmix32(x: mx.array) -> mx.array:
    """MurmurHash3's finalizer: a good 32-bit mixer made of integer ops."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, mx.uint32)
    return x ^ (x >> 16)


def gumbel_noise(seeds: mx.array, steps: mx.array, vocab: int) -> mx.array:
    """Gumbel(0, 1) noise (B, V) that depends only on (seed, output index, token id), so a
    seeded request samples the same tokens whatever the batch, chunking or preemption."""
    row = _fmix32(seeds.astype(mx.uint32) ^ _fmix32(steps.astype(mx.uint32) * mx.array(0x9E3779B9, mx.uint32)))
    bits = _fmix32(row[:, None] ^ _fmix32(mx.arange(vocab, dtype=mx.uint32)[None] + mx.array(0x632BE5AB, mx.uint32)))
    # 23 bits + 0.5 is exact in float32, so 0 < u < 1 strictly (u == 1 would give +inf).
    u = ((bits >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))
    return -mx.log(-mx.log(u))


@dataclass
class SamplerRow:
    params: SamplingParams
    seed: int
    step: int  # output index of the token being sampled
    counts: Optional[mx.array] = None  # (V,) output token counts, for presence/frequency
    seen: Optional[mx.array] = None  # (V,) bool, prompt + output, for repetition penalty
    additive: Optional[np.ndarray] = None  # (V,) added to logits: -inf hides tokens


@dataclass
class SampleResult:
    tokens: mx.array  # (R,) int32
    logprobs: Optional[mx.array] = None  # (R,) log-prob of each chosen token
    top_ids: Optional[mx.array] = None  # (R, k)
    top_logprobs: Optional[mx.array] = None  # (R, k)
    counts: Optional[mx.array] = None  # updated (R, V) counts, rows aligned with input
    seen: Optional[mx.array] = None

    def arrays(self) -> List[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs, self.counts, self.seen) if a is not None]


def sample(logits: mx.array, rows: List[SamplerRow]) -> SampleResult:
    """One token per row of `logits` (R, V), all in the lazy graph (no device sync)."""
    logits = logits.astype(mx.float32)
    R, V = logits.shape
    ps = [r.params for r in rows]
    raw = logits
    res = SampleResult(tokens=None)

    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = mx.stack([r.seen if r.seen is not None else mx.zeros((V,), mx.bool_) for r in rows])
        rp = mx.array([p.repetition_penalty for p in ps])[:, None]
        logits = mx.where(seen, mx.where(logits > 0, logits / rp, logits * rp), logits)
        res.seen = seen
    if any(p.presence_penalty or p.frequency_penalty for p in ps):
        counts = mx.stack([r.counts if r.counts is not None else mx.zeros((V,)) for r in rows])
        pres = mx.array([p.presence_penalty for p in ps])[:, None]
        freq = mx.array([p.frequency_penalty for p in ps])[:, None]
        logits = logits - pres * (counts > 0) - freq * counts
        res.counts = counts
    if any(r.additive is not None or r.params.logit_bias for r in rows):
        add = np.zeros((R, V), np.float32)
        for i, r in enumerate(rows):
            if r.additive is not None:
                add[i, : len(r.additive)] = r.additive[:V]
            for tok, b in r.params.logit_bias.items():
                add[i, tok] += b
        logits = logits + mx.array(add)

    greedy_tok = mx.argmax(logits, axis=-1)
    if all(p.greedy for p in ps):
        tokens = greedy_tok
    else:
        temp = mx.array([p.temperature if not p.greedy else 1.0 for p in ps])[:, None]
        x = logits / temp
        x = _filter(x, ps)
        noise = gumbel_noise(mx.array([r.seed for r in rows], mx.uint32), mx.array([r.step for r in rows], mx.uint32), V)
        sampled = mx.argmax(x + noise, axis=-1)
        tokens = mx.where(mx.array([p.greedy for p in ps]), greedy_tok, sampled)
    res.tokens = tokens.astype(mx.int32)

    if any(p.logprobs for p in ps):
        lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        res.logprobs = mx.take_along_axis(lp, res.tokens[:, None], axis=-1)[:, 0]
        k = max(p.top_logprobs for p in ps)
        if k:
            idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(lp, idx, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            res.top_ids = mx.take_along_axis(idx, order, axis=-1).astype(mx.int32)
            res.top_logprobs = mx.take_along_axis(vals, order, axis=-1)

    if res.counts is not None or res.seen is not None:
        onehot = mx.arange(V)[None] == res.tokens[:, None]
        if res.counts is not None:
            res.counts = res.counts + onehot
        if res.seen is not None:
            res.seen = res.seen | onehot
    return res


def _filter(x: mx.array, ps: List[SamplingParams]) -> mx.array:
    """Mask (to -inf) what top-k, top-p and min-p exclude; x is temperature-scaled."""
    neg = mx.array(-float("inf"), x.dtype)
    if any(p.min_p > 0 for p in ps):
        min_p = mx.array([p.min_p for p in ps])[:, None]
        top = mx.max(x, axis=-1, keepdims=True)
        x = mx.where(x < top + mx.log(min_p), neg, x)  # p < min_p * p_max
    if any(p.top_k > 0 or p.top_p < 1.0 for p in ps):
        V = x.shape[-1]
        srt = -mx.sort(-x, axis=-1)  # descending
        k = mx.array([p.top_k if 0 < p.top_k < V else V for p in ps])
        probs = mx.softmax(srt, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        top_p = mx.array([p.top_p for p in ps])[:, None]
        keep = mx.sum(before < top_p, axis=-1)  # smallest prefix with mass >= top_p
        keep = mx.minimum(keep, k)
        kth = mx.take_along_axis(srt, (keep - 1)[:, None], axis=-1)
        x = mx.where(x < kth, neg, x)
    return x
