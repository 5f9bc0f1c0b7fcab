"""Requests in and outputs out of the engine, and the per-request state it keeps."""

import itertools
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional, Tuple, Union

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, Field

from .memory.paging import adapter_root, page_hashes
from .sampling.sampler import SamplingParams
from .vision.image_inputs import ImageInputs


class Request(BaseModel):
    rid: str
    prompt_ids: List[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    timeout_s: Optional[float] = Field(None, gt=0)  # the client's patience: admission refuses what cannot finish in it
    adapter: Optional[str] = None  # a LoRA adapter the engine serves (EngineConfig.adapters); None: the base model
    images: Optional[ImageInputs] = None  # the prompt's images (a vision model's), their tokens in prompt_ids


@dataclass
class RequestOutput:
    rid: str
    token_ids: List[int]  # new tokens since the previous output
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error"
    error: Optional[str] = None
    error_code: Optional[str] = None  # context_length_exceeded (the client's), engine_error (ours), ...
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: Optional[List[float]] = None  # one per token in token_ids
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    prompt_logprobs: Optional[List[Optional[float]]] = None  # first output only; the first token's is None
    prompt_top_logprobs: Optional[List[Optional[List[Tuple[int, float]]]]] = None
    embedding: Optional[List[float]] = None  # an embedding request's vector (its only output)
    index: int = 0  # which of the request's n samples
    text: str = ""  # new text (filled in by the engine facade)
    stop_reason: Optional[Union[str, int]] = None  # the stop string or token that matched
    retry_after_s: Optional[float] = None  # refused as overloaded: when a retry may be admitted


class Status(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


_arrivals = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Scheduler state of one request.

    `tokens` are the known ids (prompt + finalized output). `num_tokens` also counts
    output tokens still being computed on the device; the last of them is `next_input`,
    a lazy array that feeds the next decode step. `num_computed` tokens have their KV
    written (or being written) in `pages`.
    """

    rid: str
    tokens: List[int]
    params: SamplingParams
    num_prompt: int
    page_size: int
    arrival: int = field(default_factory=lambda: next(_arrivals))
    status: Status = Status.WAITING
    num_tokens: int = 0
    num_computed: int = 0
    pages: List[int] = field(default_factory=list)
    hashes: List[int] = field(default_factory=list)
    num_published: int = 0
    next_input: Optional[mx.array] = None
    num_cached: int = 0
    num_preemptions: int = 0
    finish_reason: Optional[str] = None
    seed: int = 0
    counts: Optional[mx.array] = None  # output token counts (presence/frequency penalties)
    seen: Optional[mx.array] = None  # tokens seen so far (repetition penalty)
    matcher: Optional[object] = None  # grammar.Matcher of a structured-output request
    state: Optional[object] = None  # recurrent_state.RowState after its last forward; None: fresh
    prompt_lp: List[float] = field(default_factory=list)  # logprob of prompt token i + 1 at position i
    prompt_top: List[List[Tuple[int, float]]] = field(default_factory=list)
    hidden_sum: Optional[mx.array] = None  # mean pooling: the sum of the prompt's final hidden states so far
    embedding: Optional[List[float]] = None
    branch_point: int = 0  # where its prompt leaves an earlier one's cached pages: snapshot there
    num_work: int = 0  # tokens run through the model for it, recomputation included
    timeout_s: Optional[float] = None  # Request.timeout_s
    deadline: Optional[float] = None  # perf_counter time its client gives up (set on admission; the leader's only)
    return_s: float = 0.0  # of that time, what the answer's way back to the client is given (engine.RETURN_SHARE)
    disk_reads: Optional[tuple] = None  # the SSD tier's reads of its prefix pages, started at arrival (kv_tiers/)
    uncached_estimate: Optional[int] = None  # tokens to compute, as the prefix cache stood at arrival (admission.py)
    adapter: Optional[str] = None  # Request.adapter
    adapter_slot: int = 0  # its adapter's slot in the LoRA layers (adapters/); 0: the base model
    draft_index: Optional[object] = None  # speculative/: its drafter's index of its tokens
    draft_acceptance: Optional[float] = None  # speculative/: its drafts' recent acceptance rate
    verifying: bool = False  # a step verifying (or replaying) drafts is in flight: its position is not known yet
    hidden: Optional[tuple] = None  # (final hidden states (n, H), first position) of its last forward (method mtp)
    images: Optional[ImageInputs] = None  # Request.images
    embeds: Optional[mx.array] = None  # its prompt's input embeddings, images in place (vision/), once a chunk needed them
    mrope: Optional[tuple] = None  # (prompt positions (3, n) or None, delta after the prompt): an M-RoPE model's (vision/)

    def __post_init__(self):
        self.num_tokens = len(self.tokens)
        self.seed = self.params.seed % 2**32 if self.params.seed is not None else secrets.randbits(32)

    def init_sampling_state(self, vocab: int) -> None:
        """Dense per-request arrays, made only for the parameters that need them."""
        p = self.params
        if (p.presence_penalty or p.frequency_penalty) and self.counts is None:
            self.counts = mx.zeros((vocab,))
        if p.repetition_penalty != 1.0 and self.seen is None:
            seen = np.zeros(vocab, bool)
            seen[[t for t in self.tokens if t < vocab]] = True
            self.seen = mx.array(seen)

    @classmethod
    def from_request(cls, req: Request, page_size: int) -> "Sequence":
        return cls(req.rid, list(req.prompt_ids), req.params, len(req.prompt_ids), page_size, timeout_s=req.timeout_s,
                   adapter=req.adapter, images=req.images)

    @property
    def due(self) -> Optional[float]:
        """When its last token must be computed for its client to have it by the deadline."""
        return None if self.deadline is None else self.deadline - self.return_s

    @property
    def phase(self) -> str:
        """Where it stands: "queued" (no work yet), "prefill" or "decode"."""
        if self.num_scheduled_output:
            return "decode"
        return "prefill" if self.pages or self.num_computed else "queued"

    @property
    def num_scheduled_output(self) -> int:
        return self.num_tokens - self.num_prompt

    @property
    def num_pending(self) -> int:
        return self.num_tokens - len(self.tokens)

    @property
    def output_ids(self) -> List[int]:
        return self.tokens[self.num_prompt :]

    def full_page_hashes(self, n_pages: int) -> List[int]:
        """Hashes of the first n_pages pages of the known tokens (computed once)."""
        if len(self.hashes) < n_pages:
            P = self.page_size
            parent = self.hashes[-1] if self.hashes else adapter_root(self.adapter)
            salts = self.images.page_salts(self.num_prompt, P)[len(self.hashes) :] if self.images else ()
            self.hashes += page_hashes(self.tokens[len(self.hashes) * P : n_pages * P], P, parent, salts)
        return self.hashes[:n_pages]
