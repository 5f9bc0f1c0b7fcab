"""macfarm's MLX serving engine: paged KV pool, prefix cache, continuous batching."""

from ._blas import preload_openblas

preload_openblas()  # before mlx loads, so its BLAS calls bind to OpenBLAS on Linux

from .engine import Engine, EngineConfig  # noqa: E402
from .memory.paging import PAGE_SIZE, page_hashes  # noqa: E402
from .request import Request, RequestOutput  # noqa: E402
from .sampling.sampler import SamplingParams  # noqa: E402

__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput", "SamplingParams", "PAGE_SIZE", "page_hashes"]
