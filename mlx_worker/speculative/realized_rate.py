"""Whether speculation has paid off lately, measured: decode steps' tokens per second
with and without verify rows, per batch size.

The draft budget predicts from the step cost model; this checks the prediction against
the clock, since a linear fit over steady batches can be wrong about what a verify token
costs. While verifying steps at a batch size emit fewer tokens per second than plain
ones (by MARGIN), that batch size decodes plainly, trying verification again every EXPLORE_STEPS
steps so that a change (other requests, other acceptance) is seen.

Measured steps are taken in at one point of the engine loop (`refresh`), where a sharded
engine's leader sends the rates to the other ranks (`table`, `load`): every rank must
decide alike, and only the leader's clock counts.
"""

from typing import Dict, List, Optional

MEMORY = 0.8  # per step: weight of the earlier steps' rate
MARGIN = 1.03  # verifying steps must beat plain ones by this much (step times are noisy)
EXPLORE_STEPS = 100
MIN_STEPS = 8  # verifying steps measured at a batch size before they can turn it off


def batch_bucket(rows: int) -> int:
    """1, 2-3, 4-7, 8-15, ...: one bucket per doubling."""
    return rows.bit_length()


class RealizedRate:
    def __init__(self):
        self.rates: Dict[int, List[Optional[float]]] = {}  # bucket -> [plain, verifying] tokens/s
        self.since_try: Dict[int, int] = {}  # bucket -> steps since verification was last allowed
        self.verified: Dict[int, int] = {}  # bucket -> verifying steps measured
        self.pending: List[tuple] = []  # measured steps not taken in yet
        self.changed = False  # since the table was last sent

    def allows(self, rows: int) -> bool:
        b = batch_bucket(rows)
        plain, verifying = self.rates.get(b, [None, None])
        if plain is None or self.verified.get(b, 0) < MIN_STEPS or verifying >= MARGIN * plain:
            return True
        return self.since_try.get(b, 0) >= EXPLORE_STEPS

    def tried(self, rows: int, allowed: bool) -> None:
        b = batch_bucket(rows)
        self.since_try[b] = 0 if allowed else self.since_try.get(b, 0) + 1

    def observe(self, rows: int, verified: bool, tokens: int, seconds: float) -> None:
        """A decode step (no prefill) of `rows` rows emitted `tokens` in `seconds`."""
        if seconds > 0 and rows:
            self.pending.append((batch_bucket(rows), verified, tokens / seconds))

    def refresh(self) -> None:
        for b, verified, now in self.pending:
            self.verified[b] = self.verified.get(b, 0) + verified
            rate = self.rates.setdefault(b, [None, None])
            rate[verified] = now if rate[verified] is None else MEMORY * rate[verified] + (1 - MEMORY) * now
        self.changed |= bool(self.pending)
        self.pending = []

    def table(self) -> list:
        self.changed = False
        return [[b, *r, self.verified.get(b, 0)] for b, r in self.rates.items()]

    def load(self, table: list) -> None:
        self.rates = {b: [plain, verifying] for b, plain, verifying, _ in table}
        self.verified = {b: n for b, _, _, n in table}

    def stats(self) -> dict:
        return {f"batch_{1 << (b - 1)}+": {"plain_tokens_per_s": r[0], "verifying_tokens_per_s": r[1]}
                for b, r in sorted(self.rates.items())}
