"""Sampling parameters and the in-graph sampler: penalties, bias, temperature, top-k/p,
min-p, seeded Gumbel-max noise, logprobs. Greedy rows stay an exact argmax."""

from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Union

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, Field, field_validator, model_validator

from .grammar import GrammarSpec

MAX_N = 16
MAX_TOP_LOGPROBS = 20


class SamplingParams(BaseModel):
    """OpenAI's sampling surface (plus vLLM's usual extras), validated."""

    max_tokens: int = Field(16, ge=0)  # 0: score the prompt only (with prompt_logprobs)
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
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each prompt token's logprob + top k
    embedding: Optional[Literal["last", "mean"]] = None  # the prompt's pooled, normalized final hidden state
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
        if self.max_tokens == 0 and self.prompt_logprobs is None and self.embedding is None:
            raise ValueError("max_tokens must be at least 1 (0 only to score or embed the prompt)")
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


def gumbel_noise(seeds: mx.array, steps: mx.array, ids) -> mx.array:
    """Gumbel(0, 1) noise (B, n) for token `ids` ((B, n) array, or an int n: 0..n-1) that
    depends only on (seed, output index, token id): a seeded request samples the same
    tokens whatever the batch, chunking or preemption."""
    if isinstance(ids, int):
        ids = mx.arange(ids, dtype=mx.uint32)[None]
    row = _fmix32(seeds.astype(mx.uint32) ^ _fmix32(steps.astype(mx.uint32) * mx.array(0x9E3779B9, mx.uint32)))
    bits = _fmix32(row[:, None] ^ _fmix32(ids.astype(mx.uint32) + mx.array(0x632BE5AB, mx.uint32)))
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


def token_logprobs(logits: mx.array, ids: mx.array, k: int):
    """Log-probs (n,) of `ids` under `logits` (n, V), and the top k (ids, logprobs) of each row."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
    if not k:
        return chosen, None, None
    idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(lp, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return chosen, mx.take_along_axis(idx, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)


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

    greedy_tok = mx.argmax(logits, axis=-1) if any(p.greedy for p in ps) else None
    if all(p.greedy for p in ps):
        tokens = greedy_tok
    else:
        temp = mx.array([p.temperature if not p.greedy else 1.0 for p in ps])[:, None]
        seeds = mx.array([r.seed for r in rows], mx.uint32)
        steps = mx.array([r.step for r in rows], mx.uint32)
        if all(p.greedy or p.top_k > 0 or p.top_p < 1.0 for p in ps):
            sampled = _sample_candidates(logits, temp, ps, seeds, steps)
        else:  # some row samples from the whole vocabulary
            x = _min_p(logits / temp, ps)
            sampled = mx.argmax(_top_k_top_p_dense(x, ps) + gumbel_noise(seeds, steps, V), axis=-1)
        tokens = sampled if greedy_tok is None else mx.where(mx.array([p.greedy for p in ps]), greedy_tok, sampled)
    res.tokens = tokens.astype(mx.int32)

    if any(p.logprobs for p in ps):
        res.logprobs, res.top_ids, res.top_logprobs = token_logprobs(raw, res.tokens, max(p.top_logprobs for p in ps))

    if res.counts is not None or res.seen is not None:
        onehot = mx.arange(V)[None] == res.tokens[:, None]
        if res.counts is not None:
            res.counts = res.counts + onehot
        if res.seen is not None:
            res.seen = res.seen | onehot
    return res


NEG = -float("inf")
CANDIDATES = 1024  # top-k / top-p rows sample among this many best tokens


def _min_p(x: mx.array, ps: List[SamplingParams]) -> mx.array:
    """Drop tokens below min_p x the best token's probability (x is temperature-scaled)."""
    if not any(p.min_p > 0 for p in ps):
        return x
    min_p = mx.array([p.min_p for p in ps])[:, None]
    return mx.where(x < mx.max(x, axis=-1, keepdims=True) + mx.log(min_p), NEG, x)


def _keep_counts(srt: mx.array, lse: mx.array, ps: List[SamplingParams]) -> mx.array:
    """Per row, how many of the descending values `srt` top-k and top-p keep."""
    k = mx.array([p.top_k if p.top_k > 0 else srt.shape[-1] for p in ps])
    probs = mx.exp(srt - lse)
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    keep = mx.sum(before < mx.array([p.top_p for p in ps])[:, None], axis=-1)
    return mx.maximum(mx.minimum(keep, k), 1)


def _sample_candidates(logits: mx.array, temp: mx.array, ps: List[SamplingParams], seeds: mx.array,
                       steps: mx.array) -> mx.array:
    """Top-k / top-p sampling among the CANDIDATES best tokens of each row: a partial
    selection instead of a full-vocabulary sort (67 ms -> a few ms for 16 x 49k on
    CPU). Top-p mass is measured among the candidates, which is exact when the tokens
    outside them carry negligible probability (true of trained models; the vocabulary
    tail beyond the best 1,024 tokens is far below float precision of the nucleus)."""
    V = logits.shape[-1]
    K = min(V, max([CANDIDATES] + [p.top_k for p in ps]))
    # Temperature and min-p keep the order, so select on raw logits and scale only K.
    idx = mx.argpartition(logits, V - K, axis=-1)[:, V - K :] if K < V else mx.broadcast_to(mx.arange(V)[None], logits.shape)
    vals = mx.take_along_axis(logits, idx, axis=-1) / temp
    order = mx.argsort(-vals, axis=-1)
    srt, ids = mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(idx, order, axis=-1)
    srt = _min_p(srt, ps)
    # Mass is taken relative to the candidates (no exp over the whole vocabulary).
    keep = _keep_counts(srt, mx.logsumexp(srt, axis=-1, keepdims=True), ps)
    cand = mx.where(mx.arange(K)[None] < keep[:, None], srt, NEG)
    choice = mx.argmax(cand + gumbel_noise(seeds, steps, ids), axis=-1)
    return mx.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]


def _top_k_top_p_dense(x: mx.array, ps: List[SamplingParams]) -> mx.array:
    """Mask what top-k and top-p exclude over the full vocabulary (a full sort)."""
    if not any(p.top_k > 0 or p.top_p < 1.0 for p in ps):
        return x
    srt = -mx.sort(-x, axis=-1)
    keep = _keep_counts(srt, mx.logsumexp(x, axis=-1, keepdims=True), ps)
    kth = mx.take_along_axis(srt, (keep - 1)[:, None], axis=-1)
    return mx.where(x < kth, NEG, x)
