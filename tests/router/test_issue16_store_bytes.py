"""Issue 16, item 2: the conversation store is bounded in bytes, evicting least recently used entries,
and what it counts is what the entries really take (checked against tracemalloc)."""

from __future__ import annotations

import json
import tracemalloc

from impl.policy import ConversationEntry, ConversationStore, ItemsPrompt, MissReason, sequence_digest
from impl.router.cli import main as cli_main
from impl.router.config import RouterConfig

NOW = 1000.0


def d_params(i: int, blocks: int) -> dict:
    """D's kv_transfer_params as the router gets them: decoded from JSON, so every id is its own int object."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(i * 10_000, i * 10_000 + blocks))],
              "remote_engine_id": f"engine-{i % 4}", "remote_request_id": f"cmpl-{i:032x}", "remote_host": "10.0.0.7",
              "remote_port": 5600, "tp_size": 8, "remote_num_tokens": blocks * 16, "remote_blocks_expiry_time": NOW + 480}
    return json.loads(json.dumps(params))


def entry(i: int, blocks: int) -> ConversationEntry:
    return ConversationEntry(decode_instance="http://d0:8200", kv_params=d_params(i, blocks), expires_at=NOW + 480,
                             num_tokens=blocks * 16, held_len=3, held_digest=sequence_digest([1, 2, i]), stored_at=NOW)


def test_the_store_stays_under_its_byte_bound_and_evicts_the_least_recently_used():
    one = ConversationStore(max_entries=10)
    one.record_success("t", "probe", entry(0, 2000), NOW)
    per_entry = one.bytes
    assert per_entry > 2000 * 28  # the ids are most of it

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
    entries = [entry(i, blocks) for i, blocks in enumerate([1, 16, 300, 2000, 8000] * 40)]
    store = ConversationStore(max_entries=100_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, e in enumerate(entries):
        store.record_success("tenant", f"conversation-{i}", e, NOW)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    seen: set = set()
    real = held + sum(_deep_size(e, seen) for e in entries)  # the entries were built before tracing started
    assert 0.8 * real <= store.bytes <= 1.5 * real, (store.bytes, real)


def _deep_size(obj, seen=None) -> int:
    import sys
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None or isinstance(obj, bool) or (type(obj) is int and -5 <= obj <= 256):
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        size += sum(_deep_size(v, seen) for v in obj)
    elif hasattr(obj, "__slots__"):
        size += sum(_deep_size(getattr(obj, s), seen) for s in obj.__slots__ if hasattr(obj, s))
    return size


def test_the_router_bound_is_a_flag_with_a_default_for_a_small_vm(capsys):
    assert RouterConfig().max_store_bytes == 512 * 1024 * 1024
    try:
        cli_main(["router", "--help"])
    except SystemExit:
        pass
    assert "--max-store-bytes" in capsys.readouterr().out
