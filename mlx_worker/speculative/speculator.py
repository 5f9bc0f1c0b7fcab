"""The scheduler's side of speculative decoding: which decoding rows draft, how many
tokens, and what came of it.

A row drafts only when all its tokens are known: its previous step must have finished,
so the engine gives up building that step ahead (`wants_sync`). While no row drafts,
steps overlap again and every PROBE_STEPS-th step looks for drafts once more; where the
budget keeps refusing the drafts found (a large batch on a CPU), probes at that batch
size come at twice the interval each time, up to PROBE_STEPS << MAX_BACKOFF (a synced
step costs its overlap).

Rows decode normally where drafting cannot give the same tokens cheaply: penalties
(each token's penalty depends on the ones before it), grammars (the mask needs each
token before the next) or a last token to go. On a model with recurrent layers a row
whose drafts were rejected computes its accepted tokens again from its state before
the verify (scheduler._accept): a rejection costs such a model a second forward.
"""

from typing import List, Optional, Sequence, Tuple

from .config import SpeculativeConfig
from .draft_budget import DraftBudget
from .drafters import make_drafter
from .realized_rate import RealizedRate, batch_bucket

PROBE_STEPS = 8
MAX_BACKOFF = 2


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter=None):
        self.config = config
        self.drafter = drafter or make_drafter(config.method)
        self.budget = DraftBudget(config.num_draft_tokens, config.adaptive)
        self.steps_without = PROBE_STEPS  # schedules since the last one that drafted
        self.refused = {}  # batch bucket -> probes in a row whose drafts the budget refused
        self.drafted = self.accepted = self.verifies = self.emitted = 0
        self.realized = RealizedRate()
        self._emitted_seen = 0
        self.log = None  # a list: each verify's (tokens before it, drafts), for checking drafters

    @staticmethod
    def eligible(seq) -> bool:
        p = seq.params
        return (seq.matcher is None and not seq.num_pending and p.repetition_penalty == 1.0
                and not p.presence_penalty and not p.frequency_penalty
                and p.max_tokens - seq.num_scheduled_output >= 2)

    def wants_sync(self, rows: int) -> bool:
        """Whether the next schedule of `rows` decoding rows should see every token first
        (to draft from it): every step while rows drafted lately, then every PROBE_STEPS-th."""
        recent = self.steps_without < PROBE_STEPS
        interval = PROBE_STEPS << min(self.refused.get(batch_bucket(rows), 0), MAX_BACKOFF)
        return (recent or self.steps_without % interval == 0) and self.allows(rows)

    def allows(self, rows: int) -> bool:
        return not self.config.adaptive or self.realized.allows(rows)

    def plan(self, rows: Sequence[Tuple[object, int]], coef) -> List[Tuple[List[int], int]]:
        """For each decoding row (seq, position) this step: (drafts to verify, how many of
        them were proposed; the rest are fillers to the step's verify length). ([], 0):
        decode normally."""
        k = self.config.num_draft_tokens
        allowed = self.allows(len(rows))
        self.realized.tried(len(rows), allowed)
        if not allowed:
            self.steps_without += 1
            return [([], 0)] * len(rows)
        room = [s.params.max_tokens - s.num_scheduled_output - 1 for s, _ in rows]
        eligible = [self.eligible(s) for s, _ in rows]
        proposed = [self.drafter.propose(s, min(k, r)) if ok else [] for (s, _), r, ok in zip(rows, room, eligible)]
        candidates = [i for i, d in enumerate(proposed) if d]
        foldable = [i for i, d in enumerate(proposed) if eligible[i] and not d]
        fixed = [p for (_, p), ok in zip(rows, eligible) if not ok]
        k, counts, fold = self.budget.choose([(*rows[i], proposed[i]) for i in candidates],
                                             [rows[i][1] for i in foldable], fixed, coef)
        drafts: List[Tuple[List[int], int]] = [([], 0)] * len(rows)
        real = dict(zip(candidates, counts))
        for i in candidates + (foldable if fold else []):
            n = real.get(i, 0)
            if (n or fold) and room[i] >= k:
                own = proposed[i][:n]
                drafts[i] = (own + [own[-1] if own else rows[i][0].tokens[-1]] * (k - n), n)
        self.steps_without = 0 if k else self.steps_without + 1
        if candidates:
            b = batch_bucket(len(rows))
            self.refused[b] = 0 if k else self.refused.get(b, 0) + 1
        return drafts

    def observe(self, seq, drafted: int, accepted: int, emitted: int) -> None:
        if drafted:
            self.budget.observe(seq, drafted, accepted)
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted

    def step_done(self, plan, seconds: float, measure: bool = True) -> None:
        """A finished step's time (after its tokens were processed): decode steps feed
        the realized rates (`measure`: on this rank's clock, the leader's). A step that
        replays rejected drafts (a recurrent model's) counts as verifying: it pays for them."""
        replays = [c for c in plan.prefills if c.replay]
        emitted = len(plan.decode) + sum(c.samples for c in replays) + self.emitted - self._emitted_seen
        self._emitted_seen = self.emitted
        if measure and len(replays) == len(plan.prefills):
            self.realized.observe(plan.decode_like() + len(replays), bool(plan.verify or replays), emitted, seconds)

    def finished(self, seq) -> None:
        self.drafter.finished(seq)

    def stats(self) -> dict:
        return {"method": self.config.method, "verify_rows": self.verifies, "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted, "acceptance_rate": self.accepted / max(1, self.drafted),
                "tokens_per_verify_row": self.emitted / max(1, self.verifies),
                "method_acceptance_estimate": self.budget.prior, "realized": self.realized.stats()}


def speculator_for(config: Optional[SpeculativeConfig], drafter=None) -> Optional[Speculator]:
    """The engine's speculator, or None when off."""
    return None if config is None else Speculator(config, drafter)
