"""Decode staging holds no more than its own arrays: when a batch outgrows them they are
rebuilt, the old ones dropped first and every row gathered from the pool a layer at a
time (MLX's peak-memory counter on a real KV pool; no model needed). Growing them by
concatenation held the old and the new arrays at once, and gathering every row of a
rebuild for all layers before writing them held a second copy: under 64 client loops
the deployed app peaked 4.8 GB over its memory bound."""

import mlx.core as mx
import numpy as np

from mlx_worker.memory.decode_kv import DecodeStaging
from mlx_worker.memory.kv_pool import KVPool
from mlx_worker.memory.model_caches import LayerSpec
from mlx_worker.request import SamplingParams, Sequence

LAYERS, HEADS, DIM, PAGE = 8, 4, 32, 16
POSITIONS = 1000  # each row's history
SLACK = 1 << 20  # index arrays and the like


def make_pool(rows):
    pages = rows * (-(-(POSITIONS + 8) // PAGE))
    pool = KVPool([LayerSpec(HEADS, DIM, DIM)] * LAYERS, mx.float32, pages, PAGE)
    for i in range(LAYERS):  # distinct values, so a copy from the wrong place shows
        pool.keys[i] = mx.random.normal(pool.keys[i].shape)
        pool.values[i] = mx.random.normal(pool.values[i].shape)
    mx.eval(pool.arrays())
    return pool


def make_rows(rows):
    per_row = -(-(POSITIONS + 8) // PAGE)
    seqs = []
    for r in range(rows):
        s = Sequence(f"r{r}", [1] * POSITIONS, SamplingParams(), POSITIONS, PAGE)
        s.pages = list(range(r * per_row, (r + 1) * per_row))
        seqs.append(s)
    return seqs


def staged_bytes(staging):
    return sum(a.nbytes for a in staging.current.arrays()) if staging.current else 0


def stage_measured(staging, decode):
    """Stage `decode` as the worker does (each dispatch evaluated in turn); the peak
    memory growth above what was allocated before, and the rows in slot order."""
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    ordered, kv = staging.stage(decode, lambda *arrays: mx.eval(*arrays))
    mx.synchronize()
    return mx.get_peak_memory() - base, ordered, kv


def gather_bytes(rows, positions):
    """One layer's K and V of `rows` rows of `positions` positions."""
    return rows * positions * HEADS * 2 * DIM * 4


def assert_rows_hold_their_history(pool, ordered, kv):
    for slot, (seq, pos) in enumerate(ordered):
        slots = np.array([seq.pages[p // PAGE] * PAGE + p % PAGE for p in range(pos)])
        for layer in (0, LAYERS - 1):
            want = np.array(pool.keys[layer])[:, slots]
            assert np.array_equal(np.array(kv.keys[layer][0][slot, :, :pos]), want), (slot, layer)


def test_rebuilding_for_a_bigger_batch_holds_only_the_new_arrays():
    pool, seqs = make_pool(9), make_rows(9)
    scratch = 2 * gather_bytes(9, POSITIONS + 1)  # two layers' copies at a time, of the 8 layers
    staging = DecodeStaging(pool, max_bytes=1 << 34, scratch_bytes=scratch)

    growth, ordered, kv = stage_measured(staging, [(s, POSITIONS) for s in seqs[:8]])
    first = staged_bytes(staging)
    assert growth <= first + scratch + SLACK, (growth, first)  # every row joins
    assert_rows_hold_their_history(pool, ordered, kv)

    # The 9th row needs a ninth slot: the arrays are rebuilt, all 9 rows gathered again.
    del kv  # as the engine holds them: only in the staging
    growth, ordered, kv = stage_measured(staging, [(s, POSITIONS + 1) for s in seqs[:8]] + [(seqs[8], POSITIONS)])
    second = staged_bytes(staging)
    assert staging.num_restaged == 1 and staging.num_gathered == 0 and second > first
    assert growth <= second - first + scratch + SLACK, (growth, first, second)
    assert_rows_hold_their_history(pool, [(s, POSITIONS) for s, _ in ordered], kv)  # positions written so far


def test_a_row_joining_kept_arrays_copies_only_that_row():
    pool, seqs = make_pool(9), make_rows(9)
    staging = DecodeStaging(pool, max_bytes=1 << 34, scratch_bytes=0)  # 0: a layer at a time
    staging.stage([(s, POSITIONS) for s in seqs[:7]], lambda *arrays: mx.eval(*arrays))
    before = staged_bytes(staging)
    growth, ordered, kv = stage_measured(staging, [(s, POSITIONS + 1) for s in seqs[1:7]] + [(seqs[8], POSITIONS)])
    assert staged_bytes(staging) == before and staging.num_restaged == 0
    assert staging.num_moved == 1  # the last row moved into the slot the first one left
    assert growth <= gather_bytes(1, kv.capacity) + gather_bytes(1, POSITIONS) + SLACK, growth
    assert ordered[-1][0] is seqs[8]
    assert_rows_hold_their_history(pool, [(s, POSITIONS) for s, _ in ordered], kv)
