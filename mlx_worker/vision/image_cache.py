"""Recently encoded images' features by image hash (bounded, least recently used first
out), so that an image sent again is not encoded again: in a new conversation, after its
pages were evicted, or past a prefix that changed."""

from collections import OrderedDict
from typing import List, Optional

import mlx.core as mx


class ImageCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[str, mx.array]" = OrderedDict()
        self.bytes = 0
        self.hits = self.encoded = 0

    def get(self, hashes: List[str]) -> List[Optional[mx.array]]:
        out = []
        for h in hashes:
            f = self.entries.get(h)
            if f is not None:
                self.entries.move_to_end(h)
                self.hits += 1
            out.append(f)
        return out

    def holds(self, h: str) -> bool:
        return h in self.entries

    def put(self, h: str, features: mx.array) -> None:
        self.encoded += 1
        if h in self.entries or features.nbytes > self.max_bytes:
            return
        self.entries[h] = features
        self.bytes += features.nbytes
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes

    def stats(self) -> dict:
        return {"cached_images": len(self.entries), "cached_bytes": self.bytes, "max_bytes": self.max_bytes,
                "image_hits": self.hits, "images_encoded": self.encoded}
