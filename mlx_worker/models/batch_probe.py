"""Can the model's code run rows at different positions in one forward? Checked once at
load on a probe input, not from a list of architectures.

Most mlx-lm models take per-row offsets and a (B, 1, L, Lk) mask. Some split heads into
groups and need the mask with one more axis (gemma2); some need one integer offset for
the whole batch (gpt_bigcode, llama4's chunk mask, afm7's KV-reuse layers) or place every
row's queries at the end of the keys (minimax_m3's block selection): those get one
forward per position (`UNIFORM`).
"""

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..memory.kv_pool import KVPool
from ..memory.model_caches import CacheTree
from ..memory.paged_cache import BatchLayout, forward_caches
from ..memory.recurrent_state import RecurrentStates, RowState

RAGGED, RAGGED_HEAD_GROUPS, UNIFORM = "ragged", "ragged_head_groups", "uniform_offsets"
# Long enough that length-gated code (sparse block selection, sliding windows) runs; code
# gated on longer contexts than these is not checked.
PROMPTS = tuple([100 + 7 * i % 997 for i in range(n)] for n in (24, 61))
TOLERANCE = 3e-2  # relative: batched vs single-row float16 differ by far less; a wrong position by far more


def probe_batching(model, tree: CacheTree) -> str:
    expected = [model(mx.array([p]), cache=mlx_cache.make_prompt_cache(model))[0, -1] for p in PROMPTS]
    for mode in (RAGGED, RAGGED_HEAD_GROUPS):
        try:
            got = _ragged_last_tokens(model, tree, head_groups=mode == RAGGED_HEAD_GROUPS)
            if all(_close(g, e) for g, e in zip(got, expected)):
                return mode
        except Exception:  # noqa: BLE001 - the model's code refused ragged rows
            pass
    return UNIFORM


def _ragged_last_tokens(model, tree: CacheTree, head_groups: bool):
    """Each prompt but its last token alone, then the last tokens of all together."""
    P = 64
    pool = KVPool(tree.kv, tree.kv_dtype, num_pages=len(PROMPTS), page_size=P)
    states = RecurrentStates(tree.states)

    def forward(tokens, page_tables, offsets, rows):
        layout = BatchLayout(page_tables, offsets, len(tokens[0]), P, head_groups)
        state_caches = states.caches(rows)
        logits = model(mx.array(tokens), cache=forward_caches(tree, pool, layout, state_caches))
        out = RecurrentStates.collect(state_caches)
        mx.eval(logits, pool.arrays(), RecurrentStates.arrays(out))
        return logits, out

    rows = []
    for i, p in enumerate(PROMPTS):  # prompt i in page i
        _, out = forward([p[:-1]], [[i]], [0], [None])
        rows.append(RowState(out, 0))
    tables = [[i] for i in range(len(PROMPTS))]
    logits, _ = forward([[p[-1]] for p in PROMPTS], tables, [len(p) - 1 for p in PROMPTS], rows)
    return [logits[i, -1] for i in range(len(PROMPTS))]


def _close(got: mx.array, expected: mx.array) -> bool:
    got, expected = got.astype(mx.float32), expected.astype(mx.float32)
    err = mx.linalg.norm(got - expected) / (mx.linalg.norm(expected) + 1e-6)
    return bool(err.item() < TOLERANCE)
