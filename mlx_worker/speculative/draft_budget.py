"""How many tokens each row drafts this step: what verification costs against what it saves.

A verify row feeding 1 + k tokens emits 1 + a of them, a the drafts accepted; with a
per-token acceptance rate alpha it emits E(k) = 1 + alpha + ... + alpha^k on average.
Its cost is a prefill chunk's in the step cost model (step_cost.py), against a decode
row's: on a Mac a few more tokens per row cost little beside reading the weights; on a
CPU they cost nearly a token each at large batches. Each step, for each k up to the
configured most and each m, the m rows of best acceptance verify k drafts (fewer where
they have fewer); the plan of most tokens per second wins, and none at all when none
beats the plain decode step by MARGIN (speculation also gives up building the next
step ahead). Rows of one verify length share a forward, so each length adds one.

alpha is measured per row (an average over its recent drafts, starting at the method's
rate over all rows), so a row whose drafts keep failing stops drafting.
"""

from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..scheduling.step_cost import PAIRS_UNIT, prefill_pairs

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

    def choose(self, rows: Sequence[Tuple[object, int, List[int]]], decode_positions: Sequence[int],
               coef: Optional[np.ndarray]) -> List[int]:
        """Draft tokens for each of `rows` (seq, position, proposed drafts); the step also
        decodes rows at `decode_positions`. `coef`: the step cost fit (None: unknown)."""
        if not self.adaptive:
            return [min(self.max_k, len(d)) for _, _, d in rows]
        if coef is None or not rows:
            return [0] * len(rows)
        c_fwd, c_row, c_tok, c_pair = coef
        positions = [p for _, p, _ in rows] + list(decode_positions)
        base_time = c_fwd + c_row * len(positions) + c_pair * sum(p + 1 for p in positions) / PAIRS_UNIT
        base_rate = len(positions) / base_time if base_time > 0 else 0.0
        order = sorted(range(len(rows)), key=lambda i: -self.acceptance(rows[i][0]))
        best, best_rate = [0] * len(rows), MARGIN * base_rate
        for k in range(1, self.max_k + 1):
            # Rows verify in order of acceptance: the best first m of them, for any m (one
            # row alone may not pay for a forward of its own where all of them would).
            time, tokens, decoding = base_time - c_fwd, float(len(positions)), len(positions)
            lengths, chosen = set(), [0] * len(rows)
            for i in order:
                seq, p, drafts = rows[i]
                n = min(k, len(drafts))
                if n == 0:
                    continue
                time += (c_tok * (n + 1) - c_row + c_pair * (prefill_pairs(p, n + 1) - p - 1) / PAIRS_UNIT
                         + c_fwd * (n not in lengths))
                tokens += expected_tokens(self.acceptance(seq), n) - 1
                decoding -= 1
                lengths.add(n)
                chosen[i] = n
                rate = tokens / (time + c_fwd * (decoding > 0))
                if rate > best_rate:
                    best, best_rate = list(chosen), rate
        return best
