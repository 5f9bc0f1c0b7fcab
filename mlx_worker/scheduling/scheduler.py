"""Continuous batching: admit, chunk prefills, batch decodes, preempt, finish."""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import mlx.core as mx

from ..memory.page_manager import PageManager
from ..memory.state_snapshots import StateSnapshots
from ..request import RequestOutput, Sequence, Status
from .image_chunks import ImageChunks
from .step_budget import StepBudget, StepRoom

PREFETCH_AHEAD = 4  # waiting requests whose prefix pages the SSD tier reads ahead


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    length: int
    samples: bool  # the chunk ends the known tokens, so its last logits give a token
    image_tokens: int = 0  # of its prompt's images, those the step's vision tower encodes (its first image chunk)

    @property
    def replay(self) -> bool:
        """Output tokens computed again: a recurrent model's accepted drafts (_accept)."""
        return self.start >= self.seq.num_prompt


@dataclass
class VerifyRow:
    """A decoding row that feeds its last token and its drafts at `position` onwards; a
    token is sampled at each of those positions (speculative/)."""

    seq: Sequence
    position: int
    drafts: List[int]
    proposed: int  # of the drafts, those the drafter proposed (the rest pad the row to the step's length)
    state: object = None  # recurrent layers' state before this row's forward (RowState), to roll back to
    hidden: object = None  # the sequence's carried hidden states before it (method mtp), likewise

    @property
    def length(self) -> int:
        return 1 + len(self.drafts)


@dataclass
class StepPlan:
    decode: List[Tuple[Sequence, int]] = field(default_factory=list)  # (seq, position)
    prefills: List[PrefillChunk] = field(default_factory=list)
    verify: List[VerifyRow] = field(default_factory=list)

    def sequences(self) -> List[Sequence]:
        return [s for s, _ in self.decode] + [c.seq for c in self.prefills] + [v.seq for v in self.verify]

    def sampling_rows(self) -> List[Sequence]:
        """The rows that sample one token (verify rows sample theirs after them)."""
        return [s for s, _ in self.decode] + [c.seq for c in self.prefills if c.samples]

    def decode_like(self) -> int:
        return len(self.decode) + len(self.verify)

    def chunks(self) -> List[Tuple[int, int]]:
        """(start, length) of the prefill chunks."""
        return [(c.start, c.length) for c in self.prefills]

    def image_tokens(self) -> int:
        """Image tokens the step's vision tower encodes."""
        return sum(c.image_tokens for c in self.prefills)

    def verify_rows(self) -> List[Tuple[int, int]]:
        """(position, length) of the verify rows."""
        return [(v.position, v.length) for v in self.verify]

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefills or self.verify)


class Scheduler:
    """Decides each step's work; `schedule` runs one step ahead of `process`.

    A step is scheduled before the previous step's tokens are known: decode inputs are
    lazy, and a request that turns out to have finished simply has its extra token
    dropped in `process`. Page writes of such a step are harmless: later writes to the
    same slots are ordered after them through the pool arrays.
    """

    def __init__(self, pages: PageManager, eos_ids: Set[int], max_running: int, max_batched_tokens: int,
                 snapshots: Optional[StateSnapshots] = None, budget: Optional[StepBudget] = None,
                 speculator=None, disk=None, tower_tokens=None):
        self.speculator = speculator  # speculative.Speculator: decoding rows may verify drafts
        self.images = ImageChunks(tower_tokens)  # how a vision prompt's images shape its chunks
        self.disk = disk  # kv_tiers.DiskTier: prefix pages on SSD, read back instead of recomputed
        self.pages = pages
        self.snapshots = snapshots  # a model with recurrent layers resumes only at a snapshot
        self.page_size = pages.page_size
        self.eos_ids = set(eos_ids)
        self.max_running = max_running
        self.budget = budget or StepBudget(max_batched_tokens)  # each step's room in tokens and time
        self.waiting: List[Sequence] = []
        self.running: List[Sequence] = []
        self.by_rid: Dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.tokens_computed = 0  # prompt and output tokens run through the model (recomputation too)
        self.tokens_wasted = 0  # of those: for requests that were then aborted (client gone) or failed
        self.late: Counter = Counter()  # requests that ended past their clients' deadlines, by phase then
        self._pending_outputs: List[RequestOutput] = []  # finished while scheduling

    # --- requests in and out ---------------------------------------------------
    def add(self, seq: Sequence) -> Optional[RequestOutput]:
        """Queue a request; an immediate error output if it can never fit."""
        capacity = self.pages.num_pages * self.page_size
        if seq.num_tokens + 1 > capacity:
            return self.refusal(seq, f"prompt of {seq.num_tokens} tokens exceeds the KV pool ({capacity} tokens)",
                                "context_length_exceeded")
        if seq.rid in self.by_rid:
            return self.refusal(seq, f"duplicate request id {seq.rid!r}", "duplicate_request_id")
        self.by_rid[seq.rid] = seq
        self.waiting.append(seq)
        self._prefetch_ahead()
        return None

    def _prefetch_ahead(self) -> None:
        """The SSD tier reads the prefix pages of the next requests to admit while they
        wait (only the next few: what it reads is held in memory until then)."""
        if self.disk is None:
            return
        for seq in self.waiting[:PREFETCH_AHEAD]:
            if seq.disk_reads is None and not seq.pages and self._matches_prefix(seq):
                hashes = seq.full_page_hashes((seq.num_tokens - 1) // self.page_size)
                seq.disk_reads = self.disk.prefetch(hashes, self.pages.cached_depth(hashes))

    def refusal(self, seq: Sequence, message: str, code: str) -> RequestOutput:
        """The error output that ends a request never queued."""
        seq.status = Status.FINISHED
        return self._output(seq, [], "error", message, code=code)

    def withdraw(self, seq: Sequence, message: str, code: str) -> RequestOutput:
        """End a waiting request before any of its work: the error output that tells its client."""
        self._finish(seq, "error")
        return self._output(seq, [], "error", message, code=code)

    def abort(self, rid: str, wasted: bool = True) -> Optional[RequestOutput]:
        """End a request early: its client left (its work is wasted), or it already has
        what it needs (a stop string matched)."""
        seq = self.by_rid.get(rid)
        if seq is None or seq.status == Status.FINISHED:
            return None
        self._finish(seq, "abort")
        self.tokens_wasted += wasted * seq.num_work
        return self._output(seq, [], "abort")

    def fail(self, seq: Sequence, message: str) -> Optional[RequestOutput]:
        """End a request whose step failed (server side); None if it already ended."""
        if seq.status == Status.FINISHED:
            return None
        self._finish(seq, "error")
        self.tokens_wasted += seq.num_work
        return self._output(seq, [], "error", message, code="engine_error")

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: of the waiting requests (less what the prefix
        cache holds of them now) and of the running ones still in prefill."""
        waiting = sum(self.uncached_tokens(s) for s in self.waiting)
        return waiting + sum(s.num_tokens - s.num_computed for s in self.running if s.next_input is None)

    def uncached_tokens(self, seq: Sequence) -> int:
        if seq.pages:
            return seq.num_tokens - seq.num_computed
        if seq.uncached_estimate is None:
            hashes = seq.full_page_hashes((seq.num_tokens - 1) // self.page_size)
            seq.uncached_estimate = seq.num_tokens - self.pages.cached_depth(hashes) * self.page_size
        return seq.uncached_estimate

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def needs_sync(self) -> bool:
        """A grammar needs the previous token before it can mask the next step; a verify
        row, its accepted tokens before its next position is known; drafting, known tokens."""
        if any(s.matcher is not None or s.verifying for s in self.running):
            return True
        # While prompts are prefilled no row drafts: keep building steps ahead.
        return (self.speculator is not None and bool(self.running) and not self._prompts_pending()
                and self.speculator.wants_sync(len(self.running)))

    def _prompts_pending(self) -> bool:
        return bool(self.waiting) or any(s.next_input is None and s.num_computed < s.num_prompt for s in self.running)

    # --- one step ----------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._schedule_decode(plan)
        room = self.budget.room(len(plan.decode), sum(pos + 1 for _, pos in plan.decode), plan.verify_rows())
        for seq in [s for s in self.running if s.next_input is None]:
            self._schedule_prefill(plan, seq, room)
        while self.waiting and room.tokens > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with a token still on the device
                break
            if not seq.pages:
                self._match_prefix(seq)
            if self._schedule_prefill(plan, seq, room) == 0:
                self.pages.release(seq.pages)
                seq.pages, seq.num_computed, seq.num_published, seq.state = [], 0, 0, None
                break
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
        self._prefetch_ahead()
        self.tokens_computed += len(plan.decode) + sum(length for _, length in plan.chunks() + plan.verify_rows())
        return plan

    def _schedule_decode(self, plan: StepPlan) -> None:
        rows = [(s, s.num_computed) for s in self.running if s.next_input is not None and not s.verifying
                and s.num_scheduled_output < s.params.max_tokens]
        # A step with prompt chunks runs their forward too: no verify forward beside it.
        # (Replays of accepted drafts, short, may share a step with verify rows.)
        drafts = [([], 0)] * len(rows)
        if self.speculator and rows and not self._prompts_pending():
            drafts = self.speculator.plan(rows, self.budget.cost.coef)
        for (seq, position), (draft, proposed) in zip(rows, drafts):
            if seq.status != Status.RUNNING:
                continue  # preempted for an earlier row's pages
            if not self._reserve(seq, position + 1 + len(draft)):
                continue
            if draft:
                plan.verify.append(VerifyRow(seq, position, draft, proposed, seq.state, seq.hidden))
                seq.verifying = True
            else:
                plan.decode.append((seq, position))
            seq.num_work += 1 + len(draft)
            seq.num_computed += 1 + len(draft)
            seq.num_tokens += 1 + len(draft)

    def _reserve(self, seq: Sequence, n_tokens: int) -> bool:
        """Pages for n_tokens, preempting the newest requests if the pool is full."""
        need = -(-n_tokens // self.page_size) - len(seq.pages)
        while need > 0:
            new = self.pages.allocate(need)
            if new is not None:
                seq.pages += new
                return True
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self._finish(seq, "length")  # alone and still too big for the pool
                self._pending_outputs.append(self._output(seq, [], "length"))
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_prefill(self, plan: StepPlan, seq: Sequence, room: StepRoom) -> int:
        start = seq.num_computed
        wanted, tower = self.images.tower(seq, start, seq.num_tokens - start, room)
        fits = (len(seq.pages) + self.pages.available()) * self.page_size - start
        if seq.status == Status.WAITING and self.images.holds_all_pages(seq):
            if fits < seq.num_tokens - start:
                return 0
            seq.pages += self.pages.allocate(-(-seq.num_tokens // self.page_size) - len(seq.pages))
        length = min(room.prefill(start, wanted, tower), fits)
        if length <= 0:
            return 0
        if self.snapshots is not None:
            length = self._end_on_snapshot_point(seq, start, length)
        length = self.images.end_outside_blocks(seq, start, length)  # within `fits`: it holds all its pages
        need = -(-(start + length) // self.page_size) - len(seq.pages)
        if need > 0:
            seq.pages += self.pages.allocate(need)
        samples = start + length == seq.num_tokens
        tower = self.images.encoded(seq, start, length, tower)
        plan.prefills.append(PrefillChunk(seq, start, length, samples, tower))
        seq.verifying = samples and plan.prefills[-1].replay  # its next step drafts: from known tokens
        room.take(start, length, tower)
        seq.num_work += length
        seq.num_computed += length
        if samples:
            seq.num_tokens += 1
        self._publish(seq)
        return length

    def _end_on_snapshot_point(self, seq: Sequence, start: int, length: int) -> int:
        """Shorten a chunk of a model with recurrent layers so that it ends where a state
        snapshot is worth taking: where its prompt leaves the cached pages of an earlier
        one (a third prompt sharing that prefix resumes there), on the prompt's last full
        page, or else on a page boundary when the chunk stops short of the known tokens."""
        P = self.page_size
        last_page_end = (seq.num_tokens - 1) // P * P  # where a later prefix hit resumes
        for point in (seq.branch_point, last_page_end):
            if start < point < start + length:
                return point - start
        if start + length < seq.num_tokens and (start + length) // P * P > start:
            return (start + length) // P * P - start
        return length

    @staticmethod
    def _matches_prefix(seq: Sequence) -> bool:
        """False where every prompt position's output is wanted: all of them are computed."""
        return seq.params.prompt_logprobs is None and seq.params.embedding != "mean"

    def _match_prefix(self, seq: Sequence) -> None:
        if not self._matches_prefix(seq):
            return
        # Leave at least one token to compute: its logits give the next token.
        n_pages = (seq.num_tokens - 1) // self.page_size
        first = seq.num_preemptions == 0
        hashes = seq.full_page_hashes(n_pages)
        if self.snapshots is not None:
            hashes = self._resume_point(seq, hashes)
        seq.pages = self.pages.match(hashes, seq.num_tokens if first else 0, count=first)
        if self.disk is not None:
            seq.pages += self.disk.take(self.pages, hashes, len(seq.pages), seq.disk_reads, count=first)
            seq.disk_reads = None
            if self.snapshots is not None and len(seq.pages) < len(hashes):  # no room, or a file went bad
                keep = self.snapshots.resumable(hashes[: len(seq.pages)], self.pages.page_of)
                self.pages.release(seq.pages[keep:])
                seq.pages = seq.pages[:keep]
                seq.state = self.snapshots.take(hashes[keep - 1]) if keep else None
        seq.num_published = len(seq.pages)
        seq.num_computed = len(seq.pages) * self.page_size
        if first:
            seq.num_cached = seq.num_computed

    def _resume_point(self, seq: Sequence, hashes: List[int]) -> List[int]:
        """A model with recurrent layers resumes only where a state snapshot was taken: the
        hashes up to the deepest one whose pages are all cached (in memory, or on the SSD),
        its state in `seq.state`."""
        depth = self.snapshots.resumable(hashes, self.pages.page_of)
        cached = self.pages.cached_depth(hashes)
        seq.state = self.snapshots.take(hashes[depth - 1]) if depth else None
        if self.disk is not None:
            found = self.disk.deepest_snapshot(hashes, cached, depth, self.snapshots)
            if found is not None:
                depth, seq.state = found
                self.snapshots.put(hashes[depth - 1], seq.state)
        seq.branch_point = cached * self.page_size if cached > depth else 0
        return hashes[:depth]

    def _publish(self, seq: Sequence) -> None:
        """Publish the full pages whose tokens are known and whose KV is scheduled."""
        full = min(seq.num_computed, len(seq.tokens)) // self.page_size
        if full <= seq.num_published:
            return
        hashes = seq.full_page_hashes(full)
        for i in range(seq.num_published, full):
            self.pages.publish(seq.pages[i], hashes[i])
        seq.num_published = full

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)

    def _release(self, seq: Sequence) -> None:
        self._publish(seq)
        self.pages.release(seq.pages)
        seq.pages, seq.num_computed, seq.num_published = [], 0, 0
        seq.next_input = seq.state = seq.hidden = None
        seq.verifying = False

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.deadline is not None and time.perf_counter() > seq.deadline:
            self.late[seq.phase] += 1
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.embeds = seq.disk_reads = None
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.by_rid.pop(seq.rid, None)
        if self.speculator is not None:
            self.speculator.finished(seq)

    # --- results -----------------------------------------------------------------
    def process(self, plan: StepPlan, step) -> List[RequestOutput]:
        """Apply one step's sampled tokens (a worker.StepTokens: one per sampling row, then
        one per position of each verify row); outputs for the requests that advanced."""
        outputs, self._pending_outputs = self._pending_outputs, []
        rows = [(s, None) for s in plan.sampling_rows()] + [(v.seq, v) for v in plan.verify]
        i = 0
        for seq, verify in rows:
            n = 1 if verify is None else verify.length
            at, i = i, i + n
            seq.verifying = False
            if seq.status == Status.FINISHED:
                continue  # finished while this step ran ahead: drop its extra token
            first = len(seq.tokens) == seq.num_prompt
            if seq.params.max_tokens == 0:  # the prompt only: its logprobs
                self._finish(seq, "length")
                outputs.append(self._with_prompt_outputs(seq, self._output(seq, [], "length")))
                continue
            toks = step.tokens[at : at + n]
            if verify is not None:
                toks = self._accept(seq, verify, toks)
            out = self._append(seq, toks)
            if first:
                self._with_prompt_outputs(seq, out)
            if seq.params.logprobs and step.logprobs is not None:
                out.logprobs = step.logprobs[at : at + len(out.token_ids)]
                if seq.params.top_logprobs and step.top is not None:
                    out.top_logprobs = [t[: seq.params.top_logprobs] for t in step.top[at : at + len(out.token_ids)]]
            outputs.append(out)
        return outputs

    def _accept(self, seq: Sequence, verify: VerifyRow, sampled: List[int]) -> List[int]:
        """The tokens a verify row emits: its samples up to the first that differs from the
        draft it checked, that one included. The positions past them are given back (their
        KV is overwritten when they are computed again). Recurrent layers have taken in
        the rejected drafts too: such a row goes back to its state before the verify and
        computes its accepted tokens again, with the next one, as a prefill chunk."""
        accepted = 0
        while accepted < len(verify.drafts) and sampled[accepted] == verify.drafts[accepted]:
            accepted += 1
        rejected = len(verify.drafts) - accepted
        seq.num_computed -= rejected
        seq.num_tokens -= rejected
        seq.next_input = mx.array([sampled[accepted]], mx.int32)
        if rejected and verify.state is not None:
            seq.state, seq.hidden, seq.num_computed, seq.next_input = verify.state, verify.hidden, verify.position, None
        self.speculator.observe(seq, verify.proposed, min(accepted, verify.proposed), accepted + 1)
        if self.speculator.log is not None:
            self.speculator.log.append((list(seq.tokens), list(verify.drafts)))
        return sampled[: accepted + 1]

    def _append(self, seq: Sequence, toks: List[int]) -> RequestOutput:
        """Append sampled tokens in order until one ends the request; its output."""
        reason, stop_reason, n = None, None, 0
        for tok in toks:
            seq.tokens.append(tok)
            n += 1
            if (tok in self.eos_ids and not seq.params.ignore_eos) or tok in seq.params.stop_token_ids:
                reason, stop_reason = "stop", tok
            elif seq.matcher is not None and (not seq.matcher.advance(tok) or seq.matcher.is_terminated()):
                reason = "stop"  # the grammar is complete: nothing but EOS could follow
            elif len(seq.tokens) - seq.num_prompt >= seq.params.max_tokens:
                reason = "length"
            if reason:
                break
        if reason:
            self._finish(seq, reason)
        elif seq.status == Status.RUNNING:
            self._publish(seq)
        out = self._output(seq, toks[:n], reason)
        out.stop_reason = stop_reason
        return out

    @staticmethod
    def _with_prompt_outputs(seq: Sequence, out: RequestOutput) -> RequestOutput:
        """A sequence's first output carries what was computed on its prompt: an
        embedding, prompt logprobs."""
        out.embedding = seq.embedding
        if seq.params.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + seq.prompt_lp
            out.prompt_top_logprobs = [None] + seq.prompt_top if seq.params.prompt_logprobs else None
        return out

    def drain_outputs(self) -> List[RequestOutput]:
        """Outputs of requests finished while scheduling (e.g. too big for the pool)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    @staticmethod
    def _output(seq: Sequence, toks: List[int], reason: Optional[str], error: Optional[str] = None,
                code: Optional[str] = None) -> RequestOutput:
        return RequestOutput(
            error_code=code,
            rid=seq.rid,
            token_ids=toks,
            finished=reason is not None,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=seq.num_cached,
            num_output_tokens=len(seq.tokens) - seq.num_prompt,
        )
