"""The scheduler's side of speculative decoding: which decoding rows draft, how many
tokens, and what came of it.

A row drafts only when all its tokens are known: its previous step must have finished,
so the engine gives up building that step ahead (`wants_sync`). While no row drafts,
steps overlap again and every PROBE_STEPS-th step looks for drafts once more.

Rows decode normally where drafting cannot give the same tokens cheaply: penalties
(each token's penalty depends on the ones before it), grammars (the mask needs each
token before the next), a last token to go, or a model with recurrent layers (their
state cannot be rolled back to an accepted prefix yet).
"""

from typing import List, Optional, Sequence, Tuple

from .config import SpeculativeConfig
from .draft_budget import DraftBudget
from .drafters import make_drafter

PROBE_STEPS = 8


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter=None):
        self.config = config
        self.drafter = drafter or make_drafter(config.method)
        self.budget = DraftBudget(config.num_draft_tokens, config.adaptive)
        self.steps_without = PROBE_STEPS  # schedules since the last one that drafted
        self.drafted = self.accepted = self.verifies = self.emitted = 0

    @staticmethod
    def eligible(seq) -> bool:
        p = seq.params
        return (seq.matcher is None and not seq.num_pending and p.repetition_penalty == 1.0
                and not p.presence_penalty and not p.frequency_penalty
                and p.max_tokens - seq.num_scheduled_output >= 2)

    def wants_sync(self) -> bool:
        """Whether the next schedule should see every token first (to draft from it)."""
        return self.steps_without >= PROBE_STEPS

    def plan(self, rows: Sequence[Tuple[object, int]], coef) -> List[List[int]]:
        """Drafts for each decoding row (seq, position) this step ([]: decode normally)."""
        k = self.config.num_draft_tokens
        proposed = [(s, p, self.drafter.propose(s, min(k, s.params.max_tokens - s.num_scheduled_output - 1))
                     if self.eligible(s) else []) for s, p in rows]
        candidates = [i for i, (_, _, d) in enumerate(proposed) if d]
        others = [p for _, p, d in proposed if not d]
        counts = self.budget.choose([proposed[i] for i in candidates], others, coef)
        drafts: List[List[int]] = [[] for _ in rows]
        for i, n in zip(candidates, counts):
            drafts[i] = proposed[i][2][:n]
        self.steps_without = 0 if any(drafts) else self.steps_without + 1
        return drafts

    def observe(self, seq, drafted: int, accepted: int, emitted: int) -> None:
        self.budget.observe(seq, drafted, accepted)
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted

    def finished(self, seq) -> None:
        self.drafter.finished(seq)

    def stats(self) -> dict:
        return {"method": self.config.method, "verify_rows": self.verifies, "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted, "acceptance_rate": self.accepted / max(1, self.drafted),
                "tokens_per_verify_row": self.emitted / max(1, self.verifies),
                "method_acceptance_estimate": self.budget.prior}


def speculator_for(config: Optional[SpeculativeConfig], recurrent: bool, drafter=None) -> Optional[Speculator]:
    """The engine's speculator, or None: off, or a model whose recurrent state cannot be
    rolled back (its rows decode normally)."""
    if config is None or recurrent:
        return None
    return Speculator(config, drafter)
