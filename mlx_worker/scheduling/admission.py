"""Admission that keeps its promises: a request is taken only if it can finish in time.

A request's completion is predicted from what the engine measures under its current
load: the prompt tokens queued ahead of it and its own, at the prefill rate of recent
steps that prefilled beside decode rows (while a queue drains, steps carry both, so the
decode rows' share is in that rate; a step that only prefills runs at a rate no waiting
request can count on); a running slot, when all are taken, freed as the running
requests finish; and its output, as long as recent requests' outputs were (capped by
its max_tokens), one token per step at the recent time of steps with decode rows.

That model is then calibrated by what it got wrong: each admitted request's completion
is divided by the prediction it was admitted on, and the prediction is scaled by the
CALIBRATION_QUANTILE of those recent ratios. Whatever the model misses (the steps
that later admissions' prompts add to a request's decode, another process on the
cores), the scale learns. A request whose prediction passes SAFETY x its timeout (the
client's, or `request_timeout_s`) is refused at once with `overloaded` and a
`retry_after_s`: the excess, about when the work ahead will have drained enough.

A promise to one request is not broken for the next: each admitted request's
prediction is pushed back by the prefill of every request admitted after it (those
prompts' chunks ride in the steps that carry its tokens), and a request whose prefill
would push an admitted one past its own deadline is refused, however well it would
itself fit. The calibration is measured against the pushed predictions.

A prediction can still go wrong after the fact (a burst of long prompts ahead of the
decode rows, steps kept decode-only for requests at risk). A request taken but not yet
started that, predicted as at admission, would now end past when it is due (its
client's whole timeout, not only SAFETY of it, less the answer's way back) is withdrawn:
refused with `overloaded` and a Retry-After, as it would have been on arrival, before
any work is spent on it, instead of being computed for a client that has given up
(`withdraw`).

A request with nothing queued or running ahead of it is always taken: no wait would
make it faster. Until steps are measured, others are taken only while the prompts
queued, with theirs, fit one step's token budget (a burst of short requests on a fresh
server; the first steps are measured within seconds), and until MIN_CALIBRATION completions have been seen, the
model's predictions are doubled. Admitted requests are not starved by later ones: prompts
are prefilled in arrival order, and every step advances every decoding row.
"""

import time
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ..request import Request, RequestOutput, Sequence
from .scheduler import Scheduler

DECAY = 0.9  # per measured step: the estimates follow a change of load within ~10 steps
SAFETY = 0.8  # admit when the prediction is within this share of the timeout
OUTPUT_QUANTILE = 0.8  # of recent outputs (capped by the request's max_tokens)
MIN_OUTPUTS = 8  # recent outputs needed before they predict; until then max_tokens does
CALIBRATION_QUANTILE = 0.9  # of recent completion / model prediction ratios
MIN_CALIBRATION = 8  # completions needed before they scale predictions
CALIBRATION_RANGE = (0.25, 4.0)  # a scale outside it says the model is broken, not slightly off
PRIOR_CALIBRATION = 2.0  # until then: the model misses what later admissions add (seen here: p90 ~1.8x)
MIN_PREDICTED_STEPS = 4  # a prediction shorter than this many steps is judged as this long: overheads dominate it


@dataclass
class Promise:
    """What admission predicted for a request it took."""

    since: float  # perf_counter at admission
    model_s: float  # the model's prediction, pushed back by the prefill admitted after it
    calibration: float  # the scale in force when it was admitted
    timeout_s: float

    @property
    def deadline(self) -> float:
        return self.since + SAFETY * self.timeout_s

    def ends(self, scale: float, push: float = 0.0) -> float:
        return self.since + scale * (self.model_s + push)


class Admission:
    def __init__(self, request_timeout_s: Optional[float] = None):
        self.request_timeout_s = request_timeout_s
        self._mixed = [0.0, 0.0]  # decayed steps with prefill beside decode rows: seconds, prompt tokens
        self._alone = [0.0, 0.0]  # the same of steps that only prefill: until a mixed one is seen
        self._gap_s: Optional[float] = None  # decayed time of steps with decode rows
        self._outputs: deque = deque(maxlen=256)  # recent requests' output lengths; None: cut by max_tokens
        self._admitted: Dict[str, Promise] = {}  # what was promised to each admitted, unfinished request
        self._errors: deque = deque(maxlen=64)  # recent completions / the model's predictions
        self.accuracy: deque = deque(maxlen=256)  # recent completions / the (calibrated) predictions acted on
        self.num_refused = 0  # by the engine loop
        self.num_refused_early = 0  # in callers' threads (refuse_early)
        self.num_withdrawn = 0  # taken, then refused before any work (withdraw)

    # --- what the engine measures ------------------------------------------------------
    def observe(self, seconds: float, prefill_tokens: int, decode_rows: int) -> None:
        """A finished step that took `seconds`."""
        if prefill_tokens:
            rate = self._mixed if decode_rows else self._alone
            rate[0], rate[1] = DECAY * rate[0] + seconds, DECAY * rate[1] + prefill_tokens
        if decode_rows:
            self._gap_s = seconds if self._gap_s is None else DECAY * self._gap_s + (1 - DECAY) * seconds

    def finished(self, out: RequestOutput) -> None:
        """A request ended: a normal end teaches the predictor its output length, and
        how its completion compared with the prediction it was admitted on."""
        admitted = self._admitted.pop(out.rid, None)
        if out.finish_reason not in ("stop", "length"):
            return
        if not out.num_output_tokens:  # an embedding, or the prompt's logprobs only
            return
        self._outputs.append(None if out.finish_reason == "length" else out.num_output_tokens)
        if admitted is not None:
            took = time.perf_counter() - admitted.since
            self._errors.append(took / admitted.model_s)
            self.accuracy.append(took / (admitted.model_s * admitted.calibration))

    @property
    def calibration(self) -> float:
        """The scale of the model's predictions: what recent completions took of them."""
        if len(self._errors) < MIN_CALIBRATION:
            return PRIOR_CALIBRATION
        return float(np.clip(np.quantile(self._errors, CALIBRATION_QUANTILE), *CALIBRATION_RANGE))

    @property
    def seconds_per_token(self) -> Optional[float]:
        seconds, tokens = self._mixed if self._mixed[1] else self._alone
        return seconds / tokens if tokens else None

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
        """The model's seconds until `seq` would finish if admitted now (uncalibrated);
        None: not yet measured."""
        if self._gap_s is None:
            return None
        return self._estimate(scheduler.queued_prefill_tokens() + scheduler.uncached_tokens(seq),
                              self._slot_wait(scheduler, self._gap_s), seq.params.max_tokens)

    def _estimate(self, prefill_tokens: int, slot_wait: float, max_tokens: int) -> Optional[float]:
        per_token, gap = self.seconds_per_token, self._gap_s
        if per_token is None or gap is None:
            return None
        return max(prefill_tokens * per_token, slot_wait) + self.output_tokens(max_tokens) * gap

    def timeout_of(self, request) -> Optional[float]:
        """A Request's or Sequence's timeout: its client's, else the server's default."""
        return request.timeout_s or self.request_timeout_s

    def refuse_early(self, request: Request, stats: dict) -> Optional[RequestOutput]:
        """A refusal decided in the caller's thread, before the request reaches the engine
        loop (which takes it only between steps): when, as of the last step (`stats`),
        requests are ahead of it and even a lower bound of its completion (the prompts
        queued, none of its own) is past its timeout. None: the engine decides."""
        timeout = self.timeout_of(request)
        if timeout is None or not (stats["running"] or stats["waiting"]):
            return None
        predicted = self._estimate(stats["queued_prefill_tokens"], 0.0, request.params.max_tokens)
        if predicted is None or predicted * self.calibration <= SAFETY * timeout:
            return None
        predicted *= self.calibration
        self.num_refused_early += 1
        return RequestOutput(rid=request.rid, token_ids=[], finished=True, finish_reason="error",
                             error=self._refusal_message(predicted, timeout), error_code="overloaded",
                             num_prompt_tokens=len(request.prompt_ids), retry_after_s=predicted - SAFETY * timeout)

    @staticmethod
    def _refusal_message(predicted: float, timeout: float) -> str:
        return (f"the server is overloaded: this request would finish in about {predicted:.0f} s, past "
                f"{SAFETY * timeout:.0f} s ({SAFETY:g} of its {timeout:g} s timeout); retry later")

    def _prefill_s(self, seq: Sequence, scheduler: Scheduler) -> float:
        """The model's seconds of `seq`'s own prefill: what it adds to the requests ahead."""
        return scheduler.uncached_tokens(seq) * (self.seconds_per_token or 0.0)

    def _broken_promise(self, seq: Sequence, scheduler: Scheduler) -> Optional[float]:
        """None when admitting `seq` keeps every promise made; else the seconds until the
        soonest of the requests it would push past their deadlines is predicted to end."""
        now, push, scale = time.perf_counter(), self._prefill_s(seq, scheduler), self.calibration
        broken = [p.ends(scale) - now for p in self._admitted.values() if p.ends(scale, push) > p.deadline > now]
        return max(1.0, min(broken)) if broken else None

    def _promise(self, seq: Sequence, scheduler: Scheduler, model: float, timeout: float) -> None:
        now, push = time.perf_counter(), self._prefill_s(seq, scheduler)
        for rid in [rid for rid, p in self._admitted.items() if p.since + p.timeout_s < now]:
            del self._admitted[rid]  # past its client's timeout: gone, or it ends without this promise
        for p in self._admitted.values():
            p.model_s += push
        least = MIN_PREDICTED_STEPS * self._gap_s + 1e-6
        self._admitted[seq.rid] = Promise(now, max(model, least), self.calibration, timeout)

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
        timeout = self.timeout_of(seq)
        if timeout is None:
            return None
        model = self.predict(seq, scheduler)
        predicted = None if model is None else model * self.calibration
        allowed = SAFETY * timeout
        if predicted is None:  # not measured yet: take what the first steps hold, as a burst of short prompts
            ahead = scheduler.queued_prefill_tokens() + scheduler.uncached_tokens(seq)
            if (ahead <= scheduler.budget.max_batched_tokens
                    and len(scheduler.running) + len(scheduler.waiting) < scheduler.max_running):
                return None
        alone = not (scheduler.waiting or scheduler.running)
        if alone or (predicted is not None and predicted <= allowed):
            broken = None if alone or predicted is None else self._broken_promise(seq, scheduler)
            if broken is None:
                if predicted is not None:  # to measure the prediction against the completion
                    self._promise(seq, scheduler, model, timeout)
                return None
            return self._refusal(seq, scheduler, "the server is overloaded: taking this request would delay "
                                 "requests it already took past their clients' timeouts; retry later", broken)
        if predicted is None:  # not measured yet: nothing ahead of it, or not taken
            message = "the server is overloaded: it has work ahead and has not measured its speed yet; retry later"
            retry = 2.0
        else:
            message, retry = self._refusal_message(predicted, timeout), predicted - allowed
        return self._refusal(seq, scheduler, message, retry)

    def withdraw(self, scheduler: Scheduler) -> List[RequestOutput]:
        """Refusals of the waiting requests, not started yet, that would now end past when
        they are due (the client's whole timeout, less the answer's way back), in queue
        order: each is predicted behind the prefill queued ahead of it."""
        if self.seconds_per_token is None or self._gap_s is None:
            return []
        now, scale, per_token = time.perf_counter(), self.calibration, self.seconds_per_token
        ahead = sum(s.num_tokens - s.num_computed for s in scheduler.running if s.next_input is None)
        late = []
        for i, seq in enumerate(scheduler.waiting):
            ahead += scheduler.uncached_tokens(seq)
            if seq.deadline is None or seq.pages or seq.num_preemptions:
                continue  # started once: its work is done already
            if i == 0 and not scheduler.running:
                continue  # nothing ahead of it: taken as admission takes it, no wait would make it faster
            ends = now + scale * (ahead * per_token + self.output_tokens(seq.params.max_tokens) * self._gap_s)
            if ends > seq.due:
                late.append((seq, ends))
        outputs = []
        for seq, ends in late:
            self._admitted.pop(seq.rid, None)
            timeout = self.timeout_of(seq)  # what its deadline was set from
            message = (f"the server is overloaded: this request, taken {now - (seq.deadline - timeout):.0f} s ago, "
                       f"would now finish past its {timeout:g} s timeout; retry later")
            self.num_withdrawn += 1
            out = scheduler.withdraw(seq, message, "overloaded")
            out.retry_after_s = max(1.0, ends - now - SAFETY * timeout)
            outputs.append(out)
        return outputs

    def _refusal(self, seq: Sequence, scheduler: Scheduler, message: str, retry_after_s: float) -> RequestOutput:
        self.num_refused += 1
        out = scheduler.refusal(seq, message, "overloaded")
        out.retry_after_s = retry_after_s
        return out
