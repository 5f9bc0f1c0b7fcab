"""Use Debian's OpenBLAS under MLX's Linux CPU wheel (about 30x the bundled BLAS)."""

import ctypes
import os
import platform
import sys
import warnings

# OpenBLAS workers spin 2^n cycles waiting for work before sleeping; the default
# (n=28, ~0.1 s) keeps a core busy long after each step, starving Serve's proxy and
# ingress on the same machine. 2^20 cycles (<1 ms) still spans the gaps inside a forward.
THREAD_TIMEOUT = "20"

_CANDIDATES = [
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
]


def preload_openblas() -> bool:
    """Load OpenBLAS globally before MLX so MLX's BLAS calls bind to it.

    A no-op off Linux, when MLX is already imported, or when MACFARM_NO_OPENBLAS is set.
    """
    if sys.platform != "linux" or os.environ.get("MACFARM_NO_OPENBLAS"):
        return False
    if "mlx.core" in sys.modules:
        if "openblas" not in os.environ.get("LD_PRELOAD", ""):
            warnings.warn("mlx was imported before mlx_worker: MLX keeps its slow reference BLAS; "
                          "import mlx_worker first or set LD_PRELOAD to OpenBLAS", stacklevel=3)
        return False
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)  # read when the library loads
    for path in _CANDIDATES:
        path = path.format(arch=platform.machine())
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    return False
