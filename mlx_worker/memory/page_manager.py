"""Page ownership: free list, refcounts, and the prefix cache (hash -> page, LRU)."""

from collections import OrderedDict, deque
from typing import Dict, List, Optional


class PageManager:
    """Tracks which KV pages are free, in use, or cached for reuse.

    A page is cached when it is full and its chained hash (see `paging.page_hashes`) is
    published: a later prompt with the same prefix takes it with `match` instead of
    recomputing it. Pages in use are never evicted; cached pages nobody holds sit in an
    LRU and are evicted, leaves before their parents, when the free list runs dry.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.refs = [0] * num_pages
        self.free: deque = deque(range(num_pages))
        self.page_of: Dict[int, int] = {}  # hash -> page
        self.hash_of: Dict[int, int] = {}  # page -> hash
        self.lru: "OrderedDict[int, None]" = OrderedDict()  # cached, unreferenced
        self.hit_tokens = 0
        self.query_tokens = 0
        self.evictions = 0
        self.version = 0  # changes whenever the set of cached hashes does
        self.listener = None  # called with (page, hash) on each publish (the SSD tier copies the page out)

    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def used(self) -> int:
        return self.num_pages - self.available()

    def allocate(self, n: int) -> Optional[List[int]]:
        """n pages with refcount 1, evicting cached pages if needed; None if impossible."""
        if n > self.available():
            return None
        pages = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.lru.popitem(last=False)
                del self.page_of[self.hash_of.pop(page)]
                self.evictions += 1
                self.version += 1
            self.refs[page] = 1
            pages.append(page)
        return pages

    def match(self, hashes: List[int], num_tokens: int, count: bool = True) -> List[int]:
        """Take (refcount +1) the cached pages for the longest prefix of `hashes`."""
        pages = []
        for h in hashes:
            page = self.page_of.get(h)
            if page is None:
                break
            if self.refs[page] == 0:
                del self.lru[page]
            self.refs[page] += 1
            pages.append(page)
        if count:
            self.hit_tokens += len(pages) * self.page_size
            self.query_tokens += num_tokens
        return pages

    def cached_depth(self, hashes: List[int]) -> int:
        """How many leading pages of `hashes` are cached."""
        return next((i for i, h in enumerate(hashes) if h not in self.page_of), len(hashes))

    def publish(self, page: int, h: int) -> bool:
        """Make a full, computed page findable by its hash. False if the hash is taken."""
        if h in self.page_of or page in self.hash_of:
            return False
        self.page_of[h] = page
        self.hash_of[page] = h
        self.version += 1
        if self.listener is not None:
            self.listener(page, h)
        return True

    def release(self, pages: List[int]) -> None:
        """Drop one reference to each page; unreferenced pages become cached or free."""
        for page in reversed(pages):  # leaves first, so they are evicted before parents
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released twice"
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self.lru[page] = None
                else:
                    self.free.append(page)

    def cached_hashes(self) -> List[int]:
        return list(self.page_of)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page nobody holds (pages in use keep their hashes)."""
        for page in self.lru:
            del self.page_of[self.hash_of.pop(page)]
            self.free.append(page)
        self.lru.clear()
        self.version += 1
