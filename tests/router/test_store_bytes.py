"""The conversation store is bounded in bytes, evicting least recently used entries,
what it counts is what the entries really take (checked against tracemalloc), and D's block ids are
held compactly yet handed back exactly."""

from __future__ import annotations

import json
import tracemalloc

from hypothesis import given, settings, strategies as st

from impl.policy import ConversationEntry, ConversationStore, ItemsPrompt, MissReason, sequence_digest
from impl.policy.block_ids import CompactParams
from impl.router.cli import main as cli_main
from impl.router.config import RouterConfig

NOW = 1000.0


def d_params(i: int, blocks: int, contiguous: bool = False) -> dict:
    """D's kv_transfer_params as the router gets them: decoded from JSON, so every id is its own int
    object. Fragmented ids (every other block) unless ``contiguous``."""
    step = 1 if contiguous else 2
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [list(range(i * 10_000, i * 10_000 + step * blocks, step))],
              "remote_engine_id": f"engine-{i % 4}", "remote_request_id": f"cmpl-{i:032x}", "remote_host": "10.0.0.7",
              "remote_port": 5600, "tp_size": 8, "remote_num_tokens": blocks * 16, "remote_blocks_expiry_time": NOW + 480}
    return json.loads(json.dumps(params))


def entry(i: int, blocks: int, contiguous: bool = False) -> ConversationEntry:
    return ConversationEntry(decode_instance="http://d0:8200", kv_params=d_params(i, blocks, contiguous), expires_at=NOW + 480,
                             num_tokens=blocks * 16, held_len=3, held_digest=sequence_digest([1, 2, i]), stored_at=NOW)


def test_the_store_stays_under_its_byte_bound_and_evicts_the_least_recently_used():
    one = ConversationStore(max_entries=10)
    one.record_success("t", "probe", entry(0, 2000), NOW)
    per_entry = one.bytes
    assert 2000 * 4 < per_entry < 2000 * 8  # fragmented ids: 4 bytes each, packed

    store = ConversationStore(max_entries=100_000, max_bytes=20 * per_entry)
    for i in range(60):
        store.record_success("t", f"c{i}", entry(i, 2000), NOW)
        if i >= 5:  # keep conversation c0 in use (a hit): it must survive every eviction
            assert store.lookup("t", "c0", ItemsPrompt((1, 2, 0, 9)), NOW).hit
        assert store.bytes <= store.max_bytes
    assert 15 <= len(store) <= 20
    assert store.get("t", "c59") is not None and store.get("t", "c1") is None
    assert store.lookup("t", "c1", ItemsPrompt((1,)), NOW).miss is MissReason.EVICTED
    assert store.stats.evictions == 60 - len(store)
    # forgetting and replacing keep the count exact
    total = store.bytes
    store.forget("t", "c59")
    assert store.bytes < total
    for key in list(store._entries):
        store.forget(*key)
    assert store.bytes == 0 and len(store) == 0


def test_an_entry_larger_than_the_whole_bound_is_not_kept():
    store = ConversationStore(max_entries=10, max_bytes=10_000)
    store.record_success("t", "big", entry(1, 5000), NOW)
    assert len(store) == 0 and store.bytes == 0


def test_counted_bytes_cover_what_the_entries_really_take():
    entries = [entry(i, blocks, contiguous=i % 3 == 0) for i, blocks in enumerate([1, 16, 300, 2000, 8000] * 40)]
    store = ConversationStore(max_entries=100_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, e in enumerate(entries):
        store.record_success("tenant", f"conversation-{i}", e, NOW)
    real = tracemalloc.get_traced_memory()[0] - before  # the store holds packed copies, made while tracing
    tracemalloc.stop()
    assert 0.8 * real <= store.bytes <= 1.5 * real, (store.bytes, real)


def test_the_router_bound_is_a_flag_with_a_default_for_a_small_vm(capsys):
    assert RouterConfig().max_store_bytes == 512 * 1024 * 1024
    try:
        cli_main(["router", "--help"])
    except SystemExit:
        pass
    assert "--max-store-bytes" in capsys.readouterr().out


def test_contiguous_block_ids_take_a_range_and_come_back_exactly():
    store = ConversationStore(max_entries=10)
    original = entry(3, 2000, contiguous=True)
    store.record_success("t", "c", original, NOW)
    assert store.bytes < 2000  # one range instead of 2,000 ints (~80 KB)
    held = store.get("t", "c")
    assert dict(held.kv_params) == dict(original.kv_params)
    assert json.dumps(dict(held.kv_params)) == json.dumps(original.kv_params)  # what P is sent, byte for byte


ids = st.integers(min_value=-(2**40), max_value=2**40)
groups = st.lists(ids, max_size=40) | st.builds(lambda a, n: list(range(a, a + n)), st.integers(0, 10**6), st.integers(1, 300)) \
    | st.lists(st.floats(allow_nan=False) | st.text(max_size=3) | st.none() | st.lists(ids, max_size=2), max_size=4)


@settings(max_examples=300, deadline=None)
@given(block_ids=st.lists(groups, max_size=4) | st.none() | st.text(max_size=5), other=st.dictionaries(st.text(max_size=5), ids, max_size=3))
def test_packed_params_read_back_as_d_sent_them(block_ids, other):
    params = {**other, "remote_block_ids": block_ids, "remote_engine_id": "D"}
    packed = CompactParams(json.loads(json.dumps(params)))
    assert json.dumps(dict(packed), sort_keys=True) == json.dumps(params, sort_keys=True)
    assert packed.get("remote_block_ids") == block_ids and len(packed) == len(params)
