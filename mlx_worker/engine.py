"""The engine: an asyncio facade over a scheduling loop on its own thread."""

import asyncio
import atexit
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from typing import AsyncIterator, List, Optional, Tuple

import numpy as np
from mlx.utils import tree_flatten

from .adapters.adapter_slots import AdapterSlots
from .config import EngineConfig
from .distributed.ranks import RankLost, Ranks
from .engine_stats import EngineStats
from .memory.activations import activation_budget
from .kv_tiers.disk_tier import open_disk_tier
from .memory.kv_pool import KVPool, kv_budget, kv_bytes_per_token, pool_pages
from .memory.quantized_kv_pool import KVQuantization, QuantizedKVPool, quantized_bytes_per_token
from .memory.model_caches import probe_caches
from .memory.page_manager import PageManager
from .memory.state_snapshots import StateSnapshots
from .models.batch_probe import probe_batching
from .models.loader import load_model, load_sharded
from .outbox import Outbox, merge_ready
from .request import Request, RequestOutput, Sequence
from .sampling.detokenizer import IncrementalDetokenizer
from .sampling.grammar import GrammarCompiler
from .scheduling.admission import Admission
from .scheduling.scheduler import Scheduler, StepPlan
from .scheduling.step_budget import StepBudget
from .scheduling.step_cost import shape_of
from .speculative.model_drafter import load_model_drafter
from .speculative.speculator import speculator_for
from .worker import Worker

log = logging.getLogger(__name__)


class Engine:
    """Serve many requests on one model: `async for out in engine.generate(req)`.

    All device work runs on the engine thread; callers' event loops only await queues.
    With `ranks` (tensor parallel) every rank constructs one; only the leader's takes
    requests, the others replay its schedule on their shard (ranks.py).
    """

    def __init__(self, config: Optional[EngineConfig] = None, model=None, tokenizer=None,
                 ranks: Optional[Ranks] = None, drafter=None, draft_model=None):
        self.config = config = config or EngineConfig()
        size = config.tensor_parallel_size * config.pipeline_parallel_size
        if size > max(config.tensor_parallel_size, config.pipeline_parallel_size):
            raise ValueError("tensor_parallel_size and pipeline_parallel_size cannot both be above 1 (yet)")
        if size != (ranks.size if ranks else 1):
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {size} needs a group of as many ranks")
        self.ranks = ranks
        if model is None:
            model, tokenizer = (load_sharded(config.model, config.dtype, ranks.group, config.pipeline_parallel_size > 1)
                                if ranks else load_model(config.model, config.dtype))
        if config.adapters and ranks:
            raise ValueError("LoRA adapters need a replica of one Mac "
                             "(tensor_parallel_size and pipeline_parallel_size 1)")
        self.adapters = AdapterSlots(model, config.adapters, config.max_loaded_adapters) if config.adapters else None
        self.model, self.tokenizer = model, tokenizer
        if hasattr(model, "image_cache"):  # a vision model's (vision/image_cache.py)
            model.image_cache.max_bytes = config.image_cache_bytes
        tree = probe_caches(model)
        self.vocab_size = tree.vocab
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        kv_specs = tree.kv
        drafter_model = load_model_drafter(config, model, tokenizer, draft_model, ranks.group if ranks else None)
        if drafter_model is not None:  # its pool has as many pages as the target's
            weights += drafter_model.weights_bytes
            kv_specs = tree.kv + drafter_model.kv_specs
        budget = ranks.min(kv_budget(weights, config.kv_memory_fraction)) if ranks else \
            kv_budget(weights, config.kv_memory_fraction)
        # Recurrent state: the running sequences' (twice: overlapped steps) and snapshots.
        snapshot_bytes = int(config.state_snapshot_fraction * budget) if tree.states else 0
        self.state_budget_bytes = 2 * config.max_running_requests * tree.state_bytes + snapshot_bytes
        quantization = KVQuantization(config.kv_bits, config.kv_group_size) if config.kv_bits else None
        self.kv_bytes_per_token = kv_bytes_per_token(kv_specs, tree.kv_dtype) if quantization is None else \
            quantized_bytes_per_token(tree.kv, tree.kv_dtype, quantization) + kv_bytes_per_token(
                kv_specs[len(tree.kv):], tree.kv_dtype)  # a drafter's pages stay full precision
        num_pages = pool_pages(self.kv_bytes_per_token, config.page_size, weights, config.kv_memory_fraction,
                               config.max_total_tokens, reserved_bytes=self.state_budget_bytes)
        if ranks:  # every rank schedules alike only with the same pool
            num_pages = ranks.min(num_pages)
        self.pool = KVPool(tree.kv, tree.kv_dtype, num_pages, config.page_size) if quantization is None else \
            QuantizedKVPool(tree.kv, tree.kv_dtype, num_pages, config.page_size, quantization)
        self.pages = PageManager(num_pages, config.page_size)
        self.snapshots = StateSnapshots(tree.state_bytes, snapshot_bytes) if tree.states else None
        if ranks:  # pipeline stages hold different recurrent layers: every rank keeps as many snapshots
            capacity = ranks.min(self.snapshots.capacity if self.snapshots is not None else 1 << 62)
            if self.snapshots is not None:
                self.snapshots.capacity = capacity
        self.batching = probe_batching(model, tree) if config.batching == "auto" else config.batching
        if drafter_model is not None:
            drafter_model = drafter_model.build(num_pages, self.batching)
        eos = set(getattr(tokenizer, "eos_token_ids", None) or []) if tokenizer is not None else set()
        self.budget = StepBudget(config.max_batched_tokens, config.max_token_gap_s, config.min_prefill_tokens,
                                 timed=config.step_budget == "time")
        self.speculator = speculator_for(config.speculative, drafter)
        self.disk = self._disk_tier(config, model, tree, ranks, drafter_model)
        self.scheduler = Scheduler(self.pages, eos, config.max_running_requests, config.max_batched_tokens,
                                   self.snapshots, self.budget, self.speculator, self.disk,
                                   getattr(model, "tower_tokens", None))
        chunk = max(config.max_batched_tokens, getattr(model, "image_block_tokens", 0))  # the longest a chunk gets
        self.activation_bytes = activation_budget(model, chunk, config.max_running_requests, self.vocab_size)
        # The decode batch's copies from the pool run before a step, never beside one: its activation
        # budget.
        staging_bytes = int(config.decode_staging_fraction * budget)
        self.worker = Worker(model, self.pool, tree, self.vocab_size, sorted(eos), staging_bytes, self.snapshots,
                             self.batching,
                             scratch_bytes=self.activation_bytes, adapters=self.adapters, draft=drafter_model)
        self.state_bytes_per_request = tree.state_bytes
        self.admission = Admission(config.request_timeout_s)
        self._sent_coef = None  # the step cost coefficients the followers have
        self._last_finish = 0.0  # when the last step finished (perf_counter)
        self.num_steps = 0
        self.num_failed_steps = 0
        self._grammars = None
        self._parked: List[Tuple[Sequence, float]] = []  # requests waiting for an adapter slot, and when submitted

        self._commands: "queue.Queue[Tuple[str, object]]" = queue.Queue()
        self.outbox = Outbox()
        self.worker.before_device = self.outbox.flush
        self._host_s = 0.0  # engine-thread time per step that is not spent waiting for the device
        self._host_cpu_s = 0.0  # the same span in the thread's CPU time: without the waits for a free core
        self._stats = EngineStats(self._memory_budget(weights))
        self._stats.publish(self)
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._thread.start()
        if ranks:
            threading.Thread(target=self._watch_group, name="mlx-group-watch", daemon=True).start()
        _live_engines.add(self)

    # --- public API ----------------------------------------------------------------
    async def generate(self, request: Request, detokenize: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream outputs until the request finishes: new token ids, and their text when
        the engine has a tokenizer. With n > 1 the samples (`out.index`) interleave; the
        stream ends when all have finished. Closing the iterator early (client gone,
        task cancelled) aborts the request."""
        if self.ranks and not self.ranks.leader:
            raise RuntimeError("a follower rank takes no requests: send them to rank 0")
        params = request.params
        params.check_vocab(self.vocab_size)
        if request.adapter is not None and (self.adapters is None or request.adapter not in self.adapters):
            raise ValueError(f"adapter {request.adapter!r} is not served by this engine")
        if request.images is not None and not self.worker.vision:
            raise ValueError("this model reads no images: serve a vision-language model for them")
        if params.embedding and self.worker.split is None:
            raise ValueError("this model's body and output head cannot be told apart: it serves no embeddings")
        if params.stop and (self.tokenizer is None or not detokenize):
            raise ValueError("stop strings need the engine's tokenizer")
        if params.n == 1:
            async for out in self._generate_one(request, 0, detokenize):
                yield out
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int):
            seed = None if params.seed is None else (params.seed + i) % 2**32
            sub = Request(rid=f"{request.rid}#{i}", prompt_ids=request.prompt_ids, timeout_s=request.timeout_s,
                          adapter=request.adapter, images=request.images,
                          params=params.model_copy(update={"n": 1, "seed": seed}))
            try:
                async for out in self._generate_one(sub, i, detokenize):
                    await merged.put(out)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await merged.put(e)

        tasks = [asyncio.create_task(pump(i)) for i in range(params.n)]
        try:
            done = 0
            while done < params.n:
                out = await merged.get()
                if isinstance(out, BaseException):
                    raise out
                out.rid = request.rid
                done += out.finished
                yield out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_one(self, request: Request, index: int, detokenize: bool) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise RuntimeError("engine loop died") from self._error
        refusal = self.admission.refuse_early(request, self._stats.snapshot)
        if refusal is not None:  # at once, not at the engine loop's next turn
            refusal.index = index
            yield refusal
            return
        matcher = None
        if request.params.structured is not None:
            matcher = self._grammar_compiler().compile(request.params.structured).new_matcher()
        detok = None
        if detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids, request.params.stop)
        sink = self.outbox.open(request.rid)
        self._commands.put(("add", (request, matcher, time.perf_counter())))  # its deadline counts from here
        finished, held = False, None
        try:
            while not finished:
                out, held = merge_ready(held if held is not None else await sink.get(), sink)
                if isinstance(out, BaseException):
                    raise RuntimeError("engine loop died") from out
                out.index = index
                finished = out.finished
                if detok is not None:
                    out.text = detok.add(out.token_ids)
                    if detok.stopped is not None and not finished:
                        self._commands.put(("abort", (request.rid, False)))  # done, not wasted
                        out.finished, out.finish_reason, out.stop_reason = True, "stop", detok.stopped
                        finished = True
                    elif finished and detok.stopped is None:
                        out.text += detok.flush()
                    elif detok.stopped is not None:
                        out.finish_reason, out.stop_reason = "stop", detok.stopped
                yield out
        finally:
            self.outbox.close(request.rid)
            if not finished:
                self.abort(request.rid)

    def abort(self, rid: str) -> None:
        """Stop a request and free its pages (takes effect before the next step); the
        work done for it counts as wasted."""
        self._commands.put(("abort", (rid, True)))

    def _disk_tier(self, config: EngineConfig, model, tree, ranks, drafter):
        """The prefix cache's SSD tier where configured and possible (said in the log where not)."""
        if not config.prefix_cache_dir:
            return None
        disk = open_disk_tier(config.prefix_cache_dir, config.prefix_cache_max_bytes, model, self.pool,
                              config.kv_bits, tree.states,
                              (drafter.weights, drafter.pool) if drafter is not None else None,
                              (ranks.rank, ranks.size) if ranks else None)
        if ranks:  # every rank has the tier, or none uses it
            if ranks.min(int(disk is not None)) == 0:
                if disk is not None:
                    log.warning("prefix_cache_dir is not used: another rank of this replica cannot use it")
                    disk.close()
                return None
            disk.agree = ranks.min
        if disk is not None:
            self.pages.listener = disk.published
            if disk.states is not None:
                self.snapshots.listener = disk.states.taken
        return disk

    def stats(self) -> dict:
        """Load, KV use, cache counters and cached page hashes, as of the last step. A
        snapshot the engine thread publishes after each step: never waits on the device."""
        return self._stats.current(self)

    def _memory_budget(self, weights: int) -> dict:
        """What peak memory should stay within: weights + pool + staging + activations."""
        draft = self.worker.draft
        return {"weights_bytes": weights, "kv_pool_bytes": self.pool.nbytes + (draft.pool.nbytes if draft else 0),
                "recurrent_state_budget_bytes": self.state_budget_bytes,
                "decode_staging_budget_bytes": self.worker.kv.staging.max_bytes,
                "activation_budget_bytes": self.activation_bytes}

    @property
    def error(self) -> Optional[BaseException]:
        """Why the engine loop died, or None while it runs."""
        return self._error

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the engine loop to end (a follower rank's ends when the leader stops)."""
        self._thread.join(timeout)

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("stop", None))
        if self.ranks and not self.ranks.leader:
            self.ranks.channel.close()  # unblocks the loop's wait for the leader
        # A loop blocked on a lost rank's collective never ends: do not wait for it.
        self._thread.join(timeout=1 if isinstance(self._error, RankLost) else 30)
        _wait_os_thread_gone(self._thread)
        if self.disk is not None:  # the pages handed to the writer reach the disk
            self.disk.close()

    # --- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # surface to every waiting caller, never hang them
            if isinstance(e, RankLost) and self._stop.is_set():
                return  # this follower's own shutdown closed the channel
            self.outbox.flush()
            self._fail_all(e)
            raise
        finally:
            if self.ranks:
                self._leave_group()

    def _fail_all(self, error: BaseException) -> None:
        """The engine cannot go on: every waiting caller gets `error`, later ones too."""
        self._error = error
        self.outbox.fail_all(error)

    def _watch_group(self) -> None:
        """A rank that dies mid-step leaves the others blocked in a collective that MLX
        never ends, so the loop cannot notice: this thread does, from the side channel."""
        while not self._stop.wait(GROUP_WATCH_S):
            if self._error is None and self.ranks.channel.peer_gone():
                self._fail_all(RankLost(RANK_LOST))
                return

    def _leave_group(self) -> None:
        """The leader tells the followers' engines to stop (the group may serve a next one);
        a follower whose loop died closes its channel, which the leader's watchdog sees."""
        if self.ranks.leader:
            try:
                self.ranks.channel.send([("stop", None)])
            except Exception:  # noqa: BLE001 - a follower already gone
                pass
        elif self._error is not None:
            self.ranks.channel.close()

    def _loop(self) -> None:
        inflight: deque = deque()
        failures = 0  # consecutive failed steps
        while not self._stop.is_set():
            idle = not inflight and not self.scheduler.has_work() and not self._parked
            self._apply_commands(block=idle)
            t, c = time.perf_counter(), time.thread_time()
            wait, wait_cpu = self.worker.device_s, self.worker.device_cpu_s
            plan, launched = None, False
            try:
                if inflight and self.scheduler.needs_sync():
                    self._finish_oldest(inflight)
                plan = self.scheduler.schedule()
                if plan:
                    inflight.append(self.worker.launch(plan))
                    inflight[-1].launched_at = t
                    if self.disk is not None:  # the pages it publishes, copied out behind it
                        inflight[-1].disk_capture = self.disk.capture(self.pages)
                    launched = True
                    self.num_steps += 1
                self._deliver(self.scheduler.drain_outputs())
                if inflight and (len(inflight) > 1 or not plan or not self.config.overlap):
                    self._finish_oldest(inflight)
                failures = 0
            except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
                if self.ranks and self.ranks.channel.peer_gone():
                    raise RankLost(RANK_LOST) from e
                if self.ranks:  # the others may have run this step (and wait in its collectives)
                    raise RankLost(f"a step failed on rank {self.ranks.rank} ({type(e).__name__}: {e}); "
                                   f"{RANK_LOST}") from e
                failures += 1
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    raise  # not one bad batch: the device or the model is broken
                self._recover(inflight, plan if plan and not launched else None, e)
            if plan:
                self._host_s += time.perf_counter() - t - (self.worker.device_s - wait)
                self._host_cpu_s += time.thread_time() - c - (self.worker.device_cpu_s - wait_cpu)
            if not inflight:  # no device wait ahead to hand the outputs over in
                self.outbox.flush()

    def _recover(self, inflight: deque, unlaunched: Optional[StepPlan], error: Exception) -> None:
        """After a step failed: when it failed while being built, the steps already in
        flight may be sound, so they are finished first (their tokens reach their requests);
        then the failed step's requests, and any step that cannot finish, fail."""
        plans = [unlaunched] if unlaunched else []
        if unlaunched:
            try:
                while inflight:
                    self._finish_oldest(inflight)
            except Exception:  # noqa: BLE001 - they fail with the rest
                pass
        self._fail_steps(plans + [s.plan for s in inflight], error)
        inflight.clear()

    def _fail_steps(self, plans: List[StepPlan], error: Exception) -> None:
        """End every request of `plans` with an error and forget the prefix cache's free
        pages (a failed step may have published pages whose KV it never wrote)."""
        message = f"the engine failed to run this request's step ({type(error).__name__}: {error})"
        seqs = {id(s): s for plan in plans for s in plan.sequences()}
        outputs = [o for s in seqs.values() if (o := self.scheduler.fail(s, message)) is not None]
        self.worker.reset()
        self.pages.reset_prefix_cache()
        self.num_failed_steps += 1
        self._stats.publish(self)
        self._deliver(outputs)

    def _finish_oldest(self, inflight: deque) -> None:
        """Finish the oldest step in flight; it leaves `inflight` only once finished, so
        that a step whose results fail to arrive is failed with the rest (_recover)."""
        self._finish_step(inflight[0])
        inflight.popleft()

    def _finish_step(self, step) -> None:
        tokens = self.worker.finalize(step)
        if step.disk_capture is not None:
            self.disk.save(step.disk_capture)
        now = step.done_at or time.perf_counter()  # steps overlap: this one's time runs from the last one's end
        seconds, plan = now - max(self._last_finish, step.launched_at), step.plan
        self._last_finish = now
        prefill = sum(c.length for c in plan.prefills)
        self.admission.observe(seconds, prefill, plan.decode_like())
        self._stats.step(seconds, plan.decode_like(), prefill)
        if not self.ranks or self.ranks.leader:  # the followers take the leader's fit (_replay_commands)
            self.budget.cost.observe(shape_of([p for _, p in plan.decode], plan.chunks(), plan.verify_rows(),
                                              plan.image_tokens()), seconds)
        outputs = self.scheduler.process(plan, tokens)
        if self.speculator is not None:
            self.speculator.step_done(plan, seconds, measure=not self.ranks or self.ranks.leader)
        self._stats.publish(self)
        self._deliver(outputs)

    def _grammar_compiler(self):
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the engine's tokenizer")
            self._grammars = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size)
        return self._grammars

    def _apply_commands(self, block: bool) -> None:
        """Take in what callers sent (requests, aborts); a follower rank takes what the
        leader took in on the same iteration, which the leader sends it here."""
        if self.ranks and not self.ranks.leader:
            return self._replay_commands()
        self.budget.cost.refit()  # here only: the followers get the same fit before the same schedule
        if self.speculator is not None:
            self.speculator.realized.refresh()  # likewise
        outputs, applied, taken = [], [], 0
        parked, self._parked = self._parked, []
        for seq, submitted in parked:  # waiting for an adapter slot: in arrival order
            if self._parked or not self._take_adapter(seq):
                self._parked.append((seq, submitted))
            elif (out := self._admit(seq, submitted)[0]) is not None:
                outputs.append(out)
        while True:
            try:
                cmd, arg = self._commands.get(block=block and not taken)
            except queue.Empty:
                break
            taken += 1
            out = None
            if cmd == "add":
                seq = Sequence.from_request(arg[0], self.config.page_size)
                seq.matcher = arg[1]
                if not self._take_adapter(seq):
                    self._parked.append((seq, arg[2]))
                    continue
                out, admitted = self._admit(seq, arg[2])
                if not admitted:  # never scheduled: the followers need not know
                    outputs.append(out)
                    continue
                arg = (arg[0], seq.seed)
            elif cmd == "abort":
                out = self.scheduler.abort(*arg)
                self._parked = [(s, t) for s, t in self._parked if s.rid != arg[0]]
            if cmd != "stop":  # followers get theirs when the loop ends (_leave_group)
                applied.append((cmd, arg))
            if out is not None:
                outputs.append(out)
        for out in self.admission.withdraw(self.scheduler):
            outputs.append(out)
            applied.append(("abort", (out.rid, False)))  # the followers hold it too
        urgent = self.budget.at_risk(s for s in self.scheduler.running if s.next_input is not None)
        if self.ranks and urgent != self.budget.urgent:
            applied.append(("urgent", urgent))  # the followers' sequences have no deadlines
        self.budget.urgent = urgent
        if self.ranks:
            coef = self.budget.cost.coef
            if coef is not None and (self._sent_coef is None or (coef != self._sent_coef).any()):
                applied.append(("cost", coef.tolist()))  # every rank sizes steps alike
                self._sent_coef = coef.copy()
            if self.speculator is not None and self.speculator.realized.changed:
                applied.append(("speculation", self.speculator.realized.table()))
            self.ranks.channel.send(applied)
        if taken:  # the figures changed
            self._stats.publish(self)
        self._deliver(outputs)

    def _take_adapter(self, seq: Sequence) -> bool:
        """Put `seq`'s adapter in a slot, loading it if need be; False: every slot is in use
        by requests in flight (it waits for one, parked, in arrival order)."""
        if seq.adapter is None:
            return True
        in_flight = itertools.chain(self.scheduler.running, self.scheduler.waiting)
        slot = self.adapters.acquire(seq.adapter, (s.adapter_slot for s in in_flight))
        seq.adapter_slot = slot or 0
        return slot is not None

    def _admit(self, seq: Sequence, submitted: float) -> Tuple[Optional[RequestOutput], bool]:
        """Admission's answer for `seq` (submitted at perf_counter `submitted`), and whether
        it was taken: its refusal, or the scheduler's output if it rejected it at once."""
        out = self.admission.refuse(seq, self.scheduler)
        if out is not None:
            return out, False
        timeout = self.admission.timeout_of(seq)
        seq.deadline = submitted + timeout if timeout else None
        seq.return_s = RETURN_SHARE * (timeout or 0.0)
        return self.scheduler.add(seq), True

    def _replay_commands(self) -> None:
        applied = self.ranks.channel.recv()
        for cmd, arg in applied:
            if cmd == "add":
                request, seed = arg
                seq = Sequence.from_request(request, self.config.page_size)
                seq.seed = seed
                if request.params.structured is not None:
                    seq.matcher = self._grammar_compiler().compile(request.params.structured).new_matcher()
                self.scheduler.add(seq)
            elif cmd == "abort":
                self.scheduler.abort(*arg)
            elif cmd == "cost":
                self.budget.cost.coef = np.array(arg)
            elif cmd == "urgent":
                self.budget.urgent = arg
            elif cmd == "speculation":
                self.speculator.realized.load(arg)
            elif cmd == "stop":
                self._stop.set()
        if applied:
            self._stats.publish(self)

    def _deliver(self, outputs: List[RequestOutput]) -> None:
        """Outputs for their callers (handed over before the next device wait: Outbox)."""
        for out in outputs:
            if out.finished:
                self.admission.finished(out)
            self.outbox.put(out)


RETURN_SHARE = 0.05  # of a timeout: the hops the engine does not see (ingress to replica before it, and the
# answer's way back to the client after it), which take seconds on a loaded box; withdrawal and decode-only steps
# aim to end this much before the deadline
MAX_CONSECUTIVE_FAILURES = 3  # then the loop dies and the replica reports itself unhealthy
RANK_LOST = "a rank of this engine's group is gone: the group must restart"
GROUP_WATCH_S = 0.5  # how often a rank checks that the others are still there

_live_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    """A script that never called shutdown() must still exit cleanly: an engine thread
    torn down by the interpreter's finalization aborts the process (see below)."""
    for engine in list(_live_engines):
        engine.shutdown()


def _wait_os_thread_gone(thread: threading.Thread, timeout: float = 2.0) -> None:
    """join() returns before the OS thread runs its C++ thread-local destructors; MLX's
    compile cache takes the GIL in one, so an interpreter exiting meanwhile aborts
    ("terminate called without an active exception"). Wait them out (Linux can tell)."""
    if thread.is_alive() or thread.native_id is None:
        return
    task = f"/proc/self/task/{thread.native_id}"
    if not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.001)
