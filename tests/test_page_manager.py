"""Page ownership and page hashes, without a model."""

from mlx_worker.memory.page_manager import PageManager
from mlx_worker.memory.paging import page_hashes


def test_page_hashes_chain_whole_pages_only():
    a = page_hashes(range(40), 16)
    assert len(a) == 2  # the partial third page has no hash
    b = page_hashes(list(range(32)) + [99] * 8, 16)
    assert a == b
    c = page_hashes([1] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in page 0 changes every later hash
    assert page_hashes(range(16, 32), 16, parent=a[0]) == [a[1]]
    assert all(0 <= h < 2**63 for h in a)


def test_refcounts_publish_match_release():
    pm = PageManager(4, 16)
    pages = pm.allocate(2)
    hs = page_hashes(range(32), 16)
    for p, h in zip(pages, hs):
        assert pm.publish(p, h)
    assert not pm.publish(pages[0], hs[0])
    got = pm.match(hs + [12345], num_tokens=40)
    assert got == pages and [pm.refs[p] for p in pages] == [2, 2]
    assert pm.hit_tokens == 32 and pm.query_tokens == 40
    pm.release(pages)
    pm.release(got)
    assert pm.used() == 0 and len(pm.lru) == 2 and len(pm.free) == 2
    assert pm.match(hs, 32) == pages  # still cached after release
    pm.release(pages)


def test_eviction_takes_unreferenced_leaves_first():
    pm = PageManager(3, 16)
    pages = pm.allocate(3)
    hs = page_hashes(range(48), 16)
    for p, h in zip(pages, hs):
        pm.publish(p, h)
    pm.release(pages)
    assert pm.available() == 3
    first = pm.allocate(1)
    assert first == [pages[2]] and pm.evictions == 1  # the leaf went first
    assert pm.match(hs, 48) == pages[:2]


def test_pages_in_use_are_never_evicted():
    pm = PageManager(2, 16)
    held = pm.allocate(1)
    pm.publish(held[0], 7)
    assert pm.allocate(2) is None
    assert pm.allocate(1) is not None
    assert pm.allocate(1) is None
    assert pm.page_of[7] == held[0]
