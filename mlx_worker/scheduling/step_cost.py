"""What a step costs on this model and machine, measured online.

A step's time is modelled as linear in six features of its plan: forwards (each reads
every weight once), decode rows, prefill tokens, attention pairs (query x key
positions: where long contexts cost), the tokens of speculative verify rows (a few
per row: they cost like neither a decode row nor a long chunk's token), and the image
tokens of the images the step's vision tower encodes (a vision model's: the tower runs
in the step of a prompt's first image chunk). The coefficients are a least-squares fit over the
recent steps (exponentially forgotten, so they follow a machine that slows down or a
model warming up), never negative. Until a few steps are measured there is no
prediction, and the scheduler falls back to its token budget.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

FORGET = 0.98  # per observed step: about the last 50 steps carry the fit
MIN_STEPS = 4  # observed steps before the fit is trusted
PAIRS_UNIT = 1024.0  # attention pairs per feature unit (keeps the features of one scale)


@dataclass
class StepShape:
    """The work of one step, as the cost model sees it."""

    forwards: int = 0
    decode_rows: int = 0
    prefill_tokens: int = 0
    pairs: float = 0.0  # attention query x key positions
    verify_tokens: int = 0
    image_tokens: int = 0  # of the images the vision tower encodes in the step

    def add_decode(self, rows: int, context: int) -> None:
        """`rows` decode rows attending to `context` key positions in all."""
        if rows and not self.decode_rows:
            self.forwards += 1
        self.decode_rows += rows
        self.pairs += context

    def add_prefill(self, start: int, length: int, new_forward: bool = True) -> None:
        self.forwards += new_forward
        self.prefill_tokens += length
        self.pairs += prefill_pairs(start, length)

    def add_verify(self, start: int, length: int, new_forward: bool = True) -> None:
        """A verify row: a few queries read the keys once, like a decode row's one."""
        self.forwards += new_forward
        self.verify_tokens += length
        self.pairs += start + length

    def add_verify_rows(self, rows: Sequence[tuple]) -> None:
        """Verify rows as (start, length), one forward per distinct length."""
        lengths = set()
        for start, length in rows:
            self.add_verify(start, length, new_forward=length not in lengths)
            lengths.add(length)

    def features(self) -> np.ndarray:
        return np.array([self.forwards, self.decode_rows, self.prefill_tokens, self.pairs / PAIRS_UNIT,
                         self.verify_tokens, self.image_tokens])


def prefill_pairs(start: int, length: int) -> float:
    """Query x key positions of a chunk of `length` tokens after `start` cached ones."""
    return length * start + length * (length + 1) / 2


class StepCost:
    """Online fit of step time (seconds) on StepShape features."""

    def __init__(self, forget: float = FORGET):
        self.forget = forget
        self._xtx = np.zeros((6, 6))
        self._xty = np.zeros(6)
        self.num_observed = 0
        self.coef: Optional[np.ndarray] = None  # seconds per forward, row, token, PAIRS_UNIT pairs, verify token, image token

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A measured step; the fit takes it in at the next `refit`."""
        x = shape.features()
        if not x.any():
            return
        self._xtx = self.forget * self._xtx + np.outer(x, x)
        self._xty = self.forget * self._xty + seconds * x
        self.num_observed += 1

    def refit(self) -> None:
        """Update the coefficients from the steps observed so far. The engine calls it at
        one point of its loop, before scheduling: a sharded engine's leader sends the
        coefficients to the other ranks there, so all size the step alike."""
        if self.num_observed >= MIN_STEPS:
            self.coef = _nonnegative_solve(self._xtx, self._xty)

    def predict(self, shape: StepShape) -> Optional[float]:
        """Seconds the step would take; None until the fit is trusted."""
        return None if self.coef is None else float(shape.features() @ self.coef)

    def prefill_room(self, shape: StepShape, start: int, seconds: float, new_forward: bool) -> int:
        """The longest chunk after `start` cached tokens that adds at most `seconds` to
        `shape`'s step (0 when even one token would not fit)."""
        c_fwd, _, c_tok, c_pair = self.coef[:4]
        room = seconds - (c_fwd if new_forward else 0.0)
        if room <= 0:
            return 0
        # c_tok L + c_pair (L start + L (L + 1) / 2) / PAIRS_UNIT <= room
        a = c_pair / (2 * PAIRS_UNIT)
        b = c_tok + c_pair * (start + 0.5) / PAIRS_UNIT
        if a <= 0:
            return int(room / b) if b > 0 else 1 << 30
        return int((-b + (b * b + 4 * a * room) ** 0.5) / (2 * a))

    def describe(self) -> dict:
        if self.coef is None:
            return {}
        names = ("forward_ms", "decode_row_ms", "prefill_token_ms", "attention_ms_per_mpair", "verify_token_ms",
                 "image_token_ms")
        scale = (1e3, 1e3, 1e3, 1e3 * 1e6 / PAIRS_UNIT, 1e3, 1e3)
        return {k: float(c * s) for k, c, s in zip(names, self.coef, scale)}


def _nonnegative_solve(xtx: np.ndarray, xty: np.ndarray) -> np.ndarray:
    """Least squares from the normal equations with every coefficient >= 0: features
    whose coefficient comes out negative are dropped and the rest refitted (the features
    are few and positive, so this active-set pass settles in a few rounds)."""
    active: List[int] = list(range(len(xty)))
    coef = np.zeros(len(xty))
    ridge = 1e-9 * (np.trace(xtx) + 1.0)
    while active:
        sub = xtx[np.ix_(active, active)] + ridge * np.eye(len(active))
        sol = np.linalg.solve(sub, xty[active])
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [i for i, c in zip(active, sol) if c >= 0] if (sol >= 0).any() else []
    return coef


def shape_of(decode_positions: Sequence[int], chunks: Sequence[tuple], verify: Sequence[tuple] = (),
             image_tokens: int = 0) -> StepShape:
    """The StepShape of a plan: decode rows at `decode_positions`, prefill `chunks` and
    `verify` rows as (start, length), one forward per distinct length of each (as the
    worker runs them), and the image tokens its vision tower encodes."""
    shape = StepShape(image_tokens=image_tokens)
    shape.add_decode(len(decode_positions), sum(p + 1 for p in decode_positions))
    lengths = set()
    for start, length in chunks:
        shape.add_prefill(start, length, new_forward=length not in lengths)
        lengths.add(length)
    shape.add_verify_rows(verify)
    return shape
