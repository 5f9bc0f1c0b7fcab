"""Outputs on their way from the engine thread to their callers' event loops."""

import asyncio
import contextlib
from typing import Dict, Tuple

from .request import RequestOutput


class Outbox:
    """Each request's sink (its caller's event loop and queue). The engine thread puts
    outputs here and they are handed over in one call per loop (`flush`), just before
    the thread next waits for the device: waking a loop earlier would have its consumers
    compete for the GIL with the building of the next step, which then reaches the device
    later."""

    def __init__(self):
        self.sinks: Dict[str, Tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._held: Dict[asyncio.AbstractEventLoop, list] = {}  # outputs not yet handed to their loops

    def open(self, rid: str) -> asyncio.Queue:
        """The sink of a request whose caller runs in the current event loop."""
        sink: asyncio.Queue = asyncio.Queue()
        self.sinks[rid] = (asyncio.get_running_loop(), sink)
        return sink

    def close(self, rid: str) -> None:
        self.sinks.pop(rid, None)

    def put(self, out: RequestOutput) -> None:
        target = self.sinks.get(out.rid)
        if target is not None:
            self._held.setdefault(target[0], []).append((target[1], out))

    def flush(self) -> None:
        held, self._held = self._held, {}
        for loop, items in held.items():
            with contextlib.suppress(RuntimeError):  # that caller's event loop is closed
                loop.call_soon_threadsafe(_put_all, items)

    def fail_all(self, error: BaseException) -> None:
        """Every waiting caller gets `error`."""
        for loop, sink in list(self.sinks.values()):
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(sink.put_nowait, error)


def merge_ready(out, sink: asyncio.Queue):
    """Fold outputs already waiting behind `out` into it: a slow consumer (e.g. one Ray
    object per item) then gets several tokens per item instead of falling behind. An
    error is never folded into tokens (their stream must start before it fails): it is
    returned as the next item to take, with the merged output."""
    while not isinstance(out, BaseException) and not out.finished and not sink.empty():
        nxt = sink.get_nowait()
        if isinstance(nxt, BaseException) or (nxt.finish_reason == "error" and out.token_ids):
            return out, nxt
        out.token_ids = out.token_ids + nxt.token_ids
        if out.logprobs is not None or nxt.logprobs is not None:
            out.logprobs = (out.logprobs or []) + (nxt.logprobs or [])
        if out.top_logprobs is not None or nxt.top_logprobs is not None:
            out.top_logprobs = (out.top_logprobs or []) + (nxt.top_logprobs or [])
        out.finished, out.finish_reason, out.error, out.error_code = nxt.finished, nxt.finish_reason, nxt.error, nxt.error_code
        out.stop_reason, out.num_output_tokens = nxt.stop_reason, nxt.num_output_tokens
    return out, None


def _put_all(items) -> None:
    for sink, out in items:
        sink.put_nowait(out)
