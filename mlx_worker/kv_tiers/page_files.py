"""KV pages as files: one file a page, named by its chained hash, in a directory of its
own for each model and pool layout (the namespace), checksummed.

    <dir>/<namespace>/<hash[:2]>/<hash>.kv      header (magic, page hash, payload length,
                                                  blake2b of the payload) + payload

The payload is the page's slots of every pool array in order, raw. A file is written
under a temporary name and renamed, so a reader never sees a torn one under its final
name; one that is truncated, damaged or tampered with fails its check, is deleted and
is recomputed. Replicas of one Mac may share the directory: each writes whole files
atomically and reads only what passes the check.
"""

import hashlib
import logging
import os
import struct
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"MFKVPG01"
HEADER = struct.Struct("<8sqQ16s")  # magic, page hash, payload bytes, blake2b-128 of the payload
STALE_TMP_S = 600  # a temporary file this old was left by a writer that died


def host_view(a: mx.array) -> mx.array:
    """bfloat16 has no NumPy dtype: its bits go to disk as uint16."""
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a


def numpy_dtype(dtype) -> np.dtype:
    """The NumPy dtype an MLX dtype is filed as (bfloat16 has none: its bits, as uint16)."""
    name = str(dtype).split(".")[-1]
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def namespace(fingerprint: dict) -> str:
    """The directory name of one model and pool layout (any change gives another)."""
    text = repr(sorted(fingerprint.items())).encode()
    return hashlib.blake2b(text, digest_size=8).hexdigest()


class PageFiles:
    """The pages of one namespace under `root`, `layout` the (shape, dtype) of each pool
    array's share of one page."""

    def __init__(self, root: str, space: str, layout: Sequence[Tuple[tuple, np.dtype]]):
        self.root = Path(root)
        self.dir = self.root / space
        self.layout = [(tuple(shape), np.dtype(dtype)) for shape, dtype in layout]
        self.payload_bytes = sum(int(np.prod(s)) * d.itemsize for s, d in self.layout)
        self.file_bytes = HEADER.size + self.payload_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self.num_corrupt = 0

    def path(self, h: int) -> Path:
        name = f"{h:016x}"
        return self.dir / name[:2] / f"{name}.kv"

    def has(self, h: int) -> bool:
        return self.path(h).is_file()

    def write(self, h: int, arrays: Sequence[np.ndarray]) -> bool:
        """Store one page (`arrays` as `layout` says); False if it was there already."""
        path = self.path(h)
        if path.is_file():
            return False
        payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        assert len(payload) == self.payload_bytes, "a page's arrays do not match the layout"
        header = HEADER.pack(MAGIC, h, len(payload), hashlib.blake2b(payload, digest_size=16).digest())
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return True

    def read(self, h: int) -> Optional[List[np.ndarray]]:
        """One page's arrays; None when it is absent, or damaged (then deleted)."""
        path = self.path(h)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except OSError:
            return None
        arrays = self._parse(h, data)
        if arrays is None:
            self.num_corrupt += 1
            log.warning("prefix cache: %s is damaged; it is deleted and the page recomputed", path)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return arrays

    def _parse(self, h: int, data: bytes) -> Optional[List[np.ndarray]]:
        if len(data) != self.file_bytes:
            return None
        magic, stored, size, digest = HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER.size :]
        if magic != MAGIC or stored != h or size != self.payload_bytes:
            return None
        if hashlib.blake2b(payload, digest_size=16).digest() != digest:
            return None
        arrays, at = [], 0
        for shape, dtype in self.layout:
            n = int(np.prod(shape)) * dtype.itemsize
            arrays.append(np.frombuffer(payload[at : at + n], dtype).reshape(shape))
            at += n
        return arrays

    def files(self) -> List[Tuple[float, int, Path]]:
        """(mtime, bytes, path) of every page file under the root, any namespace; stale
        temporary files are deleted on the way, unreadable entries skipped."""
        out, now = [], time.time()
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = Path(dirpath) / name
                try:
                    st = path.stat()
                except OSError:
                    continue
                if name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_S:
                        _unlink(path)
                elif name.endswith(".kv"):
                    out.append((st.st_mtime, st.st_size, path))
        return out

    def hashes(self) -> List[int]:
        """The page hashes this namespace holds, by file name (unchecked)."""
        out = []
        for _, _, names in os.walk(self.dir):
            for name in names:
                if name.endswith(".kv") and len(name) == 19:
                    try:
                        out.append(int(name[:16], 16))
                    except ValueError:
                        pass
        return out

    def evict(self, max_bytes: int) -> int:
        """Delete the least recently used files until the root holds at most 90% of
        `max_bytes`; the bytes it holds then."""
        files = sorted(self.files())
        total = sum(size for _, size, _ in files)
        if total <= max_bytes:
            return total
        for _, size, path in files:
            if total <= 0.9 * max_bytes:
                break
            if _unlink(path):
                total -= size
        return total


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
