"""The conversation store on a real redis-server: the same rules as impl.policy's, atomic across replicas.

* the hypothesis state machine of tests/policy/test_store.py, unchanged, driven through RedisStore;
* the contracts (failed turn keeps its entry, miss reasons, eviction) on both backends;
* compare-and-set: a heartbeat's write-back never replaces a newer turn another replica stored, and
  a model of D (blocks freed when P reads them) never ends up behind an entry pointing at freed blocks
  while replicas run turns and heartbeats concurrently; the indexes stay consistent;
* replicas with different monotonic clocks agree on expiry (the shared time is the wall clock);
* faults: Redis killed -> StoreUnavailable (logged once), back -> works again, no restart of anything.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from impl.policy import ConversationEntry, ConversationStore, ItemsPrompt, MissReason, sequence_digest
from impl.router.store_redis import RedisStore, member
from impl.router.stores import MemoryStore, StoreUnavailable
from tests.policy.test_store import BOUND, StoreMachine
from tests.redis_server import RedisServer, unique_prefix
from tests.router.harness import LoopThread


def entry(tokens: list[int], expires_at: float, instance: str = "d0", **params) -> ConversationEntry:
    return ConversationEntry(instance, {"remote_num_tokens": len(tokens), **params}, expires_at, len(tokens),
                             len(tokens), sequence_digest(tokens))


def redis_store(url: str, **kwargs) -> RedisStore:
    kwargs.setdefault("clock_offset", 0.0)  # tests drive time themselves
    kwargs.setdefault("timeout_s", 10.0)  # a loaded CI machine can stall Redis past the router's 0.5 s
    kwargs.setdefault("prefix", unique_prefix())
    return RedisStore.from_url(url, **kwargs)


# -- the state machine, on Redis ----------------------------------------------------------------------
class _SyncFacade:
    """RedisStore as the synchronous store the machine drives (each call runs on the loop thread)."""

    def __init__(self, lt: LoopThread, url: str, margin: float, bucket_s: float) -> None:
        self.lt = lt
        self.store = lt.run(self._make(url, margin))
        self._bucket_s = bucket_s  # the machine's purge contract is per bucket; Redis purges exactly

    @staticmethod
    async def _make(url: str, margin: float) -> RedisStore:
        return redis_store(url, max_entries=BOUND, expiry_margin_s=margin)

    @property
    def stats(self):
        return self.store.stats

    def lookup(self, tenant, conv, prompt, now):
        return self.lt.run(self.store.lookup(tenant, conv, prompt, now))

    def record_success(self, tenant, conv, e, now):
        self.lt.run(self.store.record_success(tenant, conv, e, now))

    def get(self, tenant, conv):
        got = self.lt.run(self.store.get(tenant, conv))
        return None if got is None else got.entry

    def __len__(self):
        return self.lt.run(self.store.size())


def test_state_machine_on_redis(redis_server):
    """tests/policy/test_store.py's machine and reference, unchanged, with RedisStore as the store."""
    lt = LoopThread()
    try:
        class RedisStoreMachine(StoreMachine):
            @initialize(margin=st.sampled_from([5.0, 0.0, 2.5]), bucket_s=st.sampled_from([1.0, 0.25, 7.0]))
            def setup(self, margin, bucket_s):
                self.margin = margin
                self.store = _SyncFacade(lt, redis_server.url, margin, bucket_s)

            def teardown(self):
                if hasattr(self, "store"):
                    lt.run(self.store.store.close())

        run_state_machine_as_test(RedisStoreMachine, settings=settings(max_examples=150, stateful_step_count=40,
                                                                       deadline=None))
    finally:
        lt.close()


# -- contracts, on both backends ---------------------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def make_store(request, redis_server):
    opened = []

    def make(max_entries: int = 100_000, margin: float = 5.0, **kwargs):
        if request.param == "memory":
            return MemoryStore(ConversationStore(max_entries=max_entries, expiry_margin_s=margin))
        store = redis_store(redis_server.url, max_entries=max_entries, expiry_margin_s=margin, **kwargs)
        opened.append(store)
        return store

    return make


async def test_failed_turn_keeps_entry_and_success_replaces(make_store):
    store = make_store()
    await store.record_success("t", "c", entry([1, 2, 3], 100.0, "d0"), now=0.0)
    assert (await store.lookup("t", "c", ItemsPrompt([1, 2, 3, 4]), now=10.0)).hit
    # the turn failed downstream: nothing recorded; the next try still hits
    assert (await store.lookup("t", "c", ItemsPrompt([1, 2, 3, 4]), now=11.0)).hit
    await store.record_success("t", "c", entry([1, 2, 3, 4, 5], 120.0, "d1"), now=12.0)
    again = await store.lookup("t", "c", ItemsPrompt([1, 2, 3, 4, 5, 6]), now=13.0)
    assert again.entry.decode_instance == "d1"
    await store.close()


async def test_take_offers_an_entry_once(make_store):
    """History keys are single-use (P's read frees D's blocks): take hits once, then misses."""
    store = make_store()
    await store.record_success("t", "\x00h:k", entry([1, 2], 100.0), now=0.0)
    assert (await store.take("t", "\x00h:k", ItemsPrompt([1, 3]), now=1.0)).miss is MissReason.GUARD  # stays
    assert (await store.take("t", "\x00h:k", ItemsPrompt([1, 2, 3]), now=1.0)).hit
    assert (await store.take("t", "\x00h:k", ItemsPrompt([1, 2, 3]), now=2.0)).miss is MissReason.TAKEN
    assert len(store) == 0 if isinstance(store, MemoryStore) else await store.size() == 0
    await store.close()


async def test_replicas_racing_to_take_one_history_entry_get_it_once(redis_server):
    replicas = [redis_store(redis_server.url, prefix="race-take:") for _ in range(4)]
    try:
        for round_ in range(20):
            cid = f"\x00h:{round_}"
            await replicas[0].record_success("t", cid, entry([1], 100.0), now=0.0)
            got = await asyncio.gather(*(r.take("t", cid, ItemsPrompt([1, 2]), now=1.0) for r in replicas))
            assert sum(g.hit for g in got) == 1
            assert [g.miss for g in got if not g.hit] == [MissReason.TAKEN] * 3
    finally:
        for r in replicas:
            await r.close()


async def test_miss_reasons(make_store):
    store = make_store(max_entries=1)
    await store.record_success("a", "c", entry([1], 100.0), now=0.0)
    assert (await store.lookup("b", "c", ItemsPrompt([1]), now=1.0)).miss is MissReason.TENANT
    assert (await store.lookup("a", "c", ItemsPrompt([2]), now=1.0)).miss is MissReason.GUARD
    assert (await store.lookup("a", "zz", ItemsPrompt([1]), now=1.0)).miss is MissReason.UNKNOWN
    assert (await store.lookup("a", "c", ItemsPrompt([1]), now=95.0)).miss is MissReason.EXPIRED
    await store.record_success("a", "c", entry([1], 200.0), now=100.0)
    await store.record_success("a", "d", entry([1], 200.0), now=101.0)
    assert (await store.lookup("a", "c", ItemsPrompt([1]), now=102.0)).miss is MissReason.EVICTED
    assert store.evictions == 1 and len(store) == 1
    await store.close()


async def test_a_guard_miss_does_not_count_as_use_for_lru(make_store):
    store = make_store(max_entries=2)
    await store.record_success("t", "old", entry([1], 100.0), now=0.0)
    await store.record_success("t", "new", entry([2], 100.0), now=1.0)
    assert (await store.lookup("t", "old", ItemsPrompt([9]), now=2.0)).miss is MissReason.GUARD
    await store.record_success("t", "third", entry([3], 100.0), now=3.0)
    assert (await store.get("t", "old")) is None  # still the least recently *used*: evicted
    assert (await store.get("t", "new")) is not None
    await store.close()


async def test_replace_and_forget_are_compare_and_set(make_store):
    store = make_store()
    await store.record_success("t", "c", entry([1], 100.0, "d0"), now=0.0)
    read = await store.get("t", "c")
    await store.record_success("t", "c", entry([1, 2], 100.0, "d1"), now=1.0)  # a newer turn, anywhere
    assert not await store.replace("t", "c", entry([1], 150.0, "d0"), now=2.0, expect=read.version)
    assert not await store.forget("t", "c", expect=read.version)
    assert (await store.get("t", "c")).entry.decode_instance == "d1"
    current = await store.get("t", "c")
    assert await store.replace("t", "c", entry([1, 2], 150.0, "d1"), now=2.0, expect=current.version)
    assert (await store.get("t", "c")).entry.expires_at == 150.0
    assert await store.forget("t", "c", expect=(await store.get("t", "c")).version)
    assert await store.get("t", "c") is None
    await store.close()


# -- across replicas ---------------------------------------------------------------------------------
async def test_replicas_with_different_clocks_agree_on_expiry(redis_server):
    prefix = unique_prefix()
    # replica A's monotonic clock reads 1000 s more than B's for the same instant
    a = RedisStore.from_url(redis_server.url, prefix=prefix, timeout_s=10.0, expiry_margin_s=5.0, clock_offset=0.0)
    b = RedisStore.from_url(redis_server.url, prefix=prefix, timeout_s=10.0, expiry_margin_s=5.0, clock_offset=1000.0)
    await a.record_success("t", "c", entry([1], expires_at=1100.0), now=1000.0)  # 100 s to live, on A's clock
    got = await b.lookup("t", "c", ItemsPrompt([1]), now=50.0)  # 50 s later, on B's clock
    assert got.hit and got.entry.expires_at == pytest.approx(100.0)  # in B's clock
    assert (await b.lookup("t", "c", ItemsPrompt([1]), now=96.0)).miss is MissReason.EXPIRED  # within the margin
    await a.close()
    await b.close()


async def test_a_lookup_on_another_replica_waits_for_a_pending_update(redis_server):
    prefix = unique_prefix()
    a = RedisStore.from_url(redis_server.url, prefix=prefix, timeout_s=10.0, pending_wait_s=5.0)
    b = RedisStore.from_url(redis_server.url, prefix=prefix, timeout_s=10.0, pending_wait_s=5.0)
    now = time.monotonic()
    await a.record_success("t", "c", entry([1], now + 100), now=now)
    await a.mark_pending("t", "c", 5.0)  # turn 2 ended on A; D's notification is on its way

    lookup = asyncio.create_task(b.lookup("t", "c", ItemsPrompt([1, 2, 3, 4]), now=time.monotonic()))
    deadline = time.monotonic() + 4.0
    while not b.pending_polls:  # B's lookup has seen the mark and waits
        assert time.monotonic() < deadline and not lookup.done(), "the lookup did not wait for the pending update"
        await asyncio.sleep(0.001)
    await a.record_success("t", "c", entry([1, 2, 3], time.monotonic() + 100, "d-turn2"), now=time.monotonic())
    await a.clear_pending("t", "c")
    got = await lookup
    assert got.hit and got.entry.decode_instance == "d-turn2"  # not turn 1's entry, whose blocks P read
    await a.close()
    await b.close()


async def test_a_heartbeat_write_back_never_replaces_a_newer_turn(redis_server):
    """The race compare-and-set exists for, played step by step; a blind write would lose it."""
    prefix = unique_prefix()
    hb_replica = RedisStore.from_url(redis_server.url, prefix=prefix, timeout_s=10.0)
    turn_replica = RedisStore.from_url(redis_server.url, prefix=prefix, timeout_s=10.0)
    now = time.monotonic()
    await turn_replica.record_success("t", "c", entry([1], now + 100, blocks="B1"), now=now)
    read = await hb_replica.get("t", "c")  # heartbeat relayed to D for blocks B1 ...
    found = await turn_replica.lookup("t", "c", ItemsPrompt([1, 2]), now=now)  # ... meanwhile turn 2: P reads B1
    assert found.entry.kv_params["blocks"] == "B1"
    await turn_replica.record_success("t", "c", entry([1, 2, 3], now + 100, blocks="B2"), now=now)
    renewed = entry([1], now + 200, blocks="B1")
    assert not await hb_replica.replace("t", "c", renewed, now=now, expect=read.version)
    assert (await hb_replica.get("t", "c")).entry.kv_params["blocks"] == "B2"
    # what a blind write-back (the one-process code's record_success) would have done
    await hb_replica.record_success("t", "c", renewed, now=now)
    assert (await hb_replica.get("t", "c")).entry.kv_params["blocks"] == "B1"  # B1: freed by P's read
    await hb_replica.close()
    await turn_replica.close()


class ModelD:
    """D's blocks: held until P reads them (a read frees them) or nobody renews them."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.ids = 0

    def retain(self) -> str:
        self.ids += 1
        self.held.add(f"B{self.ids}")
        return f"B{self.ids}"

    def read(self, block: str) -> bool:
        if block in self.held:
            self.held.discard(block)
            return True
        return False  # P's pull fails; it recomputes


async def _check_indexes(client, prefix: str, bound: int) -> int:
    lru = await client.zrange(prefix + "lru", 0, -1)
    exp = await client.zrange(prefix + "exp", 0, -1)
    keys = [k for k in await client.keys(prefix + "e:*")]
    ids = await client.hgetall(prefix + "ids")
    assert sorted(lru) == sorted(exp) == sorted(k[len(prefix) + 2:] for k in keys)
    assert sum(int(v) for v in ids.values()) == len(lru) <= bound
    return len(lru)


async def test_concurrent_replicas_never_leave_an_entry_on_freed_blocks(redis_server):
    prefix = unique_prefix()
    replicas = [RedisStore.from_url(redis_server.url, prefix=prefix, timeout_s=10.0, max_entries=6) for _ in range(3)]
    d = ModelD()
    rng = random.Random(7)
    convs = [f"c{i}" for i in range(8)]
    history = {c: [1] for c in convs}
    in_turn: set[str] = set()  # one turn per conversation at a time: a client waits for its answer
    pulls = failed_pulls = renewals = superseded = 0

    async def turn(store: RedisStore, conv: str) -> None:
        nonlocal pulls, failed_pulls
        prompt = history[conv] + [rng.randrange(100)]
        found = await store.lookup("t", conv, ItemsPrompt(prompt), time.monotonic())
        if found.hit:
            ok = d.read(found.entry.kv_params["blocks"])
            pulls += ok
            failed_pulls += not ok
        await asyncio.sleep(rng.random() * 0.003)  # decode
        held = prompt + [rng.randrange(100)]
        history[conv] = held
        await store.record_success("t", conv, entry(held, time.monotonic() + 60, blocks=d.retain()), time.monotonic())

    async def heartbeat(store: RedisStore, conv: str) -> None:
        nonlocal renewals, superseded
        got = await store.get("t", conv)
        if got is None:
            return
        await asyncio.sleep(rng.random() * 0.003)  # relayed to D and back
        if got.entry.kv_params["blocks"] not in d.held:
            return  # D answers not_held: 410 (and a compare-and-set forget)
        renewed = entry(history_of(got.entry), time.monotonic() + 120, blocks=got.entry.kv_params["blocks"])
        if await store.replace("t", conv, renewed, time.monotonic(), expect=got.version):
            renewals += 1
        else:
            superseded += 1

    def history_of(e: ConversationEntry) -> list[int]:
        return [0] * e.held_len  # only the length matters for these entries' guard

    async def client(i: int) -> None:
        for _ in range(40):
            conv = rng.choice(convs)
            store = rng.choice(replicas)
            if rng.random() < 0.5 and conv not in in_turn:
                in_turn.add(conv)
                try:
                    await turn(store, conv)
                finally:
                    in_turn.discard(conv)
            else:
                await heartbeat(store, conv)

    await asyncio.gather(*(client(i) for i in range(8)))
    for conv in convs:
        got = await replicas[0].get("t", conv)
        if got is not None:
            assert got.entry.kv_params["blocks"] in d.held, (conv, got.entry.kv_params)
    assert await _check_indexes(replicas[0].client, prefix, 6) <= 6
    assert pulls > 0 and renewals > 0 and superseded > 0, (pulls, renewals, superseded)  # the races happened
    for r in replicas:
        await r.close()


# -- faults ------------------------------------------------------------------------------------------
async def test_redis_down_raises_store_unavailable_logged_once_and_recovers(caplog):
    server = RedisServer().start()
    store = RedisStore.from_url(server.url, prefix=unique_prefix(), retry_s=0.05, timeout_s=0.5)
    try:
        now = time.monotonic()
        await store.record_success("t", "c", entry([1], now + 100), now=now)
        server.stop()
        caplog.set_level(logging.WARNING, logger="bidikv.router")
        for _ in range(5):
            with pytest.raises(StoreUnavailable):
                await store.lookup("t", "c", ItemsPrompt([1, 2]), time.monotonic())
        down_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down_logs) == 1
        server.start()  # same port, empty (no persistence): the scripts are reloaded on first use
        deadline = time.monotonic() + 10.0
        while True:
            try:
                got = await store.lookup("t", "c", ItemsPrompt([1, 2]), time.monotonic())
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "the store never came back"
                await asyncio.sleep(0.02)
        assert got.miss is MissReason.UNKNOWN  # a crashed Redis without persistence lost its entries
        await store.record_success("t", "c", entry([1], time.monotonic() + 100), now=time.monotonic())
        assert (await store.lookup("t", "c", ItemsPrompt([1, 2]), time.monotonic())).hit
        assert [r for r in caplog.records if "reachable again" in r.getMessage()]
        assert store.errors >= 5
    finally:
        await store.close()
        server.close()


def test_member_names_are_unambiguous():
    assert member("ab", "c") != member("a", "bc")
    assert member("a", "b:c") == b"1:ab:c"


# -- configuration -----------------------------------------------------------------------------------
async def test_the_password_comes_from_the_url_or_the_environment():
    server = RedisServer(password="s3cret").start()
    try:
        from impl.router.config import RouterConfig
        from impl.router.store_open import open_store

        base = {"prefill": ("http://p:1",), "decode": ("http://d:1",), "store_prefix": unique_prefix()}
        cases = [({"store": server.url}, {"BIDIKV_STORE_PASSWORD": "s3cret"}, True),
                 ({"store": f"redis://:s3cret@127.0.0.1:{server.port}/0"}, {}, True),
                 ({"store": server.url}, {}, False),
                 ({"store": server.url, "store_password_env": "OTHER"}, {"OTHER": "wrong"}, False)]
        for overrides, environ, works in cases:
            store = open_store(RouterConfig(**base, **overrides), environ)
            if works:
                await store.record_success("t", "c", entry([1], time.monotonic() + 100), time.monotonic())
                assert (await store.get("t", "c")) is not None
            else:
                with pytest.raises(StoreUnavailable):
                    await store.record_success("t", "c", entry([1], time.monotonic() + 100), time.monotonic())
            await store.close()
    finally:
        server.close()


@pytest.mark.parametrize("url, says", [
    ("foo://h:1/0", "--store must be 'memory' or a redis://"),
    ("redis://h:notaport/0", "--store: not a valid URL"),
    ("redis://:pw@h:1/db", "--store: the database must be a number"),
    ("redis:///0", "--store: the URL needs a host"),
])
def test_a_bad_store_url_is_one_clear_error_naming_the_flag(url, says):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "impl.router", "--prefill", "http://p:1", "--decode", "http://d:1",
                          "--store", url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
    assert "pw" not in out.stderr  # a password in the URL is never echoed


async def test_a_stuck_redis_costs_one_timeout_then_calls_fail_fast_until_it_answers():
    """SIGSTOP: the server accepts nothing and answers nothing, as a hung Redis does."""
    import os
    import signal

    server = RedisServer().start()
    store = RedisStore.from_url(server.url, prefix=unique_prefix(), timeout_s=0.3, retry_s=2.0)
    try:
        now = time.monotonic()
        await store.record_success("t", "c", entry([1], now + 100), now=now)
        os.kill(server.proc.pid, signal.SIGSTOP)
        with pytest.raises(StoreUnavailable, match="(?i)timeout"):  # waited for the timeout (once: no retry after it)
            await store.lookup("t", "c", ItemsPrompt([1, 2]), time.monotonic())
        with pytest.raises(StoreUnavailable, match="is down"):  # within retry_s: refused at once, not sent
            await store.lookup("t", "c", ItemsPrompt([1, 2]), time.monotonic())
        os.kill(server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:
            try:
                got = await store.lookup("t", "c", ItemsPrompt([1, 2]), time.monotonic())
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert got.hit  # nothing was lost: the server was only stuck
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        await store.close()
        server.close()


async def test_a_mass_expiry_is_purged_over_several_calls_and_still_answered_expired(redis_server):
    store = redis_store(redis_server.url, max_entries=1000, expiry_margin_s=5.0)
    for i in range(250):
        await store.record_success("t", f"c{i}", entry([i], expires_at=100.0), now=0.0)
    assert await store.size() == 250
    got = await store.lookup("t", "c249", ItemsPrompt([249]), now=200.0)  # everything expired at once
    assert got.miss is MissReason.EXPIRED and store.stats.purged == 100  # one bounded batch per call
    assert await store.size() == 150
    await store.lookup("t", "zz", ItemsPrompt([1]), now=200.0)
    await store.lookup("t", "zz", ItemsPrompt([1]), now=200.0)
    assert await store.size() == 0 and store.stats.purged == 250
    await store.close()


async def test_the_pipelined_connection_gives_every_caller_its_own_reply(redis_server):
    from impl.router.store_redis import _Pipelined

    pipe = _Pipelined(redis_server.url, None, timeout_s=10.0)
    try:
        # many callers in one loop turn: one write, replies matched in order
        replies = await asyncio.gather(*(pipe.call("ECHO", f"caller-{i}") for i in range(500)))
        assert replies == [f"caller-{i}".encode() for i in range(500)]
        # an error reply belongs to its caller only; the connection carries on
        results = await asyncio.gather(pipe.call("ECHO", "a"), pipe.call("NOSUCHCOMMAND"), pipe.call("ECHO", "b"),
                                       return_exceptions=True)
        assert results[0] == b"a" and results[2] == b"b" and "unknown command" in str(results[1]).lower()
    finally:
        await pipe.close()
