"""Picking the replica group of a request when one app has replicas of different sizes
(serve_app/routing/replica_groups.py), and the app's `replica_groups` arguments. The groups
serving together over HTTP are in test_cluster.py."""

import pytest

from serve_app.app import _groups
from serve_app.config import AppArgs
from serve_app.routing.replica_groups import GroupPicker


def send(picker, hashes):
    group = picker.ranked(hashes)[0]
    picker.started(group, hashes)
    return group


def test_new_prompts_spread_by_weight_and_a_prefix_returns_to_its_group():
    picker = GroupPicker({"one": 3.0, "pair": 1.0})
    firsts = [send(picker, [100 + i]) for i in range(40)]
    for g in firsts:
        picker.finished(g)  # nothing in flight: only the recent shares decide
    assert firsts.count("one") == 30 and firsts.count("pair") == 10
    for i in range(40):  # a longer prompt with the same first page goes where that page went
        assert send(picker, [100 + i, 7000 + i]) == firsts[i]


def test_the_deepest_known_page_decides():
    picker = GroupPicker({"a": 1.0, "b": 1.0})
    assert send(picker, [1, 2]) == "a"
    assert send(picker, [9]) == "b"
    assert picker.ranked([1, 2, 7])[0] == "a" and picker.ranked([9, 8])[0] == "b"
    picker.started("b", [1, 2, 3])  # the newest decision about a page holds
    assert picker.ranked([1, 2, 3, 4])[0] == "b"


def test_a_busy_group_spills_its_cached_prefix_to_an_idle_one():
    picker = GroupPicker({"a": 1.0, "b": 1.0}, imbalance_threshold=4, imbalance_ratio=1.5)
    hot = [42, 43]
    sent = [send(picker, hot) for _ in range(12)]  # none finishes: "a" fills up
    assert sent[:6] == ["a"] * 5 + ["b"]  # the cache wins until "a" has over 4 more in flight than "b"
    assert max(picker.inflight.values()) - min(picker.inflight.values()) <= 5
    for g in sent:
        picker.finished(g)
    assert picker.inflight == {"a": 0, "b": 0}


def test_the_next_groups_are_the_fallbacks_in_order_of_load():
    picker = GroupPicker({"a": 1.0, "b": 1.0, "c": 2.0})
    for _ in range(3):
        picker.started("a", [])
    picker.started("b", [])
    assert picker.ranked([5]) == ["c", "b", "a"]
    with pytest.raises(ValueError, match="positive weights"):
        GroupPicker({"a": 0.0})


def test_groups_take_the_apps_fields_unless_they_set_their_own():
    args = AppArgs.model_validate({
        "num_replicas": 2, "replica_resource": "mac", "engine": {"max_running_requests": 8},
        "replica_groups": [{"name": "one"},
                           {"name": "pair", "num_replicas": 1, "replica_resource": "bigmac",
                            "engine": {"tensor_parallel_size": 2}}]})
    (one_name, one, one_weight), (pair_name, pair, pair_weight) = _groups(args)
    assert (one_name, pair_name, one_weight, pair_weight) == ("MLXReplica_one", "MLXReplica_pair", None, None)
    assert (one.num_replicas, one.replica_resource, one.engine) == (2, "mac", {"max_running_requests": 8})
    assert (pair.num_replicas, pair.replica_resource) == (1, "bigmac")
    assert pair.engine == {"max_running_requests": 8, "tensor_parallel_size": 2}
    with pytest.raises(ValueError, match="must differ"):
        _groups(AppArgs.model_validate({"replica_groups": [{"name": "x"}, {"name": "x"}]}))
    with pytest.raises(ValueError, match="page_size"):
        _groups(AppArgs.model_validate({"replica_groups": [{"name": "x", "engine": {"page_size": 32}}]}))
    with pytest.raises(ValueError):
        AppArgs.model_validate({"replica_groups": [{"name": "a b"}]})
