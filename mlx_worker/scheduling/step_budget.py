"""A step's room in time, not only in tokens (Sarathi-Serve's stall-free batching).

While requests decode, every step is a gap between their tokens: a step that prefills a
long chunk freezes every stream for as long as it runs. So a step that carries decode
rows gets prefill only as far as the measured step cost (step_cost.py) keeps it within
the target token gap: `max_token_gap_s`, or by default TOKEN_GAP_FACTOR times the
predicted decode-only step of the same rows. `min_prefill_tokens` is a floor, so
prefill always moves, and a step's fixed cost (every forward reads every weight; on a
CPU that is tens of ms) stays small beside its work. A step without decode rows has the token budget alone
(`max_batched_tokens`); until costs are measured, steps prefill `min_prefill_tokens`
at most, so that they are measured within the first second or so.
"""

import time
from typing import Iterable, Optional, Sequence, Tuple

from .step_cost import StepCost, StepShape

TOKEN_GAP_FACTOR = 3.0
URGENCY_MARGIN = 1.5  # a request is at risk when steps with prefill would bring its end this close to its deadline


class StepRoom:
    """What one step may still take: tokens, and (when a gap is set) seconds."""

    def __init__(self, tokens: int, cost: StepCost, shape: StepShape, gap_s: Optional[float], min_prefill: int):
        self.tokens = tokens
        self.cost, self.shape, self.gap_s = cost, shape, gap_s
        self.min_prefill = min_prefill
        self._lengths = set()  # chunk lengths already in the step: one forward each

    def prefill(self, start: int, wanted: int, image_tokens: int = 0) -> int:
        """How many tokens of a prompt at `start` this step may prefill (<= wanted), its
        vision tower encoding `image_tokens` of its images too."""
        n = min(wanted, self.tokens)
        if self.gap_s is None or n <= 0:
            return max(0, n)
        floor = self.min_prefill - self.shape.prefill_tokens  # the floor is per step
        spare = self.gap_s - self.cost.predict(self.shape) - self.cost.coef[5] * image_tokens
        fits = self.cost.prefill_room(self.shape, start, spare, new_forward=n not in self._lengths)
        return max(0, min(n, max(fits, floor)))

    def tower_fits(self, image_tokens: int) -> bool:
        """Whether the step may also run a prompt's images through the vision tower: the
        first prompt's always (images move on), another's only within the gap."""
        if self.gap_s is None or not self.shape.image_tokens:
            return True
        return self.cost.predict(self.shape) + self.cost.coef[5] * image_tokens <= self.gap_s

    def take(self, start: int, length: int, image_tokens: int = 0) -> None:
        self.tokens -= length
        self.shape.add_prefill(start, length, new_forward=length not in self._lengths)
        self.shape.image_tokens += image_tokens
        self._lengths.add(length)


class StepBudget:
    """Makes each step's StepRoom from the cost model and the configured gap."""

    def __init__(self, max_batched_tokens: int, max_token_gap_s: Optional[float] = None,
                 min_prefill_tokens: int = 256, cost: Optional[StepCost] = None, timed: bool = True):
        self.max_batched_tokens = max_batched_tokens
        self.timed = timed  # False: tokens only (the step cost is still measured, for admission's stats)
        self.max_token_gap_s = max_token_gap_s
        self.min_prefill_tokens = min_prefill_tokens
        self.cost = cost or StepCost()
        self.last_gap_s: Optional[float] = None  # the target of the last step with decode rows
        self.urgent = False  # a decoding request would miss its deadline at the pace of steps with prefill
        self.num_urgent_steps = 0

    def room(self, decode_rows: int, decode_context: int, verify: Sequence[Tuple[int, int]] = ()) -> StepRoom:
        """`verify`: (position, length) of the step's verify rows (speculative/): they
        count as decode rows for the gap, and their cost is taken from the room."""
        shape = StepShape()
        shape.add_decode(decode_rows, decode_context)
        shape.add_verify_rows(verify)
        gap, tokens = None, self.max_batched_tokens - decode_rows - sum(length for _, length in verify)
        decode_rows += len(verify)
        if self.urgent and decode_rows:  # decode only, until the requests at risk are done
            self.num_urgent_steps += 1
            return StepRoom(0, self.cost, shape, None, self.min_prefill_tokens)
        if self.timed and self.cost.coef is None:  # small steps until costs are measured: soon, and never long
            tokens = min(tokens, self.min_prefill_tokens)
        elif decode_rows and self.timed:
            gap = self.last_gap_s = self.max_token_gap_s or TOKEN_GAP_FACTOR * self.cost.predict(shape)
        return StepRoom(tokens, self.cost, shape, gap, self.min_prefill_tokens)

    def at_risk(self, decoding: Iterable, now: Optional[float] = None) -> bool:
        """Whether a decoding request (`decoding`: Sequences with a deadline, or None) would
        miss its deadline at the pace of steps that carry prefill, but not at the pace of
        decode-only steps: then steps carry no prefill until it is done, so an admitted
        request is never made late by the prompts admitted after it. One it would miss
        anyway holds nothing up."""
        rows = [s for s in decoding if s.deadline is not None]
        if not self.timed or self.cost.coef is None or not rows:
            return False
        now = time.perf_counter() if now is None else now
        shape = StepShape()
        shape.add_decode(len(rows), sum(s.num_computed for s in rows))
        decode_s = self.cost.predict(shape)
        shape.add_prefill(0, self.min_prefill_tokens)
        mixed_s = max(self.cost.predict(shape), self.max_token_gap_s or TOKEN_GAP_FACTOR * decode_s)
        for s in rows:
            left = max(0, s.params.max_tokens - s.num_scheduled_output)
            if left * decode_s <= s.due - now < URGENCY_MARGIN * left * mixed_s:
                return True
        return False
