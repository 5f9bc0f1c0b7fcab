"""Page size and page hashes, shared by the KV pool, the prefix cache and the router."""

import hashlib
from typing import Iterable, List, Optional, Sequence

import numpy as np

PAGE_SIZE = 16


def page_hashes(
    tokens: Iterable[int], page_size: int = PAGE_SIZE, parent: Optional[int] = None, salts: Sequence[bytes] = ()
) -> List[int]:
    """Chained 64-bit hashes of each whole page of `tokens`.

    Hash i covers tokens[: (i + 1) * page_size]: it mixes the hash of page i - 1 with
    the ids of page i, so equal hashes mean equal prefixes. `parent` continues a chain;
    `salts[i]`, where given, is mixed into page i's (the hashes of the images it shows).
    """
    ids = np.asarray(list(tokens), dtype=np.int64)
    out = []
    h = parent
    for start in range(0, len(ids) - page_size + 1, page_size):
        m = hashlib.blake2b(digest_size=8)
        if h is not None:
            m.update(h.to_bytes(8, "little"))
        m.update(ids[start : start + page_size].tobytes())
        if start // page_size < len(salts):
            m.update(salts[start // page_size])
        h = int.from_bytes(m.digest(), "little") >> 1  # fits a signed int64
        out.append(h)
    return out


def adapter_root(adapter: Optional[str]) -> Optional[int]:
    """The `parent` that starts the page hash chain of a prompt under a LoRA adapter (None:
    the base model): a page computed under one adapter never matches another's."""
    if not adapter:
        return None
    return int.from_bytes(hashlib.blake2b(b"adapter:" + adapter.encode(), digest_size=8).digest(), "little") >> 1
