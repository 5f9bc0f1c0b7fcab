"""Admission by queued work: a request that would wait too long to start is refused.

The engine measures what prefill costs per token under the current load (decode rows
share those steps, so their cost is in it) and the scheduler knows the prompt tokens
still to prefill. A request that would wait longer than `max_queue_wait_s` behind those
before its own prompt is processed is refused with `overloaded` and how long to wait
before retrying, instead of queued. Its own prompt does not count: a long prompt alone
is always taken. Until a step with prefill has been measured, everything is admitted.

It bounds the wait for prompt processing only: a queue held up by long generations
(every batch slot busy) is not foreseen.
"""

from typing import Optional

from .request import RequestOutput, Sequence
from .scheduler import Scheduler

DECAY = 0.9  # per measured step: the estimate follows a change of load within ~10 steps


class Admission:
    def __init__(self, max_queue_wait_s: Optional[float]):
        self.max_queue_wait_s = max_queue_wait_s
        self._seconds = self._tokens = 0.0
        self.num_refused = 0

    def observe(self, seconds: float, prefill_tokens: int) -> None:
        """A finished step that took `seconds` and prefilled `prefill_tokens`."""
        if prefill_tokens:
            self._seconds = DECAY * self._seconds + seconds
            self._tokens = DECAY * self._tokens + prefill_tokens

    @property
    def seconds_per_token(self) -> Optional[float]:
        return self._seconds / self._tokens if self._tokens else None

    def wait_s(self, tokens: int) -> Optional[float]:
        """How long prefilling `tokens` would take at the measured rate (None: not measured)."""
        per_token = self.seconds_per_token
        return None if per_token is None else tokens * per_token

    def refuse(self, seq: Sequence, scheduler: Scheduler) -> Optional[RequestOutput]:
        """The refusal of `seq` when the scheduler's queued prefill would hold it back
        more than max_queue_wait_s; None: admit it."""
        if self.max_queue_wait_s is None or self.seconds_per_token is None:
            return None
        queued = scheduler.queued_prefill_tokens()
        wait = self.wait_s(queued)
        if wait <= self.max_queue_wait_s:
            return None
        self.num_refused += 1
        out = scheduler.refusal(seq, f"the server is overloaded: this request would wait about {wait:.0f} s behind "
                                     f"{queued} queued prompt tokens (the limit is {self.max_queue_wait_s:g} s); "
                                     "retry later", "overloaded")
        out.retry_after_s = wait - self.max_queue_wait_s
        return out
