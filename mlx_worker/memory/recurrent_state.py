"""Recurrent layers' per-sequence state (mlx-lm `ArraysCache`: conv and SSM /
linear-attention state).

A forward's rows all feed the same number of tokens, so a recurrent layer needs no
padding mask: it gets one mlx-lm `ArraysCache` whose entries hold the rows' states
stacked on the batch axis, and leaves the new states there. Each sequence then keeps a
`RowState`, its row of those output arrays, for its next forward. A decode batch that
did not change is handed the previous step's arrays as they are; otherwise the rows are
gathered in runs (slices of a source batch, zeros for sequences that start fresh).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from .model_caches import StateSpec

Batch = Tuple[Tuple[Optional[mx.array], ...], ...]  # [state layer][entry] arrays (B, ...)


@dataclass(frozen=True)
class RowState:
    """Row `row` of a forward's output states: a sequence's state after its last forward."""

    batch: Batch
    row: int


class RecurrentStates:
    def __init__(self, specs: List[StateSpec]):
        self.specs = specs
        self.nbytes = sum(s.nbytes for s in specs)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def caches(self, rows: Sequence[Optional[RowState]]) -> List[ArraysCache]:
        """One ArraysCache per recurrent layer with the rows' states (None: fresh)."""
        out = []
        for layer, spec in enumerate(self.specs):
            c = ArraysCache(len(spec.shapes))
            c.cache = [_gather(rows, layer, e) for e in range(len(spec.shapes))]
            out.append(c)
        return out

    @staticmethod
    def collect(caches: List[ArraysCache]) -> Batch:
        """The states a forward left in its caches (still lazy)."""
        return tuple(tuple(c.cache) for c in caches)

    @staticmethod
    def arrays(batch: Batch) -> List[mx.array]:
        return [a for layer in batch for a in layer if a is not None]

    @staticmethod
    def snapshot(state: RowState) -> RowState:
        """A copy of one row (a slice would keep the whole batch's arrays alive)."""
        idx = mx.array([state.row])
        return RowState(tuple(tuple(None if a is None else mx.take(a, idx, axis=0) for a in layer)
                              for layer in state.batch), 0)


def _gather(rows: Sequence[Optional[RowState]], layer: int, entry: int) -> Optional[mx.array]:
    """Entry `entry` of layer `layer` for all rows, stacked in order."""
    sources = [None if r is None else r.batch[layer][entry] for r in rows]
    if all(a is None for a in sources):
        return None  # every row starts fresh: the model makes its own zeros
    first = sources[0]
    if first is not None and first.shape[0] == len(rows) and all(
        a is first and r.row == i for i, (a, r) in enumerate(zip(sources, rows))
    ):
        return first  # the same batch as the source forward: no copy
    template = next(a for a in sources if a is not None)
    parts, i = [], 0
    while i < len(rows):  # runs of consecutive rows of one source, or of fresh rows
        a, j = sources[i], i + 1
        if a is None:
            while j < len(rows) and sources[j] is None:
                j += 1
            parts.append(mx.zeros((j - i,) + template.shape[1:], template.dtype))
        else:
            start = rows[i].row
            while j < len(rows) and sources[j] is a and rows[j].row == start + (j - i):
                j += 1
            parts.append(a[start : start + (j - i)])
        i = j
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
