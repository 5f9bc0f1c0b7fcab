"""The replica deployment: one MLX engine per Mac, streaming outputs to the ingress."""

import uuid
from typing import Any, AsyncIterator, Dict, Optional

from ray import serve

from mlx_worker import Engine, EngineConfig, Request, SamplingParams


REPORT_ALL_PAGES = 4096


class EngineReplica:
    """Owns one `mlx_worker.Engine`; `generate` streams its outputs.

    The engine loop runs on its own thread, so this actor's event loop stays free to
    accept requests, stream and answer health checks. Cancelling the stream (client
    gone) aborts the request in the engine and frees its KV pages.
    """

    def __init__(self, engine_config: Dict[str, Any]):
        self.engine = Engine(EngineConfig(**engine_config))
        self.engine_id = uuid.uuid4().hex[:12]  # changes when the replica restarts

    async def generate(self, request: Dict[str, Any]) -> AsyncIterator[Any]:
        """request: {"rid", "prompt_ids", "params": SamplingParams dict, "page_hashes"}."""
        req = Request(rid=request["rid"], prompt_ids=request["prompt_ids"],
                      params=SamplingParams(**request["params"]))
        try:
            async for out in self.engine.generate(req):
                yield out
        except ValueError as e:  # bad params the ingress could not check (e.g. vocab ids)
            yield {"error": str(e), "status": 400}

    def stats(self) -> Dict[str, Any]:
        st = self.engine.stats()
        st.pop("cached_page_hashes")
        return {"engine_id": self.engine_id, **st}

    def record_routing_stats(self) -> Dict[str, Any]:
        """Load and cached pages, for the prefix-affinity router.

        Past REPORT_ALL_PAGES hashes only a deterministic quarter is sent (about 40 KiB
        per 4k pages otherwise, every second): each hash names its whole prefix, so the
        router still finds the deepest cached page of a prompt within 3 pages.
        """
        st = self.engine.stats()
        hashes = st["cached_page_hashes"]
        if len(hashes) > REPORT_ALL_PAGES:
            hashes = [h for h in hashes if h % 4 == 0]
        return {
            "engine_id": self.engine_id,
            "page_size": st["page_size"],
            "running": st["running"],
            "waiting": st["waiting"],
            "kv_used": st["kv_pages_used"] / max(1, st["kv_pages_total"]),
            "cached_page_hashes": hashes,
        }

    def check_health(self) -> None:
        if self.engine.error is not None:
            raise RuntimeError(f"engine loop died: {self.engine.error!r}")

    def __del__(self):
        engine: Optional[Engine] = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


MLXReplica = serve.deployment(EngineReplica, name="MLXReplica")
