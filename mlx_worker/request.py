"""Requests in and outputs out of the engine, and the per-request state it keeps."""

import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

import mlx.core as mx
from pydantic import BaseModel, Field

from .paging import page_hashes


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop (greedy for now)."""

    max_tokens: int = Field(16, ge=1)
    stop_token_ids: List[int] = Field(default_factory=list)
    ignore_eos: bool = False


class Request(BaseModel):
    rid: str
    prompt_ids: List[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)


@dataclass
class RequestOutput:
    rid: str
    token_ids: List[int]  # new tokens since the previous output
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error"
    error: Optional[str] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


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

    def __post_init__(self):
        self.num_tokens = len(self.tokens)

    @classmethod
    def from_request(cls, req: Request, page_size: int) -> "Sequence":
        return cls(req.rid, list(req.prompt_ids), req.params, len(req.prompt_ids), page_size)

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
            parent = self.hashes[-1] if self.hashes else None
            self.hashes += page_hashes(self.tokens[len(self.hashes) * P : n_pages * P], P, parent)
        return self.hashes[:n_pages]
