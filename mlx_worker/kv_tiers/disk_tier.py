"""The prefix cache's SSD tier (`engine.prefix_cache_dir`).

Every page the prefix cache publishes is copied out of the pool by the step after (a
lazy gather that runs on the device behind that step), and once that step is done a
writer thread files it (page_files.py): the engine step never waits for the disk. A
request's pages on disk are read by reader threads from the moment it arrives; when it
is admitted, the pages its prefix has on disk past those in memory are written back
into the pool instead of being recomputed, and count as cached tokens. A model with
recurrent layers files its state snapshots too (disk_states.py), and reads pages back
only as far as a snapshot it can resume from.
"""

import hashlib
import itertools
import logging
import os
import queue
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..memory.kv_pool import KVPool
from ..memory.model_caches import StateSpec
from ..memory.page_manager import PageManager
from ..memory.recurrent_state import RowState
from ..memory.state_snapshots import StateSnapshots
from .disk_states import DiskStates, state_layout
from .page_files import PageFiles, host_view, namespace, numpy_dtype

log = logging.getLogger(__name__)

READ_RUN = 32  # pages a reader thread reads in one task
MAX_QUEUED_BYTES = 1 << 30  # copies waiting for the writer; beyond this, pages go unsaved
KNOWN = 1 << 20  # hashes remembered as on disk (never copied out again)
RESCAN_S = 30.0  # the directory is listed again this often: what the Mac's other replicas filed


class Capture:
    """Copies of pages published (and state snapshots taken) since the last step, and the
    hashes they are filed under."""

    def __init__(self, hashes: List[int], arrays: List[mx.array], state_hashes: List[int],
                 states: List[List[mx.array]]):
        self.hashes, self.arrays = hashes, arrays
        self.state_hashes, self.states = state_hashes, states


class PageArrays:
    """The arrays that hold a page's KV, one file's worth: the model's pool's and, where a
    drafter keeps KV of its own on the same pages (a draft model, MTP heads:
    speculative/), its pool's, so a page read back serves the drafter too."""

    def __init__(self, pools: Sequence[KVPool]):
        self.pools = list(pools)
        self.page_size = self.pools[0].page_size

    def arrays(self) -> List[mx.array]:
        return [a for pool in self.pools for a in pool.arrays()]


class DiskTier:
    def __init__(self, pool: PageArrays, files: PageFiles, max_bytes: int, readers: int = 4,
                 states: Optional[DiskStates] = None):
        self.pool = pool
        self.files = files
        self.states = states  # a model with recurrent layers: its state snapshots
        self.max_bytes = max_bytes
        self.page_bytes = files.file_bytes
        self._pending: List[Tuple[int, int]] = []  # (page, hash) published, not yet copied out
        self._known: "OrderedDict[int, None]" = OrderedDict()  # hashes on disk, by this tier's account
        self._news: deque = deque()  # from the writer thread: (hash, on disk?) for _known
        self._queue: "queue.Queue" = queue.Queue()
        self._queued_bytes = 0  # updated by both threads: under _lock
        self._lock = threading.Lock()
        self._reads = ThreadPoolExecutor(readers, thread_name_prefix="kv-disk-read")
        self.pages_written = self.pages_loaded = self.pages_skipped = self.write_errors = 0
        self.hit_tokens = 0
        self.bytes_on_disk = 0
        # A replica over several Macs: each rank files its share of every page on its own
        # Mac; a prefix is read back only as far as every rank has it (the group's min).
        self.agree: Callable[[int], int] = lambda n: n
        self.rescan_s = RESCAN_S
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-write", daemon=True)
        self._writer.start()

    # --- writing ---------------------------------------------------------------
    def published(self, page: int, h: int) -> None:
        """The prefix cache published `page` under `h` (PageManager's listener)."""
        if h not in self._known:
            self._pending.append((page, h))

    def capture(self, pages: PageManager) -> Optional[Capture]:
        """Copy out (lazily, dispatched now, behind the step just launched) the pages
        published since the last capture that still hold their hash."""
        self._take_news()
        keep = [(p, h) for p, h in self._pending if pages.hash_of.get(p) == h]
        self._pending = []
        state_hashes, states = self.states.capture() if self.states is not None else ([], [])
        if not keep and not states:
            return None
        if self._queued_bytes + self._bytes(keep, states) > MAX_QUEUED_BYTES:
            self.pages_skipped += len(keep)  # the disk is behind: these stay in memory only
            return None
        arrays = []
        if keep:
            P = self.pool.page_size
            slots = mx.array((np.array([p for p, _ in keep])[:, None] * P + np.arange(P)).reshape(-1).astype(np.int32))
            arrays = [host_view(a[:, slots]) for a in self.pool.arrays()]
        mx.async_eval(*arrays, *[a for s in states for a in s])
        for _, h in keep:
            self._remember(h)
        return Capture([h for _, h in keep], arrays, state_hashes, states)

    def _bytes(self, pages: list, states: list) -> int:
        return len(pages) * self.page_bytes + (len(states) * self.states.nbytes if states else 0)

    def save(self, capture: Capture) -> None:
        """Hand a capture to the writer once the step that computed its pages is done."""
        host = [np.array(a) for a in capture.arrays]
        states = [[np.array(a) for a in s] for s in capture.states]
        with self._lock:
            self._queued_bytes += self._bytes(capture.hashes, states)
        self._queue.put((capture.hashes, host, capture.state_hashes, states))

    def _scan(self) -> None:
        """List the directory: the pages a restart finds, and later those the Mac's other
        replicas filed (for the router's report); evict past the bound."""
        try:
            self.bytes_on_disk = self.files.evict(self.max_bytes)
            self._news.extend((h, True) for h in self.files.hashes() if h not in self._known)
            if self.states is not None:
                self.states.found(self.states.files.hashes())
        except OSError as e:
            log.warning("prefix cache: cannot scan %s (%s)", self.files.root, e)

    def _write_loop(self) -> None:
        self._scan()
        P = self.pool.page_size
        while True:
            try:
                item = self._queue.get(timeout=self.rescan_s)
            except queue.Empty:
                self._scan()
                continue
            if item is None:
                return
            if isinstance(item, threading.Event):  # flush()
                item.set()
                continue
            hashes, host, state_hashes, states = item
            for i, h in enumerate(hashes):
                written = self._write(lambda: self.files.write(h, [a[:, i * P : (i + 1) * P] for a in host]))
                if written:
                    self.pages_written += 1
                    self.bytes_on_disk += self.page_bytes
                elif written is None:
                    self._news.append((h, False))
            for h, arrays in zip(state_hashes, states):
                if self._write(lambda: self.states.write(h, arrays)):
                    self.bytes_on_disk += self.states.nbytes
            with self._lock:
                self._queued_bytes -= self._bytes(hashes, states)
            if self.bytes_on_disk > self.max_bytes:
                try:
                    self.bytes_on_disk = self.files.evict(self.max_bytes)
                except OSError as e:
                    log.warning("prefix cache: eviction failed (%s)", e)

    def _write(self, write) -> Optional[bool]:
        """Run one file's write: True if written, False if it was there already, None if it
        failed (a full or failing disk: what it held stays in memory only)."""
        try:
            return write()
        except OSError as e:
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 1000 == 0:
                log.warning("prefix cache: writing a file failed (%s); %d failures so far", e, self.write_errors)
            return None

    def _take_news(self) -> None:
        while self._news:
            h, on_disk = self._news.popleft()
            if on_disk:
                self._remember(h)
            else:
                self._known.pop(h, None)

    def hashes(self, limit: int = 65536) -> List[int]:
        """The newest `limit` pages on disk by this tier's account (those it wrote or read,
        and those it found at start), oldest first: for the router. On the engine thread."""
        self._take_news()
        if self.states is not None:  # a model with recurrent layers resumes only at a snapshot
            return self.states.hashes(limit)
        return list(itertools.islice(reversed(self._known), limit))[::-1]

    def _remember(self, h: int) -> None:
        self._known[h] = None
        if len(self._known) > KNOWN:
            self._known.popitem(last=False)

    def flush(self, timeout: float = 30) -> None:
        """Wait until every page handed so far is written."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(30)
        self._reads.shutdown(wait=False, cancel_futures=True)

    # --- reading ---------------------------------------------------------------
    def prefetch(self, hashes: Sequence[int], start: int) -> Tuple[int, List[Future]]:
        """Start reading the pages of `hashes` from index `start` (those past the ones in
        memory now) that are on disk, in order, in runs of READ_RUN."""
        depth = start
        while depth < len(hashes) and self.files.has(hashes[depth]):
            depth += 1
        runs = [hashes[i : min(i + READ_RUN, depth)] for i in range(start, depth, READ_RUN)]
        return start, [self._reads.submit(self._read_run, run) for run in runs]

    def _read_run(self, hashes: Sequence[int]) -> List[List[np.ndarray]]:
        out = []
        for h in hashes:
            arrays = self.files.read(h)
            if arrays is None:  # gone or damaged (deleted): to be written again when computed
                self._news.append((h, False))
                break
            out.append(arrays)
        return out

    def take(self, pages: PageManager, hashes: Sequence[int], start: int, reads=None,
             count: bool = True) -> List[int]:
        """Pool pages for hashes[start:] that are on disk, consecutive, loaded into the
        pool (writes dispatched with the next forward) and published; [] when none are
        or the pool has no room. `reads`: the request's prefetch."""
        if reads is None or reads[0] > start:  # nothing read yet, or memory lost pages since
            reads = self.prefetch(hashes, start)
        first, futures = reads
        data: List[List[np.ndarray]] = []
        for f in futures:
            run = f.result()
            data += run
            if len(run) < READ_RUN:
                break
        self._take_news()
        data = data[start - first : len(hashes) - first]  # the prefetch may have read further
        data = data[: self.agree(len(data))]
        if not data:
            return []
        new = pages.allocate(min(len(data), pages.available()))
        if not new:
            return []
        self.load(new, data)
        for page, h in zip(new, hashes[start : start + len(new)]):
            self._remember(h)
            pages.publish(page, h)
        self.pages_loaded += len(new)
        if count:
            self.hit_tokens += len(new) * pages.page_size
            pages.hit_tokens += len(new) * pages.page_size
        return new

    def deepest_snapshot(self, hashes: Sequence[int], cached: int, above: int,
                         snapshots: StateSnapshots) -> Optional[Tuple[int, RowState]]:
        """For a model with recurrent layers: the deepest k > `above` such that the first k
        pages of `hashes` are in memory (the first `cached`) or on disk, and the state
        after them is a snapshot in memory or on disk; (k, that state), or None."""
        top = cached
        while top < len(hashes) and self.files.has(hashes[top]):
            top += 1
        k = top
        while k > above:
            # Over several Macs every rank resumes at the same k: the deepest each lists,
            # agreed (memory snapshots are alike on every rank, files may not be).
            k = self.agree(next((j for j in range(k, above, -1)
                                 if hashes[j - 1] in snapshots or self.states.has(hashes[j - 1])), above))
            if k <= above:
                return None
            h = hashes[k - 1]
            if h in snapshots:
                return k, snapshots.take(h)
            state = self.states.read(h)
            if self.agree(int(state is not None)):
                return k, state
            k -= 1
        return None

    def load(self, new: List[int], data: List[List[np.ndarray]]) -> None:
        P = self.pool.page_size
        slots = mx.array((np.array(new)[:, None] * P + np.arange(P)).reshape(-1).astype(np.int32))
        for j, a in enumerate(self.pool.arrays()):
            if a.size:
                a[:, slots] = mx.array(np.concatenate([d[j] for d in data], axis=1)).view(a.dtype)

    def stats(self) -> dict:
        return {"dir": str(self.files.dir), "hit_tokens": self.hit_tokens, "pages_loaded": self.pages_loaded,
                "pages_written": self.pages_written, "pages_not_saved": self.pages_skipped,
                "write_errors": self.write_errors, "damaged_pages": self.files.num_corrupt,
                **({"states_written": self.states.written, "states_loaded": self.states.loaded,
                    "damaged_states": self.states.files.num_corrupt} if self.states is not None else {}),
                "bytes": self.bytes_on_disk, "max_bytes": self.max_bytes}


def page_layout(pool: PageArrays) -> List[Tuple[tuple, np.dtype]]:
    """(shape, NumPy dtype) of each pool array's share of one page."""
    return [((a.shape[0], pool.page_size, a.shape[2]), numpy_dtype(a.dtype)) for a in pool.arrays()]


def model_fingerprint(model) -> str:
    """Names, shapes, dtypes and the first values of every weight (LoRA slots aside):
    another checkpoint, even of the same architecture, gets another namespace."""
    m = hashlib.blake2b(digest_size=16)
    for name, v in tree_flatten(model.parameters()):
        if "lora" in name:
            continue
        m.update(f"{name}:{v.shape}:{v.dtype}".encode())
        head = v.reshape(-1)[:16]
        m.update(np.array(head.astype(mx.float32) if mx.issubdtype(head.dtype, mx.floating) else head).tobytes())
    return m.hexdigest()


def open_disk_tier(directory: str, max_bytes: int, model, pool: KVPool, kv_bits: Optional[int],
                   state_specs: Sequence[StateSpec] = (), drafter=None, rank: Optional[Tuple[int, int]] = None):
    """The tier over `directory` for this model and pool (and recurrent layers' states;
    `drafter`: a draft model's or MTP head's KV on the same pages, as (its weights, its
    pool); `rank`: (rank, size) of a replica over several Macs, whose shard this is), or
    None when the directory cannot be used (said in the log: the engine serves without it)."""
    pool = PageArrays([pool] + ([drafter[1]] if drafter else []))
    layout = page_layout(pool)
    key = {"model": model_fingerprint(model), "page_size": pool.page_size, "kv_bits": kv_bits,
           "layout": [(shape, d.str) for shape, d in layout],
           **({"drafter": model_fingerprint(drafter[0])} if drafter else {}),
           **({"rank": list(rank)} if rank else {})}
    root = os.path.expanduser(directory)
    try:
        files = PageFiles(root, namespace(key), layout)
        states = None
        if state_specs:
            slayout = state_layout(state_specs)
            space = namespace({**key, "states": [(shape, d.str) for shape, d in slayout]})
            states = DiskStates(PageFiles(root, space, slayout), state_specs)
    except OSError as e:
        log.error("prefix cache: %s cannot be used (%s); serving without the SSD tier", directory, e)
        return None
    return DiskTier(pool, files, max_bytes, states=states)
