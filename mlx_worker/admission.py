"""Admission that keeps its promises: a request is taken only if it can finish in time.

A request's completion is predicted from what the engine measures under its current
load: the prompt tokens queued ahead of it and its own, at the prefill rate of recent
steps that prefilled beside decode rows (while a queue drains, steps carry both: the
decode rows' share is in that rate; a step that only prefills runs at a rate no
waiting request can count on); a running slot, when all are taken, freed as the running
requests finish; and its output, as long as recent requests' outputs were (capped by
its max_tokens), one token per step at the recent time of such steps. A request whose prediction passes SAFETY x its timeout (the
client's, or `request_timeout_s`) is refused at once with `overloaded` and a
`retry_after_s`: the excess, about when the work ahead will have drained enough.

Until steps are measured, only one step's worth of prompt tokens is admitted ahead of
a request. A request with nothing queued or running ahead of it is always taken: no
wait would make it faster. Admitted requests are never starved by later ones: prompts
are prefilled in arrival order, and every step advances every decoding row.
"""

import time
from collections import deque
from typing import Dict, Optional, Tuple

import numpy as np

from .request import Request, RequestOutput, Sequence
from .scheduler import Scheduler

DECAY = 0.9  # per measured step: the estimates follow a change of load within ~10 steps
SAFETY = 0.8  # admit when the prediction is within this share of the timeout
OUTPUT_QUANTILE = 0.8  # of recent outputs (capped by the request's max_tokens)
MIN_OUTPUTS = 8  # recent outputs needed before they predict; until then max_tokens does


class Admission:
    def __init__(self, request_timeout_s: Optional[float] = None, max_batched_tokens: int = 2048):
        self.request_timeout_s = request_timeout_s
        self.max_batched_tokens = max_batched_tokens
        self._seconds = self._tokens = 0.0  # decayed steps with prefill and decode rows: their time and prompt tokens
        self._alone = [0.0, 0.0]  # the same of steps that only prefill: until a mixed step is seen
        self._gap_s: Optional[float] = None  # decayed time of steps with decode rows (with prefill, once seen)
        self._mixed_seen = False
        self._outputs: deque = deque(maxlen=256)  # recent requests' output lengths; None: cut by max_tokens
        self._admitted: Dict[str, Tuple[float, float]] = {}  # rid -> (when, predicted seconds)
        self.accuracy: deque = deque(maxlen=256)  # recent requests' actual / predicted completion time
        self.num_refused = 0  # by the engine loop
        self.num_refused_early = 0  # in callers' threads (refuse_early)

    # --- what the engine measures ------------------------------------------------------
    def observe(self, seconds: float, prefill_tokens: int, decode_rows: int) -> None:
        """A finished step that took `seconds`."""
        if prefill_tokens and decode_rows:
            self._seconds = DECAY * self._seconds + seconds
            self._tokens = DECAY * self._tokens + prefill_tokens
        elif prefill_tokens:
            self._alone = [DECAY * self._alone[0] + seconds, DECAY * self._alone[1] + prefill_tokens]
        mixed = bool(prefill_tokens and decode_rows)
        if decode_rows and (mixed or not self._mixed_seen):  # decode-only steps until a mixed one is seen
            if mixed and not self._mixed_seen:
                self._gap_s, self._mixed_seen = None, True
            self._gap_s = seconds if self._gap_s is None else DECAY * self._gap_s + (1 - DECAY) * seconds

    def finished(self, out: RequestOutput) -> None:
        """A request ended: a normal end teaches the predictor its output length, and
        how its completion compared with the prediction it was admitted on."""
        admitted = self._admitted.pop(out.rid, None)
        if out.finish_reason not in ("stop", "length"):
            return
        if out.num_output_tokens:
            self._outputs.append(None if out.finish_reason == "length" else out.num_output_tokens)
        if admitted is not None:
            self.accuracy.append((time.perf_counter() - admitted[0]) / admitted[1])

    @property
    def seconds_per_token(self) -> Optional[float]:
        if self._tokens:
            return self._seconds / self._tokens
        return self._alone[0] / self._alone[1] if self._alone[1] else None

    @property
    def gap_s(self) -> Optional[float]:
        return self._gap_s

    def wait_s(self, tokens: int) -> Optional[float]:
        """How long prefilling `tokens` would take at the measured rate (None: not measured)."""
        per_token = self.seconds_per_token
        return None if per_token is None else tokens * per_token

    def output_tokens(self, max_tokens: int) -> int:
        """Predicted output length of a request allowed `max_tokens`."""
        if len(self._outputs) < MIN_OUTPUTS:
            return max_tokens
        capped = [max_tokens if n is None else min(n, max_tokens) for n in self._outputs]
        return int(np.quantile(capped, OUTPUT_QUANTILE))

    # --- the decision ------------------------------------------------------------------
    def predict(self, seq: Sequence, scheduler: Scheduler) -> Optional[float]:
        """Seconds until `seq` would finish if admitted now; None: not yet measured."""
        if self._gap_s is None:
            return None
        return self._estimate(scheduler.queued_prefill_tokens() + scheduler.uncached_tokens(seq),
                              self._slot_wait(scheduler, self._gap_s), seq.params.max_tokens)

    def _estimate(self, prefill_tokens: int, slot_wait: float, max_tokens: int) -> Optional[float]:
        per_token, gap = self.seconds_per_token, self._gap_s
        if per_token is None or gap is None:
            return None
        return max(prefill_tokens * per_token, slot_wait) + self.output_tokens(max_tokens) * gap

    def refuse_early(self, request: Request, queued_tokens: int) -> Optional[RequestOutput]:
        """A refusal decided in the caller's thread, before the request reaches the engine
        loop (which takes it only between steps): when even a lower bound of its
        completion (the prompts queued as of the last step, none of its own) is past
        its timeout. None: the engine decides."""
        timeout = request.timeout_s or self.request_timeout_s
        predicted = self._estimate(queued_tokens, 0.0, request.params.max_tokens)
        if timeout is None or predicted is None or predicted <= SAFETY * timeout:
            return None
        self.num_refused_early += 1
        return RequestOutput(rid=request.rid, token_ids=[], finished=True, finish_reason="error",
                             error=self._refusal_message(predicted, timeout), error_code="overloaded",
                             num_prompt_tokens=len(request.prompt_ids), retry_after_s=predicted - SAFETY * timeout)

    @staticmethod
    def _refusal_message(predicted: float, timeout: float) -> str:
        return (f"the server is overloaded: this request would finish in about {predicted:.0f} s, past "
                f"{SAFETY * timeout:.0f} s ({SAFETY:g} of its {timeout:g} s timeout); retry later")

    def _slot_wait(self, scheduler: Scheduler, gap: float) -> float:
        """When a running slot frees for a request queued behind the waiting ones."""
        ahead = len(scheduler.running) + len(scheduler.waiting) - scheduler.max_running
        if ahead < 0:
            return 0.0
        left = sorted(max(0, self.output_tokens(s.params.max_tokens) - s.num_scheduled_output)
                      for s in scheduler.running)
        return (left[ahead] if ahead < len(left) else max(left, default=0) * (ahead + 1)) * gap

    def refuse(self, seq: Sequence, scheduler: Scheduler) -> Optional[RequestOutput]:
        """The refusal of `seq` when it could not finish within its timeout; None: admit it."""
        timeout = seq.timeout_s or self.request_timeout_s
        if timeout is None or not (scheduler.waiting or scheduler.running):
            return None
        predicted = self.predict(seq, scheduler)
        allowed = SAFETY * timeout
        if predicted is None:  # not measured yet: one step's worth of prompts ahead at most
            queued = scheduler.queued_prefill_tokens()
            if queued < self.max_batched_tokens:
                return None
            message = (f"the server is overloaded: {queued} prompt tokens are queued before it has measured its "
                       "speed; retry later")
            retry = 2.0
        elif predicted <= allowed:
            self._admitted[seq.rid] = (time.perf_counter(), max(predicted, 1e-6))
            return None
        else:
            message, retry = self._refusal_message(predicted, timeout), predicted - allowed
        self.num_refused += 1
        out = scheduler.refusal(seq, message, "overloaded")
        out.retry_after_s = retry
        return out
