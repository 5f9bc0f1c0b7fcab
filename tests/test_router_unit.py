"""Unit tests of the prefix-affinity router, without starting Ray."""

import asyncio
import random

import pytest
from pydantic import ValidationError

from serve_app.routing.prefix_policy import PrefixAffinityConfig, PrefixAffinityPolicy, prefix_match_len
from serve_app.routing.router import PrefixAffinityRouter, extract_page_hashes

SYS = list(range(1000, 1060))  # a 60-page system prompt's chained hashes


def report(hashes=(), running=0, waiting=0, kv_used=0.0, engine_id="e1", **extra):
    return {"running": running, "waiting": waiting, "kv_used": kv_used,
            "cached_page_hashes": list(hashes), "engine_id": engine_id, **extra}


def policy(**kw):
    return PrefixAffinityPolicy(PrefixAffinityConfig(**kw), rng=random.Random(0))


def best(ranking):
    return ranking.groups[0]


# --- matching ------------------------------------------------------------------------------
def test_prefix_match_contiguous_and_deepest():
    req = [1, 2, 3, 4, 5]
    assert prefix_match_len(req, {1, 2, 3}, "contiguous") == 3
    assert prefix_match_len(req, {1, 2, 3}, "deepest") == 3
    assert prefix_match_len(req, {2, 3}, "contiguous") == 0
    # A chained hash names its whole prefix: page 4 cached means pages 0..3 are too.
    assert prefix_match_len(req, {1, 2, 4}, "contiguous") == 2
    assert prefix_match_len(req, {1, 2, 4}, "deepest") == 4
    assert prefix_match_len(req, {9}, "deepest") == 0
    assert prefix_match_len([], {1}, "deepest") == 0
    assert prefix_match_len(req, lambda h: h <= 2, "contiguous") == 2


def test_deepest_match_survives_sampled_reports():
    pol = policy()
    pol.observe("a", report(SYS[3::4]), now=0.0)  # only every 4th page reported
    assert pol.match_len("a", SYS + [7, 8], now=0.0) == 60
    contiguous = policy(match_mode="contiguous")
    contiguous.observe("a", report(SYS[3::4]), now=0.0)
    assert contiguous.match_len("a", SYS, now=0.0) == 0


# --- scoring -------------------------------------------------------------------------------
def test_prefers_replica_with_cached_prefix():
    pol = policy()
    pol.observe("a", report(), 0.0)
    pol.observe("b", report(SYS), 0.0)
    pol.observe("c", report(SYS[:10]), 0.0)
    r = pol.rank(["a", "b", "c"], SYS + [1, 2, 3], now=0.0)
    assert r.mode == "prefix"
    assert r.groups == [["b"], ["c"], ["a"]]
    assert r.scores["b"].matched == 60 and r.scores["c"].matched == 10


def test_pages_on_a_replicas_ssd_count_less_than_in_memory_more_than_none():
    pol = policy()
    pol.observe("memory", report(SYS[:20]), 0.0)
    pol.observe("disk", report(SYS[:10], disk_page_hashes=SYS), 0.0)  # 50 more pages on its SSD
    pol.observe("none", report(), 0.0)
    r = pol.rank(["memory", "disk", "none"], SYS, now=0.0)
    assert r.scores["disk"].matched == 10 and r.scores["disk"].on_disk == 50
    assert r.scores["disk"].score == 10 + 0.5 * 50
    assert r.groups == [["disk"], ["memory"], ["none"]]  # 35 > 20 > 0
    pol.observe("memory", report(SYS[:40], engine_id="e1"), 1.0)
    assert best(pol.rank(["memory", "disk"], SYS, now=1.0)) == ["memory"]  # 40 in memory beat 35
    pol.observe("disk", report(SYS[:10], engine_id="e2"), 2.0)  # restarted: its report says no disk
    assert pol.rank(["disk"], SYS, now=2.0).scores["disk"].on_disk == 0


def test_load_cost_outweighs_small_overlap():
    pol = policy(load_weight=2.0)
    pol.observe("a", report(SYS[:2], running=3), 0.0)  # 2 pages cached, busy
    pol.observe("b", report([], running=0), 0.0)
    r = pol.rank(["a", "b"], SYS, now=0.0)
    assert best(r) == ["b"]
    assert r.scores["a"].score == 2 - 2 * 3


def test_long_overlap_beats_moderate_load():
    pol = policy(load_weight=2.0)
    pol.observe("a", report(SYS, running=4), 0.0)
    pol.observe("b", report([], running=0), 0.0)
    assert best(pol.rank(["a", "b"], SYS, now=0.0)) == ["a"]


def test_serve_ongoing_count_overrides_stale_report():
    pol = policy()
    pol.observe("a", report(running=5), 0.0)
    assert pol.load("a") == 5
    assert pol.load("a", ongoing=1) == 1  # Serve's fresher count wins
    pol.observe("b", report(running=0, kv_used=0.5), 0.0)
    assert pol.load("b") == pytest.approx(0.5 * pol.config.kv_weight)


def test_ties_broken_by_load_then_share_then_random():
    pol = policy(load_weight=0.0)  # equal scores whatever the load
    for k in "abc":
        pol.observe(k, report(), 0.0)
    r = pol.rank(["a", "b", "c"], SYS, now=0.0, ongoing={"a": 2, "b": 0, "c": 1})
    assert r.groups == [["b"], ["c"], ["a"]]
    pol.request_started("b")
    pol.request_finished("b")
    firsts = {best(pol.rank(["a", "b", "c"], SYS, now=0.0))[0] for _ in range(30)}
    assert firsts == {"a", "c"}  # b had a recent decision; a and c drawn at random


def test_route_records_first_choice_at_once():
    pol = policy()
    for k in "abcd":
        pol.observe(k, report(), 0.0)
    first = best(pol.route(list("abcd"), SYS + [1], now=0.0))[0]
    # The next request of the burst, before Serve even sent the first one.
    assert all(best(pol.route(list("abcd"), SYS + [i], now=0.0))[0] == first for i in range(2, 6))
    assert pol.match_len(first, SYS, now=0.0) == 60


def test_no_page_hashes_routes_by_load():
    pol = policy()
    pol.observe("a", report(SYS, running=2), 0.0)
    pol.observe("b", report([], running=0), 0.0)
    assert best(pol.rank(["a", "b"], None, now=0.0)) == ["b"]
    assert best(pol.rank(["a", "b"], [], now=0.0)) == ["b"]


# --- imbalance -----------------------------------------------------------------------------
def test_imbalance_falls_back_to_power_of_two():
    pol = policy(imbalance_threshold=8, imbalance_ratio=1.5)
    pol.observe("a", report(SYS), 0.0)
    for k in "bcd":
        pol.observe(k, report(), 0.0)
    ongoing = {"a": 20, "b": 0, "c": 1, "d": 2}
    r = pol.rank(list("abcd"), SYS, now=0.0, ongoing=ongoing)
    assert r.mode == "pow2"
    assert len(r.groups) == 1 and len(r.groups[0]) == 2
    assert len(set(r.groups[0])) == 2
    seen = set()
    for _ in range(50):
        seen |= set(pol.rank(list("abcd"), SYS, now=0.0, ongoing=ongoing).groups[0])
    assert seen == set("abcd")  # random pairs among all candidates


def test_small_or_proportional_differences_are_not_imbalance():
    pol = policy(imbalance_threshold=8, imbalance_ratio=1.5)
    assert not pol.is_imbalanced([0, 8])  # difference within the threshold
    assert not pol.is_imbalanced([40, 52])  # beyond it, but only 1.3x
    assert pol.is_imbalanced([40, 70])
    assert pol.is_imbalanced([0, 9])
    assert not pol.is_imbalanced([100])


def test_imbalance_filter_mode_keeps_affinity_among_unloaded():
    pol = policy(imbalance_mode="filter", imbalance_threshold=4, imbalance_ratio=0)
    pol.observe("hot", report(SYS), 0.0)
    pol.observe("warm", report(SYS[:30]), 0.0)
    pol.observe("cold", report(), 0.0)
    r = pol.rank(["hot", "warm", "cold"], SYS, now=0.0, ongoing={"hot": 30, "warm": 2, "cold": 0})
    assert r.mode == "filter"
    assert r.groups == [["warm"], ["cold"], ["hot"]]


# --- optimistic inserts and reports --------------------------------------------------------
def test_optimistic_insert_is_seen_at_once():
    pol = policy()
    for k in "ab":
        pol.observe(k, report(), 0.0)
    first = best(pol.rank(["a", "b"], SYS, now=1.0))[0]
    pol.record_routed(first, SYS, now=1.0)
    other = "b" if first == "a" else "a"
    r = pol.rank(["a", "b"], SYS + [5], now=1.1, ongoing={first: 1, other: 0})
    assert best(r) == [first]  # a burst of one tenant sticks to one replica


def test_report_reconciles_optimistic_inserts():
    pol = policy(report_lag_s=2.0, optimistic_ttl_s=30.0)
    old = [1, 2, 3]
    fresh = [1, 2, 3, 40, 41]
    pol.observe("a", report([1, 2, 3, 4]), now=0.0)
    pol.record_routed("a", [7, 8, 9], now=1.0)  # routed long before the next report
    pol.record_routed("a", fresh, now=9.5)  # routed just before it
    # Report at t=10: page 4 and the t=1 prompt were evicted; the t=9.5 prompt not yet in.
    assert pol.observe("a", report(old), now=10.0)
    assert pol.match_len("a", [1, 2, 3, 4], now=10.0) == 3  # evicted page gone
    assert pol.match_len("a", [7, 8, 9], now=10.0) == 0  # stale optimistic dropped
    assert pol.match_len("a", fresh, now=10.0) == 5  # fresh optimistic kept
    st = pol.replicas["a"]
    assert set(st.optimistic) == {40, 41}  # the reported part is not duplicated
    # ...until it expires without showing up in a report.
    assert pol.match_len("a", fresh, now=9.5 + 31) == 3


def test_unchanged_report_is_not_fresh():
    pol = policy(report_lag_s=0.0)
    stats = report([1, 2])
    assert pol.observe("a", stats, now=0.0)
    pol.record_routed("a", [1, 2, 3], now=1.0)
    assert not pol.observe("a", stats, now=5.0)  # same object: nothing new
    assert not pol.observe("a", report([1, 2]), now=5.0)  # equal content (rebroadcast)
    assert pol.match_len("a", [1, 2, 3], now=5.0) == 3
    assert pol.observe("a", report([1, 2], running=1), now=6.0)
    assert pol.match_len("a", [1, 2, 3], now=6.0) == 2


def test_optimistic_ttl_without_reports():
    pol = policy(optimistic_ttl_s=5.0)
    pol.record_routed("a", SYS, now=0.0)
    assert pol.match_len("a", SYS, now=4.0) == 60
    assert pol.rank(["a", "b"], SYS, now=10.0).scores["a"].matched == 0
    assert not pol.replicas["a"].optimistic  # expired entries purged


def test_max_tracked_pages_bounds_state():
    pol = policy(max_tracked_pages=16)
    pol.observe("a", report(SYS), 0.0)
    assert len(pol.replicas["a"].reported) == 16
    assert pol.match_len("a", SYS, now=0.0) == 60  # the newest (deepest) pages kept
    pol.record_routed("b", list(range(100)), now=0.0)
    assert list(pol.replicas["b"].optimistic) == list(range(84, 100))


# --- replica lifecycle ---------------------------------------------------------------------
def test_engine_restart_forgets_cache():
    pol = policy()
    pol.observe("a", report(SYS, engine_id="e1"), 0.0)
    pol.record_routed("a", [5, 6], now=0.5)
    pol.request_started("a")
    assert pol.observe("a", report([], engine_id="e2"), now=1.0)
    assert pol.match_len("a", SYS, now=1.0) == 0
    assert pol.match_len("a", [5, 6], now=1.0) == 0
    assert pol.replicas["a"].inflight == 0 and pol.replicas["a"].engine_id == "e2"


def test_dead_or_removed_replicas_are_forgotten():
    pol = policy()
    for k in "abc":
        pol.observe(k, report(SYS), 0.0)
    pol.forget("a")
    pol.retain(["b"])
    assert set(pol.replicas) == {"b"}
    # A replica coming back under the same key starts empty.
    assert pol.match_len("a", SYS, now=0.0) == 0


def test_missing_or_garbage_stats_never_crash():
    pol = policy()
    assert not pol.observe("new", {}, 0.0)
    assert not pol.observe("new", None, 0.0)
    pol.observe("odd", {"running": "x", "waiting": None, "kv_used": float("nan"),
                        "cached_page_hashes": 5, "engine_id": 7}, 0.0)
    r = pol.rank(["new", "odd", "unknown"], SYS, now=0.0, ongoing={"new": 2, "unknown": None})
    assert {k: s.matched for k, s in r.scores.items()} == {"new": 0, "odd": 0, "unknown": 0}
    assert r.scores["new"].load == 2  # load from Serve's counter
    assert r.scores["odd"].load == 0
    assert sorted(k for g in r.groups for k in g) == ["new", "odd", "unknown"]


def test_engine_stats_format_and_page_size_mismatch():
    pol = policy(page_size=16)
    pol.observe("a", {"running": 1, "waiting": 0, "kv_pages_used": 30, "kv_pages_total": 120,
                      "cached_page_hashes": SYS}, 0.0)
    assert pol.replicas["a"].kv_used == pytest.approx(0.25)
    pol.observe("b", report(SYS, page_size=32), 0.0)
    assert pol.match_len("b", SYS, now=0.0) == 0
    pol.record_routed("b", SYS, now=0.0)
    assert pol.match_len("b", SYS, now=0.0) == 0


# --- share balancing -----------------------------------------------------------------------
def test_hot_prefix_spills_over_when_one_replica_takes_too_much():
    pol = policy(balance_window=64, max_share_ratio=1.2)
    for k in "abcd":
        pol.observe(k, report(), 0.0)
    pol.observe("a", report(SYS), 0.0)
    first = []
    for i in range(200):  # one tenant's traffic, cached on "a" only at first
        k = best(pol.rank(list("abcd"), SYS, now=1.0))[0]
        pol.record_routed(k, SYS, now=1.0)
        pol.request_started(k)
        pol.request_finished(k)
        first.append(k)
    assert first[:16] == ["a"] * 16  # affinity until there are enough decisions to judge
    shares = pol.shares(list("abcd"))
    mean = sum(shares.values()) / 4
    assert all(0.8 * mean < v < 1.2 * mean for v in shares.values())
    # Disabled: everything sticks to the cache.
    pol = policy(balance_window=0)
    pol.observe("a", report(SYS), 0.0)
    pol.observe("b", report(), 0.0)
    for _ in range(40):
        k = best(pol.rank(["a", "b"], SYS, now=1.0))[0]
        pol.request_started(k)
        pol.request_finished(k)
        assert k == "a"


# --- request parsing and config ------------------------------------------------------------
def test_extract_page_hashes():
    assert extract_page_hashes([{"rid": "r", "page_hashes": [1, 2]}], {}) == [1, 2]
    assert extract_page_hashes([], {"request": {"page_hashes": (3,)}}) == [3]
    assert extract_page_hashes(["x", {"rid": "r"}], {}) is None

    class Req:
        page_hashes = [4]

    assert extract_page_hashes([Req()], {}) == [4]
    assert extract_page_hashes(None, None) is None


def test_config_validation():
    assert PrefixAffinityConfig(**{}).page_size == 16
    with pytest.raises(ValidationError):
        PrefixAffinityConfig(load_wieght=1.0)
    with pytest.raises(ValidationError):
        PrefixAffinityConfig(imbalance_mode="random")


# --- the RequestRouter subclass, with stand-in replicas (no Ray cluster) -------------------
class FakeReplica:
    """The attributes of `RunningReplica` Serve's routing loop uses."""

    def __init__(self, name, stats=None, max_ongoing=8):
        from ray.serve.request_router import ReplicaID
        from ray.serve._private.common import DeploymentID

        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="d", app_name="a"))
        self.routing_stats = stats if stats is not None else {}
        self.max_ongoing_requests = max_ongoing
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids = set()

    async def get_queue_len(self, *, deadline_s):
        return 0


def make_router(**kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = PrefixAffinityRouter(
        deployment_id=DeploymentID(name="d", app_name="a"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    return router


def pending(i, hashes):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    return PendingRequest(
        args=[{"rid": str(i), "page_hashes": hashes}], kwargs={},
        metadata=RequestMetadata(request_id=str(i), internal_request_id=f"req-{i}"),
    )


def names(groups):
    return [[r.replica_id.unique_id for r in g] for g in groups]


def test_router_choose_replicas_with_stand_ins():
    async def main():
        router = make_router()
        reps = [FakeReplica("a", report()), FakeReplica("b", report(SYS)), FakeReplica("c")]
        router.update_replicas(reps)
        pr = pending(0, SYS + [1])
        groups = await router.choose_replicas(reps, pr)
        assert names(groups)[0] == ["b"]
        assert pr.routing_context.should_backoff  # no busy loop when all are full
        assert await router.choose_replicas([], pr) == []
        # No request (Serve may ask without one): load only, never a crash.
        assert sum(len(g) for g in await router.choose_replicas(reps, None)) == 3

        # The replica dies: its cache is forgotten and it leaves the candidates.
        router.on_replica_actor_died(reps[1].replica_id)
        assert reps[1].replica_id not in router.policy.replicas
        router.update_replicas([reps[0], reps[2]])
        assert set(router.policy.replicas) == {reps[0].replica_id, reps[2].replica_id}
        await asyncio.sleep(0)

    asyncio.run(main())


def test_router_records_decisions_through_serve_routing_loop():
    async def main():
        router = make_router(load_weight=0.5)
        reps = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
        router.update_replicas(reps)
        chosen = []
        for i in range(4):
            pr = pending(i, SYS + [10_000 + i])
            rep = await asyncio.wait_for(router._choose_replica_for_request(pr), 5)
            router.on_send_request(rep.replica_id)
            chosen.append(rep.replica_id)
        # The first decision was recorded at once, so the same system prompt sticks.
        assert len(set(chosen)) == 1
        st = router.policy.replicas[chosen[0]]
        assert st.inflight == 4 and set(SYS) <= set(st.optimistic)
        # The replica accepts (on_request_routed) and completes: no double counting.
        router.on_request_routed(pr, chosen[0], None)
        assert st.inflight == 4
        for i in range(4):
            router.on_request_completed(chosen[0], f"req-{i}")
        router.on_request_completed(chosen[0], "req-unknown")
        assert st.inflight == 0
        await asyncio.sleep(0)

    asyncio.run(main())


def test_router_engine_restart_via_new_stats():
    async def main():
        router = make_router()
        a, b = FakeReplica("a", report(SYS, engine_id="1")), FakeReplica("b", report())
        router.update_replicas([a, b])
        assert names(await router.choose_replicas([a, b], pending(0, SYS)))[0] == ["a"]
        a.routing_stats = report([], engine_id="2", running=1)  # restarted, cache empty
        assert names(await router.choose_replicas([a, b], pending(1, SYS)))[0] == ["b"]
        await asyncio.sleep(0)

    asyncio.run(main())


# --- overload ------------------------------------------------------------------------------
def test_predicted_wait_is_load():
    """A replica whose queued prompts would keep a new one waiting counts as busier than
    its request count says (wait_weight requests per second of predicted wait)."""
    pol = policy(imbalance_threshold=100)
    pol.observe("a", report(running=2, queue_wait_s=30.0, engine_id="ea"), 0.0)
    pol.observe("b", report(running=4, queue_wait_s=0.0, engine_id="eb"), 0.0)
    assert pol.load("a") == pytest.approx(2 + 0.5 * 30.0) and pol.load("b") == 4
    assert best(pol.rank(["a", "b"], [], 0.0)) == ["b"]


def test_a_replica_that_refused_is_ranked_last():
    pol = policy()
    pol.observe("a", report(SYS, engine_id="ea"), 0.0)
    pol.observe("b", report(engine_id="eb"), 0.0)
    assert best(pol.route(["a", "b"], SYS, 0.0)) == ["a"]  # the cached prefix wins...
    ranking = pol.route(["a", "b"], SYS, 0.0, avoid=["a"])  # ...unless "a" refused this request
    assert ranking.groups == [["b"], ["a"]]
    assert pol.route(["a"], SYS, 0.0, avoid=["a"]).groups == [["a"]]  # no other: still tried
