"""The prefix cache's SSD tier (`engine.prefix_cache_dir`): pages computed by one engine
are on disk soon after, without a shutdown, and another engine (a restart, or a second
replica of the Mac beside it) reads them back as cached tokens with mlx-lm's greedy
tokens; pages evicted from memory come back from disk; a damaged file is never served;
another model never reads these pages; a draft model's KV goes to disk with the pages;
quantized pages go to disk as they are; a directory that cannot be used, or a disk whose
writes fail, loses nothing; a hybrid model's state snapshots go to disk and a restart
resumes from them."""

import random
import time
from pathlib import Path

import pytest
from conftest import reference_greedy, run_requests
from test_kv_quantization import quantized_reference
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig

N = 8
PAGE = 16


def prompt(seed, n=200):
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def engine(model, directory, draft_model=None, **kw):
    kw.setdefault("max_total_tokens", 1024)
    return Engine(EngineConfig(prefix_cache_dir=str(directory), **kw), model=model, draft_model=draft_model)


def written(eng, pages, timeout=30):
    """Wait (no flush, no shutdown: as if the process were killed next) until the writer
    has filed `pages` pages."""
    deadline = time.time() + timeout
    while eng.stats()["prefix_cache_disk"]["pages_written"] < pages:
        assert time.time() < deadline, eng.stats()["prefix_cache_disk"]
        time.sleep(0.05)


def page_files(directory):
    return sorted(Path(directory).rglob("*.kv"))


def test_pages_reach_the_disk_soon_and_a_second_engine_reads_them(model, tmp_path):
    p = prompt(0)
    first = engine(model, tmp_path)
    try:
        (toks, last), = run_requests(first, [p], N)
        assert toks == reference_greedy(model, p, N) and last.num_cached_tokens == 0
        written(first, 12)  # the prompt's 12 full pages (its last token is never cached)
        # The first engine still runs (a replica beside it, or one about to be killed).
        second = engine(model, tmp_path)
        try:
            (again, last), = run_requests(second, [p], N)
            assert again == toks and last.num_cached_tokens == 12 * PAGE
            disk = second.stats()["prefix_cache_disk"]
            assert disk["hit_tokens"] == 12 * PAGE and disk["pages_loaded"] == 12 and disk["pages_written"] == 0
        finally:
            second.shutdown()
    finally:
        first.shutdown()


def test_pages_evicted_from_memory_come_back_from_disk(model, tmp_path):
    p, q = prompt(1), prompt(2)
    eng = engine(model, tmp_path, max_total_tokens=320)  # 20 pages: q's prompt evicts p's
    try:
        (toks, _), = run_requests(eng, [p], N)
        written(eng, 12)
        run_requests(eng, [q], N)
        assert eng.stats()["evictions"] > 0
        (again, last), = run_requests(eng, [p], N)
        assert again == toks == reference_greedy(model, p, N)
        assert last.num_cached_tokens == 12 * PAGE and eng.stats()["prefix_cache_disk"]["pages_loaded"] >= 1
    finally:
        eng.shutdown()


def filed(model, directory, p, **kw):
    """An engine that computed `p`, filed its 12 pages and stopped."""
    eng = engine(model, directory, **kw)
    try:
        run_requests(eng, [p], N)
        written(eng, 12)
    finally:
        eng.shutdown()
    return eng


def test_a_damaged_file_is_deleted_and_recomputed_never_served(model, tmp_path):
    p = prompt(3)
    eng = filed(model, tmp_path, p)
    paths = [eng.disk.files.path(h) for h in _hashes(eng, p)]
    data = bytearray(paths[5].read_bytes())
    data[-3] ^= 0x40  # one flipped bit in page 5's KV
    paths[5].write_bytes(bytes(data))
    paths[8].write_bytes(paths[8].read_bytes()[:-100])  # page 8 torn
    namespace = paths[0].parent.parent
    (namespace / "junk.kv").write_bytes(b"not a page")  # and rubbish around them
    (namespace / "zz").write_bytes(b"a file where a directory goes")
    (namespace / "ab" / "0123.kv.77.5.tmp").parent.mkdir(exist_ok=True)
    (namespace / "ab" / "0123.kv.77.5.tmp").write_bytes(b"half")
    again = engine(model, tmp_path)
    try:
        (toks, last), = run_requests(again, [p], N)
        assert toks == reference_greedy(model, p, N)
        assert last.num_cached_tokens == 5 * PAGE  # pages 0..4: the chain stops at the damaged one
        assert again.stats()["prefix_cache_disk"]["damaged_pages"] == 1
        written(again, 1)  # page 5 recomputed and filed again (the others are on disk)
        assert again.disk.files.read(_hashes(again, p)[5]) is not None
    finally:
        again.shutdown()
    third = engine(model, tmp_path)
    try:
        (toks, last), = run_requests(third, [p], N)
        assert toks == reference_greedy(model, p, N)
        assert last.num_cached_tokens == 8 * PAGE  # up to the torn page 8
        assert third.stats()["prefix_cache_disk"]["damaged_pages"] == 1
    finally:
        third.shutdown()


def test_a_replica_hears_of_the_pages_another_filed_in_the_shared_directory(model, tmp_path, monkeypatch):
    """For the router: a replica's report of its SSD pages takes in what the Mac's other
    replicas file in the directory they share (the directory is listed again now and then)."""
    from mlx_worker.kv_tiers import disk_tier

    monkeypatch.setattr(disk_tier, "RESCAN_S", 0.1)
    p = prompt(5)
    listener = engine(model, tmp_path)  # up first: its start-up listing finds nothing
    try:
        filed(model, tmp_path, p)  # another replica computes p and files its pages
        wanted, deadline = set(_hashes(listener, p)), time.time() + 30
        while not wanted <= set(listener.stats()["disk_page_hashes"]):
            assert time.time() < deadline
            run_requests(listener, [prompt(99, 20)], 1)  # the stats are taken after a step
            time.sleep(0.2)
    finally:
        listener.shutdown()


def _hashes(eng, p):
    from mlx_worker.memory.paging import page_hashes

    return page_hashes(p[: 12 * PAGE], eng.pages.page_size)


def test_another_model_never_reads_these_pages(model, tmp_path):
    p = prompt(4)
    filed(model, tmp_path, p)
    other_model = make_tiny_model("llama", seed=1)  # the same architecture, other weights
    other = engine(other_model, tmp_path)
    try:
        (toks, last), = run_requests(other, [p], N)
        assert toks == reference_greedy(other_model, p, N) and last.num_cached_tokens == 0
    finally:
        other.shutdown()


def test_a_draft_models_kv_comes_back_from_disk_with_the_pages(model, tmp_path):
    """Speculative method draft, the model its own draft (its drafts are right only where
    its KV is the target's): the draft's KV is filed with each page, so after a restart
    the pages read back serve its drafts too. Another configuration (no drafter) has
    pages of its own."""
    p = prompt(6)
    spec = dict(speculative={"method": "draft", "draft_model": "tiny", "adaptive": False, "num_draft_tokens": 4},
                draft_model=model)
    filed(model, tmp_path, p, **spec)
    again = engine(model, tmp_path, **spec)
    try:
        (toks, last), = run_requests(again, [p], 24)
        assert toks == reference_greedy(model, p, 24) and last.num_cached_tokens == 12 * PAGE
        drafts = again.stats()["speculative"]
        assert drafts["verify_rows"] > 0 and drafts["acceptance_rate"] > 0.97, drafts
    finally:
        again.shutdown()
    plain = engine(model, tmp_path)
    try:
        (_, last), = run_requests(plain, [p], N)
        assert last.num_cached_tokens == 0
    finally:
        plain.shutdown()


def test_quantized_pages_go_to_disk_as_they_are(tmp_path):
    model = make_tiny_model("qwen3", head_dim=32)
    p = prompt(5)
    kw = dict(kv_bits=8, kv_group_size=32)
    filed(model, tmp_path, p, **kw)
    again = engine(model, tmp_path, **kw)
    try:
        (toks, last), = run_requests(again, [p], N)
        assert last.num_cached_tokens == 12 * PAGE
        assert toks[:N] == quantized_reference(model, p, 8)[:N]
    finally:
        again.shutdown()


def test_an_unusable_directory_or_failing_writes_lose_nothing(model, tmp_path):
    p = prompt(6)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    eng = engine(model, blocker / "cache")  # under a regular file: cannot be made
    try:
        (toks, _), = run_requests(eng, [p], N)
        assert toks == reference_greedy(model, p, N) and eng.stats()["prefix_cache_disk"] is None
    finally:
        eng.shutdown()
    eng = engine(model, tmp_path / "cache", prefix_cache_max_bytes=4 * 10_000)
    try:
        # Every page's directory is taken by a file: each write fails, as on a full disk.
        space = eng.disk.files.dir
        for i in range(256):
            (space / f"{i:02x}").write_bytes(b"")
        (toks, _), = run_requests(eng, [p], N)
        assert toks == reference_greedy(model, p, N)
        eng.disk.flush()
        disk = eng.stats()["prefix_cache_disk"]
        assert disk["write_errors"] == 12 and disk["pages_written"] == 0
    finally:
        eng.shutdown()


def test_the_directory_stays_within_its_bytes(model, tmp_path):
    eng = engine(model, tmp_path, prefix_cache_max_bytes=6 * 9000)  # a page of this model: ~8.2 kB
    try:
        for seed in (7, 8):
            run_requests(eng, [prompt(seed)], N)
        eng.disk.flush()
        assert 0 < sum(f.stat().st_size for f in page_files(tmp_path)) <= 6 * 9000
    finally:
        eng.shutdown()


def states_written(eng, n, timeout=30):
    deadline = time.time() + timeout
    while eng.stats()["prefix_cache_disk"]["states_written"] < n:
        assert time.time() < deadline, eng.stats()["prefix_cache_disk"]
        time.sleep(0.05)


def test_a_hybrid_models_state_snapshots_go_to_disk_and_a_restart_resumes_there(tmp_path):
    """A recurrent state can't be rebuilt from pages: the pages come back only as far as a
    snapshot on disk, and a damaged snapshot is never served (computed again)."""
    hybrid = make_tiny_model("qwen3_next")
    p = prompt(4)
    expected = reference_greedy(hybrid, p, N)
    first = engine(hybrid, tmp_path)
    try:
        (toks, _), = run_requests(first, [p], N)
        assert toks == expected
        written(first, 12)
        states_written(first, 1)  # the state after the prompt's last full page
    finally:
        first.shutdown()
    again = engine(hybrid, tmp_path)
    try:
        (toks, last), = run_requests(again, [p], N)
        assert toks == expected and last.num_cached_tokens == 12 * PAGE
        disk = again.stats()["prefix_cache_disk"]
        assert disk["states_loaded"] == 1 and disk["pages_loaded"] == 12
        snapshot = again.disk.states.files.path(_hashes(again, p)[11])
    finally:
        again.shutdown()
    data = bytearray(snapshot.read_bytes())
    data[-5] ^= 0x01
    snapshot.write_bytes(bytes(data))
    third = engine(hybrid, tmp_path)
    try:
        (toks, last), = run_requests(third, [p], N)
        assert toks == expected and last.num_cached_tokens == 0  # no other snapshot to resume from
        assert third.stats()["prefix_cache_disk"]["damaged_states"] == 1
        states_written(third, 1)  # computed and filed again
    finally:
        third.shutdown()
