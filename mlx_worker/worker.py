"""Builds each step's forward passes lazily and runs them on the device asynchronously."""

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .memory.kv_pool import KVPool
from .memory.model_caches import CacheTree
from .memory.step_kv import StepKV
from .models.batch_probe import RAGGED, RAGGED_HEAD_GROUPS, UNIFORM
from .models.output_head import split_output_head
from .request import Sequence
from .sampling.sampler import SampleResult, SamplerRow, sample, token_logprobs
from .scheduling.scheduler import StepPlan


def shows_images(chunk) -> bool:
    """Whether a prefill chunk holds image tokens: its rows go in as embeddings."""
    images = chunk.seq.images
    return images is not None and images.shown(chunk.start, chunk.start + chunk.length)


@dataclass
class InFlightStep:
    plan: StepPlan
    result: Optional[SampleResult]  # one token per sampling row, still lazy
    prompt: List[tuple] = field(default_factory=list)  # (seq, start, logprobs, top ids, top logprobs) of prompt scoring
    embeddings: List[tuple] = field(default_factory=list)  # (seq, vector) of embedding requests
    drafted: List[tuple] = field(default_factory=list)  # (verify rows, their draft model's drafts (rows, k))
    launched_at: float = 0.0  # perf_counter when the engine started building it
    done_at: Optional[float] = None  # perf_counter when the device was seen to have finished it
    disk_capture: Optional[object] = None  # kv_tiers.Capture: the pages it published, for the SSD tier


@dataclass
class StepTokens:
    tokens: List[int]
    logprobs: Optional[List[float]] = None
    top: Optional[List[List[tuple]]] = None  # [(id, logprob)] per row


class Worker:
    """Runs a StepPlan: one batched decode forward plus one forward per prefill chunk
    length, then samples every row that ends its known tokens, in one sampler call.

    Each forward is built lazily while the device still runs the previous one (the next
    step is built on the still-lazy tokens, each decoding sequence's `next_input`), but
    dispatched only once the device has finished everything dispatched before it
    (`_dispatch`). MLX decides at dispatch whether a write may reuse an array's buffer,
    and may only when no pending work still reads it: a pool write dispatched while an
    earlier forward's pool read is pending copies the whole layer array (every layer,
    every step: the whole pool). `finalize` returns a step's tokens as ints.

    What each forward reads and writes of KV memory (pages, the staged decode batch,
    recurrent state and its snapshots) comes from one place, `self.kv` (step_kv.py). A
    model whose code cannot take rows at different positions (batch_probe.py) gets one
    forward per position.
    """

    def __init__(self, model, pool: KVPool, tree: CacheTree, vocab_size: int, stop_ids: List[int],
                 staging_bytes: int = 0, snapshots=None, batching: str = RAGGED, scratch_bytes: int = 0,
                 adapters=None, draft=None):
        self.model = model
        self.vision = hasattr(model, "forward_kwargs")  # vision/vision_model.py
        self.draft = draft  # speculative.DraftModel: runs every forward too, and drafts for verify rows
        self.adapters = adapters  # adapters.AdapterSlots: each forward's rows name their LoRA adapters
        self.batching = batching
        self.kv = StepKV(pool, tree, 0 if batching == UNIFORM else staging_bytes, scratch_bytes, snapshots,
                         head_groups=batching == RAGGED_HEAD_GROUPS)
        self.split = split_output_head(model)  # None: full logits, then slice
        # A pipeline stage sends its hidden states on inside the forward: a chunk that
        # samples nothing must still be run to its end, or the next stage waits forever.
        self.pipelined = getattr(getattr(model, "model", None), "pipeline_size", 1) > 1
        self.pool = pool
        self.vocab = vocab_size
        self.stop_ids = list(stop_ids)
        self._busy = False  # work dispatched that the device may not have finished
        self._unfinished: Optional[InFlightStep] = None  # the last launched step, until a wait sees it done
        self.device_s = 0.0  # time spent dispatching to and waiting for the device (the rest is host work)
        self.build_s = 0.0  # of the host work: building the model's graph (mlx-lm's code, not the engine's)
        self.device_cpu_s = self.build_cpu_s = 0.0  # the same spans in this thread's CPU time
        self.before_device: Optional[Callable[[], None]] = None  # called before each dispatch or wait

    def launch(self, plan: StepPlan) -> InFlightStep:
        last_logits = []
        staged = None
        if self.batching == UNIFORM:  # rows at one position share a forward
            plan.decode = sorted(plan.decode, key=lambda row: row[1])
            groups = [list(g) for _, g in itertools.groupby(plan.decode, key=lambda row: row[1])]
        else:
            plan.decode, staged = self.kv.decode_rows(plan.decode, self._dispatch)  # rows in staging order
            groups = [plan.decode] if plan.decode else []
        for rows in groups:
            seqs = [s for s, _ in rows]
            inputs = mx.concatenate([s.next_input for s in seqs])[:, None]
            logits, kv_arrays = self._forward(inputs, seqs, [p for _, p in rows], 1, staged)
            logits = logits[:, -1, :]
            self._dispatch(logits, *kv_arrays)
            last_logits.append(logits)
        verify_logits, drafted = self._verify_forwards(plan)
        # Prefill chunks of equal length share one forward (rows may start anywhere), built
        # in the order the groups were opened. A chunk that reads pages another chunk of this
        # step writes (a prefix hit on a prompt scheduled in this very step) opens a group of
        # its own after them: in an earlier group it would read those pages unwritten.
        groups: Dict[tuple, list] = {}
        P, written, epoch = self.pool.page_size, set(), 0
        for chunk in plan.prefills:
            pages = chunk.seq.pages
            if written and not written.isdisjoint(pages[: -(-chunk.start // P)]):
                epoch += 1
            key = (chunk.length, chunk.start if self.batching == UNIFORM else 0, epoch, shows_images(chunk))
            groups.setdefault(key, []).append(chunk)
            written.update(pages[chunk.start // P : -(-(chunk.start + chunk.length) // P)])
        prefill_logits, scored, embedded = {}, [], []
        # The images of every prompt that shows its first this step: in one call of the tower.
        fresh = self.model.encode_new_images([c.seq.images for c in plan.prefills if shows_images(c)
                                              and c.seq.embeds is None]) if self.vision else {}
        for (L, _, _, images), chunks in groups.items():
            inputs = mx.array([c.seq.tokens[c.start : c.start + L] for c in chunks])
            embeds = mx.stack([self._prompt_embeddings(c.seq, fresh)[c.start : c.start + L] for c in chunks]) \
                if images else None
            out, kv_arrays = self._forward(inputs, [c.seq for c in chunks], [c.start for c in chunks], L,
                                           body_only=bool(self.split), prefill_ends=[c.start + L for c in chunks],
                                           embeds=embeds)
            ends = {id(c): out[i : i + 1, -1, :] for i, c in enumerate(chunks) if c.samples}
            prompt, pooled = self._score_prompt(chunks, out), self._pool(chunks, out)
            self._dispatch(*ends.values(), *kv_arrays, *(v for _, v in pooled),
                           *(a for p in prompt for a in p[2:] if a is not None), *([out[:, -1]] if self.pipelined else []))
            prefill_logits.update(ends)
            scored += prompt
            embedded += pooled
        ends = [prefill_logits[id(c)] for c in plan.prefills if c.samples]
        if ends and self.split:  # hidden states of the sampled positions only
            ends = [self.split[1](mx.concatenate(ends) if len(ends) > 1 else ends[0])]
        last_logits += ends + verify_logits
        if not last_logits:
            return self._launched(InFlightStep(plan, None, scored, embedded, drafted))

        seqs = plan.sampling_rows()
        positions = [p for _, p in plan.decode] + [c.start + c.length - 1 for c in plan.prefills if c.samples]
        rows = [self._row(s, pos + 1 - s.num_prompt) for s, pos in zip(seqs, positions)]
        rows += [self._row(v.seq, v.position + i + 1 - v.seq.num_prompt) for v in plan.verify for i in range(v.length)]
        logits = mx.concatenate(last_logits) if len(last_logits) > 1 else last_logits[0]
        result = sample(logits, rows)
        for i, seq in enumerate(seqs):
            seq.next_input = result.tokens[i : i + 1]
            if result.counts is not None and seq.counts is not None:
                seq.counts = result.counts[i]
            if result.seen is not None and seq.seen is not None:
                seq.seen = result.seen[i]
        self._on_device(mx.async_eval, *result.arrays())  # reads no pool array: no fence needed
        return self._launched(InFlightStep(plan, result, scored, embedded, drafted))

    def _verify_forwards(self, plan: StepPlan) -> Tuple[List[mx.array], List[tuple]]:
        """Run the verify rows (speculative/): each feeds its last token and its drafts,
        rows of one length in one forward; the logits of every position, (sum of lengths,
        V), and the draft model's drafts (still lazy) where it drafts. `plan.verify` is
        reordered as the logits are."""
        groups: Dict[tuple, list] = {}
        for v in plan.verify:
            groups.setdefault((v.length, v.position if self.batching == UNIFORM else 0), []).append(v)
        plan.verify = [v for rows in groups.values() for v in rows]
        logits, drafted = [], []
        for (L, _), rows in groups.items():
            seqs, positions = [v.seq for v in rows], [v.position for v in rows]
            if self.draft is not None:
                drafts = self.draft.draft(seqs, positions, L - 1, self._dispatch)
                inputs = mx.concatenate([mx.array([[s.tokens[-1]] for s in seqs], mx.int32), drafts], axis=1)
                drafted.append((rows, drafts))
            else:
                inputs = mx.array([[v.seq.tokens[-1], *v.drafts] for v in rows])
            out, kv_arrays = self._forward(inputs, seqs, positions, L, verify=True)
            out = out.reshape(-1, out.shape[-1])
            self._dispatch(out, *kv_arrays)
            logits.append(out)
        return logits, drafted

    def _prompt_embeddings(self, seq: Sequence, fresh: dict) -> mx.array:
        """Its prompt's input embeddings with its images in place, made (lazily: the
        vision tower runs in this step's graph) by the first chunk that shows an image.
        `fresh`: the features of images this step encoded, by hash."""
        if seq.embeds is None:
            seq.embeds = self.model.prompt_embeddings(seq.tokens[: seq.num_prompt], seq.images, fresh)
        return seq.embeds

    def _launched(self, step: InFlightStep) -> InFlightStep:
        self._unfinished = step
        return step

    def _forward(self, inputs: mx.array, seqs: List[Sequence], offsets: List[int], L: int, staged=None,
                 body_only: bool = False, prefill_ends=(), verify: bool = False,
                 embeds: Optional[mx.array] = None) -> Tuple[mx.array, List[mx.array]]:
        """One forward of `seqs`' rows, each feeding `L` tokens from its offset: its logits
        (hidden states if `body_only`) and the KV memory arrays it leaves (still lazy).
        `embeds`: the rows' input embeddings, where they show images (a vision model's).
        A drafter with KV of its own mirrors it, so that KV keeps up with the target's."""
        kv = self.kv.forward(seqs, offsets, L, staged)
        if self.adapters is not None:
            self.adapters.select(s.adapter_slot for s in seqs)
        t, c = time.perf_counter(), time.thread_time()
        hidden = body_only or (self.draft is not None and self.draft.needs_hidden)
        extra = self.model.forward_kwargs(seqs, offsets, L, embeds) if self.vision else {}
        if extra:  # a vision model's rows: their embeddings where they show images, their positions (M-RoPE)
            out = self.model.body(inputs, kv.caches, **extra) if hidden else self.model(inputs, cache=kv.caches, **extra)
        else:
            out = self.split[0](inputs, kv.caches) if hidden else self.model(inputs, cache=kv.caches)
        if self.draft is not None:
            self.draft.mirror(inputs, seqs, offsets, L, out if self.draft.needs_hidden else None, verify)
        if hidden and not body_only:
            out = self.split[1](out)
        self.build_s += time.perf_counter() - t
        self.build_cpu_s += time.thread_time() - c
        return out, kv.done(prefill_ends)

    def _score_prompt(self, chunks, out: mx.array) -> List[tuple]:
        """Logprobs of the prompt tokens each chunk of a prompt-scoring request predicts
        (position i scores token i + 1), still lazy."""
        scored = []
        for i, c in enumerate(chunks):
            k = c.seq.params.prompt_logprobs
            n = min(c.length, c.seq.num_prompt - 1 - c.start)
            if k is None or n <= 0:
                continue
            logits = out[i, :n]
            if self.split:
                logits = self.split[1](logits)
            ids = mx.array(c.seq.tokens[c.start + 1 : c.start + 1 + n])
            scored.append((c.seq, c.start, *token_logprobs(logits, ids, k)))
        return scored

    def _pool(self, chunks, out: mx.array) -> List[tuple]:
        """Embedding requests whose prompt ends in this forward: their pooled, normalized
        final hidden state (`out` is the body's output: the model is split)."""
        pooled = []
        for i, c in enumerate(chunks):
            how = c.seq.params.embedding
            if how == "mean":
                part = out[i, : c.length].astype(mx.float32).sum(axis=0)
                c.seq.hidden_sum = part if c.seq.hidden_sum is None or c.start == 0 else c.seq.hidden_sum + part
            if how is None or not c.samples:
                continue
            v = c.seq.hidden_sum / c.seq.num_prompt if how == "mean" else out[i, c.length - 1].astype(mx.float32)
            pooled.append((c.seq, v / mx.maximum(mx.linalg.norm(v), 1e-12)))
        return pooled

    def _dispatch(self, *outputs: mx.array) -> None:
        """Hand one forward (its outputs and the pool writes it made) to the device, once
        the device has finished all earlier work, so the writes reuse the pool buffers."""
        self.fence()
        self._on_device(mx.async_eval, *outputs, *self.pool.arrays(), *(self.draft.pool.arrays() if self.draft else ()))
        self._busy = True

    def fence(self) -> None:
        """Wait until the device has finished everything dispatched so far."""
        if self._busy:
            self._on_device(mx.synchronize)
            self._busy = False
            self._mark_done()

    def _mark_done(self) -> None:
        """The device has finished everything dispatched: so the last launched step."""
        if self._unfinished is not None:
            self._unfinished.done_at = time.perf_counter()
            self._unfinished = None

    def reset(self) -> None:
        """After a failed step: drop the staged batch and snapshots, wait out what was
        dispatched."""
        self.kv.reset()
        try:
            self.fence()
        except Exception:  # noqa: BLE001 - the failed step's own arrays
            self._busy = False

    def _on_device(self, call, *args) -> None:
        # Dispatch counts as device time: MLX's CPU backend computes in the dispatching
        # thread once ~100 tasks are queued, so on a CPU an async_eval is mostly the forward.
        if self.before_device is not None:
            self.before_device()
        t, c = time.perf_counter(), time.thread_time()
        call(*args)
        self.device_s += time.perf_counter() - t
        self.device_cpu_s += time.thread_time() - c

    def _row(self, seq: Sequence, step: int) -> SamplerRow:
        seq.init_sampling_state(self.vocab)
        p = seq.params
        additive = None
        if step < p.min_tokens:  # no stopping yet: hide EOS and stop tokens
            additive = np.zeros(self.vocab, np.float32)
            stop = ([] if p.ignore_eos else self.stop_ids) + p.stop_token_ids
            additive[[t for t in stop if t < self.vocab]] = -np.inf
        if seq.matcher is not None:  # the matcher has seen every earlier token (engine syncs)
            allowed = seq.matcher.allowed()
            additive = np.where(allowed, 0.0, -np.inf).astype(np.float32) + (0 if additive is None else additive)
        return SamplerRow(p, seq.seed, step, seq.counts, seq.seen, additive)

    def finalize(self, step: InFlightStep) -> StepTokens:
        if step.prompt or step.embeddings:  # one wait for all of them
            self._on_device(mx.eval, *(a for p in step.prompt for a in p[2:] if a is not None),
                            *(v for _, v in step.embeddings))
        for seq, start, lp, top_ids, top_lp in step.prompt:
            seq.prompt_lp[start:] = lp.tolist()  # a recomputed prompt overwrites its earlier scores
            if top_ids is not None:
                seq.prompt_top[start:] = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
        for seq, vector in step.embeddings:
            seq.embedding, seq.hidden_sum = vector.tolist(), None
        r = step.result
        if r is None:  # nothing sampled: only its pool writes to wait for
            if step.done_at is None:
                self.fence()
            return StepTokens([])
        self._on_device(mx.eval, *r.arrays(), *(d for _, d in step.drafted))
        for rows, drafts in step.drafted:
            for v, row in zip(rows, drafts.tolist()):
                v.drafts = row
        if step.done_at is None:  # its last forward produced these: the step is done
            step.done_at = time.perf_counter()
            if self._unfinished is step:
                self._unfinished = None
        out = StepTokens(r.tokens.tolist())
        if r.logprobs is not None:
            out.logprobs = r.logprobs.tolist()
        if r.top_ids is not None:
            out.top = [list(zip(i, v)) for i, v in zip(r.top_ids.tolist(), r.top_logprobs.tolist())]
        return out
