"""The host tier in the simulator: its cache (lru, arc) against a plain model, and what a cluster does
with it (a retained turn that expires lives on there; what D offloads; the default leaves runs alone)."""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given, settings, strategies as st

from calibration.profile import LatencyProfile
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.engine.host_tier import HostCache
from sim.workload.model import Conversation, Turn

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")

ops = st.lists(st.tuples(st.sampled_from(["insert", "touch", "pin", "unpin"]), st.integers(0, 7),
                         st.integers(1, 40)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from(["lru", "arc"]), capacity=st.integers(1, 100), ops=ops)
def test_the_cache_never_exceeds_its_bytes_nor_evicts_a_pinned_entry(policy, capacity, ops):
    cache = HostCache("d0", float(capacity), policy)
    pinned = collections.Counter()
    for t, (op, key, size) in enumerate(ops):
        before = dict(cache.entries)
        if op == "insert":
            stored = cache.insert(key, size, 0, 0, float(size), 0.0, float(t))
            if stored:
                assert cache.entries[key].nbytes == size
            else:  # nothing changed: too big, or the room would need a pinned entry (or its old self is read)
                assert cache.entries == before
        elif op == "touch" and key in cache.entries:
            cache.touch(key)
        elif op == "pin" and key in cache.entries:
            cache.entries[key].pins += 1
            pinned[key] += 1
        elif op == "unpin" and pinned[key] and key in cache.entries:
            cache.entries[key].pins -= 1
            pinned[key] -= 1
        assert cache.used <= cache.capacity and cache.used == sum(e.nbytes for e in cache.entries.values())
        for k, n in pinned.items():  # a pinned entry is never evicted (nor replaced)
            if n:
                assert k in cache.entries and cache.entries[k] is before.get(k, cache.entries[k])
        assert set(cache.t1) | set(cache.t2) == set(cache.entries) and not set(cache.t1) & set(cache.t2)


def test_lru_evicts_the_least_recently_used():
    cache = HostCache("d0", 30.0, "lru")
    for key in "abc":
        assert cache.insert(key, 10, 0, 0, 10.0, 0.0, 0.0)
    cache.touch("a")  # b is now the least recently used
    assert cache.insert("d", 10, 0, 0, 10.0, 0.0, 1.0)
    assert set(cache.entries) == {"a", "c", "d"} and cache.evictions == 1


def test_arc_keeps_what_was_read_over_what_was_only_stored():
    cache = HostCache("d0", 30.0, "arc")
    for key in "abc":
        cache.insert(key, 10, 0, 0, 10.0, 0.0, 0.0)
    cache.touch("a")  # a moves to T2 (read since stored)
    for key in "de":  # a stream of once-stored entries evicts from T1, not the read one
        cache.insert(key, 10, 0, 0, 10.0, 0.0, 1.0)
    assert "a" in cache.entries and set(cache.b1) == {"b", "c"}
    cache.insert("b", 10, 0, 0, 10.0, 0.0, 2.0)  # a B1 ghost stored again: ARC grows T1's target
    assert cache.target_t1 > 0


def _config(**policy) -> SimConfig:
    config = SimConfig()
    for name, value in policy.items():
        setattr(config.policy, name, value)
    return config.validate()


def _two_turns(gap: float, n: int = 3000, out: int = 200) -> list[Conversation]:
    return [Conversation("c", 0.0, (Turn(n, out), Turn(n + out + 100, 50, gap_before_s=gap)))]


def _second(config: SimConfig, convs: list[Conversation]):
    cluster = Cluster(config, PROFILE)
    result = cluster.run(convs)
    return cluster, next(r for r in result.records if r.turn == 1)


def test_a_retained_turn_that_expires_lives_on_in_the_host_tier():
    # TTL 60 s, the next turn 120 s later: without the host tier it recomputes; with it P pulls from D's host tier
    ttl = dict(decoder_kv_blocks_ttl=60.0, kv_recompute_threshold=64)
    _, without = _second(_config(**ttl), _two_turns(120.0))
    assert without.reused_tokens == 0 and without.miss_reason == "expired"
    cluster, with_host = _second(_config(host_tier=True, offload_prompt_only=False, min_cached_token_delta=0, **ttl),
                                 _two_turns(120.0))
    assert with_host.decision == "host_pull" and with_host.miss_reason == "expired"
    assert with_host.reused_tokens == (3000 + 200 - 1) // PROFILE.block_size * PROFILE.block_size
    host = cluster.host
    assert host.pulls == 1 and host.sessions == 1 and with_host.d2p_transfer_s > host.cost.first_session_s
    # before the expiry the HBM entry is read, not the host tier
    _, live = _second(_config(host_tier=True, offload_prompt_only=False, min_cached_token_delta=0, **ttl),
                      _two_turns(10.0))
    assert live.decision == "pull"


def test_offload_prompt_only_keeps_ds_answers_out_of_the_host_tier():
    def held(prompt_only: bool) -> int:
        cluster, rec = _second(_config(host_tier=True, bidirectional=False, offload_prompt_only=prompt_only,
                                       min_cached_token_delta=0), _two_turns(30.0))
        return rec.reused_tokens

    bs = PROFILE.block_size
    assert held(True) == 3000 // bs * bs  # the previous prompt's whole blocks
    assert held(False) == 3199 // bs * bs  # and its answer's


def test_a_host_tier_too_small_for_the_turn_stores_nothing_and_p_recomputes():
    cluster, rec = _second(_config(host_tier=True, bidirectional=False, cpu_bytes_to_use=1e6, min_cached_token_delta=0),
                           _two_turns(30.0))
    assert rec.reused_tokens == 0 and cluster.host.caches["d0"].not_stored == 2
    assert cluster.host.caches["d0"].peak == 0


def test_the_minimum_and_break_even_decide_on_the_host_tier():
    # gpt-oss fit: a warm pull of 3,000 Qwen tokens costs ~40 ms, recomputing them ~80 ms; the first pull
    # of a pair also opens its session (~4 s), which break-even does not count (a session is paid once)
    cluster, rec = _second(_config(host_tier=True, bidirectional=False, min_cached_token_delta=4096), _two_turns(30.0))
    assert rec.decision == "recompute" and rec.decision_reason == "below_threshold" and cluster.host.pulls == 0
    _, rec = _second(_config(host_tier=True, bidirectional=False, min_cached_token_delta=0,
                             recompute_policy="break_even", host_pull_fit="glm-5.2-wide-ep"), _two_turns(30.0))
    assert rec.decision == "recompute" and rec.decision_reason == "recompute_cheaper"  # a 1.5 s floor loses
    _, rec = _second(_config(host_tier=True, bidirectional=False, min_cached_token_delta=0,
                             recompute_policy="break_even"), _two_turns(30.0, n=20_000))
    assert rec.decision == "host_pull" and rec.decision_reason == "pull_cheaper"


def test_the_summary_reports_the_host_tier_only_when_it_is_on():
    cluster = Cluster(_config(), PROFILE)
    assert "host_tier" not in cluster.run(_two_turns(30.0)).summary and cluster.host is None
    on = Cluster(_config(host_tier=True, bidirectional=False, min_cached_token_delta=0), PROFILE).run(_two_turns(30.0))
    host = on.summary["host_tier"]
    assert host["pulls"] == 1 and host["stored"] == 2 and host["peak_bytes"] > 0
    assert host["dram_byte_seconds"] > 0 and host["capacity_bytes_per_node"] == 2**40
    assert host["bytes_moved"] == 3000 // 16 * 16 * 262_144  # every rank's share of the pulled blocks


@pytest.mark.parametrize("field, value, why", [
    ("cpu_bytes_to_use", -1.0, "must be finite and >= 0"), ("cpu_bytes_to_use", math.inf, "finite"),
    ("min_cached_token_delta", -5, "must be >= 0"), ("eviction_policy", "fifo", "must be one of"),
    ("host_pull_fit", "nvme", "must be one of")])
def test_bad_host_tier_settings_name_the_field(field, value, why):
    config = SimConfig()
    setattr(config.policy, field, value)
    with pytest.raises(ValueError, match=f"policy.{field}.*{why}|{why}.*policy.{field}"):
        config.validate()
