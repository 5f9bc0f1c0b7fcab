"""How many tokens each row drafts this step: what verification costs against what it saves.

A verify row feeding 1 + k tokens emits 1 + a of them, a the drafts accepted; with a
per-token acceptance rate alpha it emits E(k) = 1 + alpha + ... + alpha^k on average.
The verify rows of a step share one forward of one length (a row with fewer drafts is
padded with filler drafts, verified like any), beside the decode forward of the other
rows; the step cost model (step_cost.py) measures what a verify token costs (until it
has, a prefill token's cost is assumed, so that verification gets tried and measured).
A forward reads every weight once, so on a Mac, and even on this CPU, a few more tokens
per row cost little beside it; at large batches on a CPU each costs nearly a decode row.

Each step, for each k up to the configured most, the plans are: the m rows of best
expected gain verify (for each m) and the rest decode, or every row that may verify does
(rows without a draft too: one forward instead of two). The plan of most tokens per
second wins; none at all unless it beats the plain decode step by MARGIN (speculation
also gives up building the next step ahead).

alpha is measured per row (an average over its recent drafts, starting at the method's
rate over all rows), so a row whose drafts keep failing stops drafting.
"""

from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..scheduling.step_cost import PAIRS_UNIT

MARGIN = 1.05  # speculation must promise this much more than a decode step
ROW_MEMORY = 0.7  # per verify: weight of a row's earlier acceptance
PRIOR_MEMORY = 0.98  # per verify: weight of the method's rate over all rows
START_ACCEPTANCE = 0.5  # the method's rate before anything was verified


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify row of k drafts emits on average: 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class DraftBudget:
    def __init__(self, max_k: int, adaptive: bool = True):
        self.max_k, self.adaptive = max_k, adaptive
        self.prior = START_ACCEPTANCE

    def acceptance(self, seq) -> float:
        return self.prior if seq.draft_acceptance is None else seq.draft_acceptance

    def observe(self, seq, drafted: int, accepted: int) -> None:
        """A verify's outcome: `accepted` of `drafted` tokens (a token is tried only when
        the ones before it were accepted)."""
        rate = accepted / (accepted + (accepted < drafted))
        seq.draft_acceptance = ROW_MEMORY * self.acceptance(seq) + (1 - ROW_MEMORY) * rate
        self.prior = PRIOR_MEMORY * self.prior + (1 - PRIOR_MEMORY) * rate

    def choose(self, rows: Sequence[Tuple[object, int, List[int]]], foldable: Sequence[int],
               fixed: Sequence[int], coef: Optional[np.ndarray]) -> Tuple[int, List[int], bool]:
        """The step's verify plan: (k, drafts each of `rows` verifies, fold). `rows`: (seq,
        position, proposed drafts); `foldable`: positions of rows that may verify without
        a draft (fold: they do, with fillers); `fixed`: positions of rows that decode.
        k = 0: no verify forward. `coef`: the step cost fit (None: unknown)."""
        if not self.adaptive:
            counts = [min(self.max_k, len(d)) for _, _, d in rows]
            return max(counts, default=0), counts, False
        none = (0, [0] * len(rows), False)
        if coef is None or not rows:
            return none
        c_fwd, c_row, c_tok, c_pair, c_verify = coef[:5]
        # Not measured yet: a prefill token's, so that verification is tried and measured
        # (realized_rate.py turns it off where the clock disagrees); rows without drafts
        # join the verify forward only once its cost is known.
        measured, c_verify = c_verify > 0, c_verify or c_tok or c_row

        def rate(tokens, decoding, decode_pairs, verifying, verify_pairs, length):
            t = (c_fwd * ((decoding > 0) + (verifying > 0)) + c_row * decoding + c_verify * length * verifying
                 + c_pair * (decode_pairs + verify_pairs) / PAIRS_UNIT)
            return tokens / t if t > 0 else 0.0

        positions = [p for _, p, _ in rows] + list(foldable) + list(fixed)
        all_pairs = sum(p + 1 for p in positions)
        best, best_rate = none, MARGIN * rate(len(positions), len(positions), all_pairs, 0, 0, 0)
        for k in range(1, self.max_k + 1):
            gains = [expected_tokens(self.acceptance(seq), min(k, len(d))) - 1 for seq, _, d in rows]
            order = sorted(range(len(rows)), key=lambda i: -gains[i])
            tokens, decoding, decode_pairs, verify_pairs = float(len(positions)), len(positions), all_pairs, 0.0
            chosen = [0] * len(rows)
            for i in order:
                p = rows[i][1]
                tokens += gains[i]
                decoding, decode_pairs = decoding - 1, decode_pairs - p - 1
                verify_pairs += p + k + 1
                chosen[i] = min(k, len(rows[i][2]))
                r = rate(tokens, decoding, decode_pairs, len(positions) - decoding, verify_pairs, k + 1)
                if r > best_rate:
                    best, best_rate = (k, list(chosen), False), r
            if foldable and measured:  # every row that may verify does: the decode forward holds only `fixed` ones
                fold_pairs = verify_pairs + sum(p + k + 1 for p in foldable)
                r = rate(tokens, len(fixed), sum(p + 1 for p in fixed), len(positions) - len(fixed), fold_pairs, k + 1)
                if r > best_rate:
                    best, best_rate = (k, list(chosen), True), r
        return best
