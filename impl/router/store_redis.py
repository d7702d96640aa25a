"""The conversation store in Redis/Valkey: one store for a fleet of router replicas.

``bidikv router --store redis://HOST:PORT/DB`` (``rediss://`` for TLS, ``unix://PATH``; the password
in the URL or in ``$BIDIKV_STORE_PASSWORD``). Same rules as :class:`impl.policy.ConversationStore`,
each turn's read and each write one Lua script, so every step is atomic on the server whichever
replica runs it (Redis runs a script alone; no WATCH/MULTI retry loops):

* **tenant scoping** -- entries are keyed by (tenant, conversation id); a per-id count of tenants
  holding it answers the ``tenant`` miss, as the in-memory store does;
* **expiry with the margin** -- each entry is indexed by the time it stops being offerable
  (``impl.policy.store.usable_until``: ``expires_at - margin``); every script first purges what is past it (amortised O(log n) each, the
  wheel's job in memory). Times travel as the wall clock (``time.time()``) so replicas agree: each
  replica converts its monotonic clock with one offset taken at start-up, and D's own expiry is only
  ever carried inside ``kv_params``, never compared;
* **the guard** -- the continuation digest is checked here, after the one round trip, on the entry
  the script returned (the script cannot hash a prompt; the entry cannot change meaning in transit);
* **single use** -- ``take`` (what the router calls) then deletes the very version it answered (a second
  script), so of two replicas taking one turn only one gets its blocks; ``lookup`` never consumes;
* **the bound** -- exact LRU over ``max_entries`` live entries, by a sorted set of last-use stamps,
  enforced by the script that stores (expired entries leave first, then the least recently used). Each
  script purges at most 100 expired entries (~55 us each here under load), so a mass expiry never
  blocks Redis -- every replica's turns -- for long; the rest go over the next calls, and until then a
  lookup still answers them ``expired``. Redis key TTLs are only a backstop (usable time + 10 min) that
  frees an abandoned fleet's memory, and ``maxmemory-policy`` should be ``noeviction`` or
  ``volatile-lru``: only entry keys carry a TTL, so Redis never evicts the indexes, and an entry Redis
  dropped anyway is cleaned from them as ``evicted`` on its next lookup. ``allkeys-*`` could evict an
  index and is not supported.

What atomicity buys across replicas: a heartbeat that renewed an entry writes it back only if it is
still the entry it read (compare-and-set on a version), so it never resurrects blocks another
replica's next turn has already had P read (D frees blocks on that read); two replicas storing the
same conversation at once (a client retry that landed on the other one) each write a whole entry
and every index in one step, the later one winning -- both entries point at blocks their own D
holds. A turn whose update awaits D's notification marks the conversation pending, and a lookup on
any replica waits for it (at most ``notify_wait_s``), as the in-process recorder does.

Faults: any Redis error (refused, reset, timeout after ``timeout_s``) raises
:class:`~impl.router.stores.StoreUnavailable` -- the router serves the turn without reuse -- is
logged once when the store goes away and once when it returns, and for ``retry_s`` afterwards calls
fail at once instead of each paying a timeout. A restarted Redis has lost its scripts: they are loaded
again on the first NOSCRIPT answer. A turn's scripts travel over one pipelined connection per replica
(:class:`_Pipelined`); the rest (heartbeat reads and writes, pending marks) over redis-py's client. Not
supported: Redis Cluster (the scripts touch keys they derive; every key of a store lives under one
prefix on one server).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import time
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from impl.policy import ConversationEntry, Lookup, MissReason
from impl.policy.continuation import PromptView
from impl.policy.store import StoreStats, guard_passes, usable_until
from impl.router.stores import MAX_ENGINES, StoreUnavailable, Versioned

log = logging.getLogger("bidikv.router")

BACKSTOP_GRACE_S = 600.0
# the most tokens (or held items) an entry read back may claim: a token id's range, far beyond any context
MAX_STORED_TOKENS = 2**31 - 1
_FOREVER = 1e308  # an entry that never expires (expires_at = inf): the largest finite score
_PENDING_POLL_S = 0.005

# Shared by every script: KEYS[1] is the store's prefix. A member names one (tenant, conversation):
# "<byte length of tenant>:<tenant><conversation id>", unambiguous whatever either contains.
_COMMON = r"""
local pfx = KEYS[1]
local function conv_of(m)
  local i = string.find(m, ':', 1, true)
  return string.sub(m, i + 1 + tonumber(string.sub(m, 1, i - 1)))
end
local function remember_gone(m, reason, max)
  redis.call('HSET', pfx .. 'gone', m, reason)
  redis.call('ZADD', pfx .. 'gone_order', redis.call('INCR', pfx .. 'seq'), m)
  local extra = redis.call('ZCARD', pfx .. 'gone_order') - max
  if extra > 0 then
    local old = redis.call('ZPOPMIN', pfx .. 'gone_order', extra)
    for i = 1, #old, 2 do redis.call('HDEL', pfx .. 'gone', old[i]) end
  end
end
-- true when key k holds something other than an entry's hash (a string, a list...: not a router's):
-- its commands would fail the whole script with WRONGTYPE, which would read as the store being down
local function foreign(k)
  local t = redis.call('TYPE', k).ok
  return t ~= 'hash' and t ~= 'none'
end
local function forget_gone(m)
  redis.call('HDEL', pfx .. 'gone', m)
  redis.call('ZREM', pfx .. 'gone_order', m)
end
-- drop m's entry and index entries; true if it was stored
local function remove(m, reason, max)
  redis.call('DEL', pfx .. 'e:' .. m)
  redis.call('ZREM', pfx .. 'exp', m)
  if redis.call('ZREM', pfx .. 'lru', m) == 0 then return false end
  local c = conv_of(m)
  if redis.call('HINCRBY', pfx .. 'ids', c, -1) <= 0 then redis.call('HDEL', pfx .. 'ids', c) end
  if reason then remember_gone(m, reason, max) end
  return true
end
-- at most `limit` per call: after a long idle spell (every entry expired) one script must not block
-- Redis -- and every replica's turns -- for the whole purge; the rest goes over the next calls
local function purge(now, max, limit)
  local dead = redis.call('ZRANGEBYSCORE', pfx .. 'exp', '-inf', now, 'LIMIT', 0, limit)
  for _, m in ipairs(dead) do remove(m, 'expired', max) end
  return #dead
end
"""

# ARGV: now, member, max_entries, '1' to wait for a pending update -> {status, purged, size, [version, data]}
_LOOKUP = _COMMON + r"""
local now, m, max = ARGV[1], ARGV[2], tonumber(ARGV[3])
local purged = purge(now, max, 100)
if ARGV[4] == '1' and redis.call('EXISTS', pfx .. 'p:' .. m) == 1 then
  return {'pending', purged, redis.call('ZCARD', pfx .. 'lru')}
end
if foreign(pfx .. 'e:' .. m) then
  -- a miss for this conversation, never the store: removed so it costs one miss
  remove(m, false, max)
  return {'miss', purged, redis.call('ZCARD', pfx .. 'lru'), 'corrupt'}
end
local h = redis.call('HMGET', pfx .. 'e:' .. m, 'v', 'u', 'd')
if not h[1] then
  -- indexed but its key is gone: Redis dropped it (maxmemory policy or the backstop TTL)
  remove(m, 'evicted', max)
  local reason
  if redis.call('HEXISTS', pfx .. 'ids', conv_of(m)) == 1 then
    reason = 'tenant'
  else
    reason = redis.call('HGET', pfx .. 'gone', m) or 'unknown'
  end
  return {'miss', purged, redis.call('ZCARD', pfx .. 'lru'), reason}
end
local usable = tonumber(h[2])
if not usable then
  -- written by something else than a router (or damaged): a miss for this conversation, never a script
  -- error (that would mark the whole store down); removed so it costs one miss
  remove(m, false, max)
  return {'miss', purged, redis.call('ZCARD', pfx .. 'lru'), 'corrupt'}
end
if tonumber(now) >= usable then
  return {'miss', purged, redis.call('ZCARD', pfx .. 'lru'), 'expired'}
end
-- stamped as used now, optimistically: the guard (checked by the caller) nearly always passes, and
-- a failed guard puts the previous stamp back (_UNTOUCH): one round trip for a hit, not two
local prev = redis.call('ZSCORE', pfx .. 'lru', m) or '0'
local stamp = redis.call('INCR', pfx .. 'seq')
redis.call('ZADD', pfx .. 'lru', 'XX', stamp, m)
return {'hit', purged, redis.call('ZCARD', pfx .. 'lru'), h[1], h[3], prev, tostring(stamp)}
"""

# ARGV: member, previous stamp, our stamp -> 1 if restored (nothing used the entry since our lookup)
_UNTOUCH = r"""
local pfx = KEYS[1]
if redis.call('ZSCORE', pfx .. 'lru', ARGV[1]) == ARGV[3] then
  redis.call('ZADD', pfx .. 'lru', 'XX', ARGV[2], ARGV[1])
  return 1
end
return 0
"""

# ARGV: now, member, max_entries, usable_until, data, backstop_ms, expected version ('' = any)
#   -> {status, purged, size, [version, evicted]}
_RECORD = _COMMON + r"""
local now, m, max, u, data, ttl, expect = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
local purged = purge(now, max, 100)
local k = pfx .. 'e:' .. m
if expect ~= '' and (foreign(k) or redis.call('HGET', k, 'v') ~= expect) then
  return {'conflict', purged, redis.call('ZCARD', pfx .. 'lru')}
end
remove(m, false, max)
if tonumber(now) >= tonumber(u) then
  remember_gone(m, 'expired', max)
  return {'expired', purged, redis.call('ZCARD', pfx .. 'lru')}
end
forget_gone(m)
local v = redis.call('INCR', pfx .. 'seq')
redis.call('HSET', k, 'v', v, 'u', u, 'd', data)
if ttl > 0 then redis.call('PEXPIRE', k, ttl) end
redis.call('ZADD', pfx .. 'lru', v, m)
redis.call('ZADD', pfx .. 'exp', u, m)
redis.call('HINCRBY', pfx .. 'ids', conv_of(m), 1)
local evicted = 0
while redis.call('ZCARD', pfx .. 'lru') > max do
  -- an expired entry the batch left goes first: a live one is evicted only when none is left
  if purge(now, max, 1) == 0 then
    remove(redis.call('ZRANGE', pfx .. 'lru', 0, 0)[1], 'evicted', max)
    evicted = evicted + 1
  else
    purged = purged + 1
  end
end
return {'stored', purged, redis.call('ZCARD', pfx .. 'lru'), tostring(v), evicted}
"""

# ARGV: member, expected version ('' = any), max_entries, why it leaves ('' = forgotten: no reason kept)
#   -> 1 if an entry was removed
_FORGET = _COMMON + r"""
local m, expect, max, why = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local k = pfx .. 'e:' .. m
if expect ~= '' and (foreign(k) or redis.call('HGET', k, 'v') ~= expect) then return 0 end
local present = redis.call('EXISTS', k)
remove(m, false, max)
if why ~= '' and present == 1 then remember_gone(m, why, max) else forget_gone(m) end
return present
"""

_MISS = {b"unknown": MissReason.UNKNOWN, b"expired": MissReason.EXPIRED, b"tenant": MissReason.TENANT,
         b"evicted": MissReason.EVICTED, b"taken": MissReason.TAKEN, b"corrupt": MissReason.CORRUPT}
# The entry's JSON carries its format ("fmt"). A router reads every format up to its own and misses (without
# deleting) on a newer one, so a fleet mid rolling upgrade serves every turn: the newer replicas still
# reuse what they wrote. Entries without "fmt" are format 1 (written before the field existed).
ENTRY_FORMAT = 1


class _BadEntry(ValueError):
    def __init__(self, reason: MissReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
_ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(ConversationEntry))
_SHARED_TIME_FIELDS = ("expires_at", "stored_at")  # on the router's clock in memory, wall clock in Redis


def member(tenant: str, conversation_id: str) -> bytes:
    t = tenant.encode("utf-8", "surrogatepass")
    return str(len(t)).encode() + b":" + t + conversation_id.encode("utf-8", "surrogatepass")


def _score(t: float) -> str:
    return repr(min(t, _FOREVER))  # repr round-trips a float exactly; Lua and ZSET scores are doubles


class _Pipelined:
    """One Redis connection every caller of this replica shares: the commands of one event-loop turn go
    out in one write and the replies come back in order (RESP answers in order on a connection).

    Through redis-py's client each call costs ~0.16 ms of this process's CPU and one connection; at a
    few dozen concurrent turns the calls queued behind each other past the store timeout (measured:
    c=64 served a sixth of the in-memory turns, reuse fell to 0.63). A pipelined round trip is ~33 us
    a command here. Built on redis-py's own Connection (URL parsing, AUTH, SELECT, TLS, hiredis).
    A caller that times out drops the connection (and fails the calls behind it): a reply that comes
    later can then never be taken for another call's.
    """

    def __init__(self, url: str, password: str | None, timeout_s: float) -> None:
        kwargs: dict[str, Any] = dict(aioredis.connection.parse_url(url))
        if password and not kwargs.get("password"):
            kwargs["password"] = password
        self._connection_class = kwargs.pop("connection_class", aioredis.Connection)
        self._kwargs = {**kwargs, "socket_timeout": None, "socket_connect_timeout": timeout_s}
        self.timeout_s = timeout_s
        self._conn: Any = None
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._outbox: list[tuple] = []
        self._flusher: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._connecting: asyncio.Lock | None = None

    async def _connection(self) -> Any:
        if self._conn is not None:
            return self._conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is None:
                conn = self._connection_class(**self._kwargs)
                await asyncio.wait_for(conn.connect(), self.timeout_s)  # AUTH and SELECT included
                self._conn = conn
                self._reader = asyncio.get_running_loop().create_task(self._read(conn))
        return self._conn

    async def call(self, *args: Any) -> Any:
        conn = await self._connection()
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self._outbox.append(args)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            self._drop(conn, redis.exceptions.TimeoutError("no reply from Redis within the store timeout"))
            raise redis.exceptions.TimeoutError(f"timeout: no reply from Redis within {self.timeout_s} s") from None

    async def _flush(self) -> None:
        # always the current connection: commands queued after a reconnect go out on the new one
        while self._outbox and self._conn is not None:
            conn = self._conn
            commands, self._outbox = self._outbox, []
            try:
                await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            except Exception as e:  # noqa: BLE001 - whatever broke the write, every waiting call fails with it
                self._drop(conn, e)

    async def _read(self, conn: Any) -> None:
        try:
            while True:
                try:
                    reply = await conn.read_response(disconnect_on_error=False)
                except redis.exceptions.ResponseError as e:  # an error reply: that call's, not the connection's
                    reply = e
                if not self._waiting:
                    raise redis.exceptions.ConnectionError("a reply nobody asked for")
                future = self._waiting.popleft()
                if not future.done():
                    if isinstance(reply, Exception):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - connection lost or unreadable: fail what waits on it
            self._drop(conn, e)

    def _drop(self, conn: Any, error: BaseException) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        waiting, self._waiting, self._outbox = self._waiting, collections.deque(), []
        for future in waiting:
            if not future.done():
                future.set_exception(error if isinstance(error, redis.exceptions.RedisError)
                                     else redis.exceptions.ConnectionError(str(error)))
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        asyncio.get_running_loop().create_task(conn.disconnect())

    async def close(self) -> None:
        if self._conn is not None:
            self._drop(self._conn, redis.exceptions.ConnectionError("closed"))
        for task in (self._reader, self._flusher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


class RedisStore:
    """The awaited store protocol of :mod:`impl.router.stores`, in Redis."""

    def __init__(self, client: Any, *, max_entries: int = 100_000, expiry_margin_s: float = 5.0, retry_s: float = 1.0,
                 prefix: str = "bidikv:", pending_wait_s: float = 2.0, clock_offset: float | None = None,
                 name: str = "redis", pipelined: _Pipelined | None = None) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.client = client  # redis-py: the calls off a turn's path (heartbeats, pending marks, admin)
        self._pipe = pipelined  # a turn's lookup and store scripts, pipelined (see _Pipelined)
        self.max_entries = max_entries
        self.expiry_margin_s = expiry_margin_s
        self.retry_s = retry_s
        self.prefix = prefix
        self.pending_wait_s = pending_wait_s
        self.name = name
        # the router's clock is monotonic (per process); replicas share the wall clock
        self.offset = time.time() - time.monotonic() if clock_offset is None else clock_offset
        self._lookup = client.register_script(_LOOKUP)
        self._untouch = client.register_script(_UNTOUCH)
        self._record = client.register_script(_RECORD)
        self._forget = client.register_script(_FORGET)
        self.stats = StoreStats()
        self.errors = 0  # calls that raised StoreUnavailable (failed, or refused while the store is down)
        self.pending_polls = 0  # lookups repeated because another turn's update was pending
        self.bad_entries: collections.Counter = collections.Counter()  # entries it could not use, by kind
        self._bad_logged: set[str] = set()
        self._size = 0  # live entries, as of the last script's answer (for the gauge; never a decision)
        self._down_until = -math.inf
        self._down = False

    @classmethod
    def from_url(cls, url: str, *, password: str | None = None, timeout_s: float = 0.5, max_connections: int = 16,
                 **kwargs: Any) -> "RedisStore":
        extra: dict[str, Any] = {}
        if password and not urlsplit(url).password:
            extra["password"] = password
        # one immediate retry on a fresh connection after a connection error: a pooled connection to a
        # Redis that restarted fails once and then works. Never after a timeout: a turn would wait
        # timeout_s twice for a Redis that is stuck
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
        # a small bounded pool whose callers wait (at most timeout_s) for a free connection: redis-py's
        # default pool raises "Too many connections" beyond 100 concurrent calls (an outage at a few
        # hundred concurrent turns), and opening many connections at once is what times out on a busy
        # machine; a call takes ~0.1-0.2 ms, so 16 connections carry tens of thousands a second
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout_s,
                                                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                        retry=retry, **extra)
        client = aioredis.Redis(connection_pool=pool, retry=retry)
        parts = urlsplit(url)
        return cls(client, name=f"{parts.scheme}://{parts.hostname or ''}:{parts.port or ''}{parts.path}",
                   pipelined=_Pipelined(url, password, timeout_s), **kwargs)

    # -- faults -----------------------------------------------------------------------------------
    async def _call(self, call) -> Any:
        if time.monotonic() < self._down_until:
            self.errors += 1
            raise StoreUnavailable(f"conversation store {self.name} is down")
        try:
            result = await call()
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as e:  # no answer we can use
            self.errors += 1
            self._down_until = time.monotonic() + self.retry_s
            if not self._down:
                self._down = True
                log.warning("conversation store %s unreachable (%s: %s): serving turns without reuse until it "
                            "answers again", self.name, type(e).__name__, e)
            raise StoreUnavailable(str(e)) from None
        if self._down:
            self._down = False
            log.warning("conversation store %s reachable again: reusing KV again", self.name)
        return result

    def _script(self, script, *args: Any):
        if self._pipe is None:
            return self._call(lambda: script(keys=[self.prefix], args=list(args)))
        return self._call(lambda: self._evalsha(script, args))

    async def _evalsha(self, script, args: tuple) -> Any:
        try:
            return await self._pipe.call("EVALSHA", script.sha, 1, self.prefix, *args)
        except redis.exceptions.NoScriptError:  # a restarted (or flushed) Redis: load it, once
            await self._pipe.call("SCRIPT", "LOAD", script.script)
            return await self._pipe.call("EVALSHA", script.sha, 1, self.prefix, *args)

    # -- encoding ---------------------------------------------------------------------------------
    def _encode(self, entry: ConversationEntry) -> bytes:
        data = {name: getattr(entry, name) for name in _ENTRY_FIELDS}
        for name in _SHARED_TIME_FIELDS:
            data[name] = data[name] + self.offset
        data["kv_params"] = dict(data["kv_params"])
        data["fmt"] = ENTRY_FORMAT
        return json.dumps(data, separators=(",", ":")).encode()

    def _decode(self, raw: bytes) -> ConversationEntry:
        """The entry, or _BadEntry: CORRUPT (not ours, damaged) or OTHER_VERSION (a newer router's)."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise _BadEntry(MissReason.CORRUPT, "not JSON") from None
        if not isinstance(data, dict):
            raise _BadEntry(MissReason.CORRUPT, "not a JSON object")
        fmt = data.pop("fmt", 1)
        if type(fmt) is not int:
            raise _BadEntry(MissReason.CORRUPT, f"format {fmt!r}")
        if fmt > ENTRY_FORMAT:
            raise _BadEntry(MissReason.OTHER_VERSION, f"format {fmt} (this router reads up to {ENTRY_FORMAT})")
        try:
            for name in _SHARED_TIME_FIELDS:
                data[name] = data[name] - self.offset
            # fields a newer router added are dropped; fields it lacks keep their defaults
            entry = ConversationEntry(**{k: v for k, v in data.items() if k in _ENTRY_FIELDS})
        except (KeyError, TypeError) as e:
            raise _BadEntry(MissReason.CORRUPT, f"fields: {e}") from None
        if not isinstance(entry.kv_params, dict) or type(entry.num_tokens) is not int or type(entry.held_len) is not int \
                or not isinstance(entry.decode_instance, str) or not isinstance(entry.expires_at, (int, float)) \
                or not (entry.held_digest is None or isinstance(entry.held_digest, str)):
            raise _BadEntry(MissReason.CORRUPT, "a field of the wrong type")
        # what reaches headers, counters and the guard: a count a model's context can hold, a real time
        if not (0 <= entry.num_tokens <= MAX_STORED_TOKENS and 0 <= entry.held_len <= MAX_STORED_TOKENS) \
                or entry.expires_at != entry.expires_at or entry.stored_at != entry.stored_at:
            raise _BadEntry(MissReason.CORRUPT, "a number out of range")
        return entry

    def _bad_entry(self, e: _BadEntry, m: bytes) -> None:
        self.bad_entries[e.reason.value] += 1
        if e.reason.value not in self._bad_logged:  # once per kind: a damaged store must not flood the log
            self._bad_logged.add(e.reason.value)
            log.warning("conversation store: an entry this router cannot use (%s: %s): served as a miss%s",
                        e.reason.value, e, ", and deleted" if e.reason is MissReason.CORRUPT else
                        " (kept for the replicas that wrote it)")

    def _shared(self, now: float) -> str:
        return repr(now + self.offset)

    # -- the protocol -----------------------------------------------------------------------------
    async def lookup(self, tenant: str, conversation_id: str, prompt: PromptView, now: float) -> Lookup:
        return (await self._lookup_versioned(tenant, conversation_id, prompt, now))[0]

    async def take(self, tenant: str, conversation_id: str, prompt: PromptView, now: float) -> Lookup:
        found, version = await self._lookup_versioned(tenant, conversation_id, prompt, now)
        if found.entry is None:
            return found
        # only the replica whose delete removed this very version got it; another took it in between
        if not int(await self._script(self._forget, member(tenant, conversation_id), version, self.max_entries,
                                      MissReason.TAKEN.value)):
            self.stats.hits -= 1
            return self._miss(MissReason.TAKEN)
        return found

    async def _lookup_versioned(self, tenant: str, conversation_id: str, prompt: PromptView,
                                now: float) -> tuple[Lookup, bytes | None]:
        m = member(tenant, conversation_id)
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            # the previous turn, on some replica, awaits D's notification: let it land (bounded), then
            # take what is stored
            wait = b"1" if waited < self.pending_wait_s else b"0"
            reply = await self._script(self._lookup, self._shared(now + waited), m, self.max_entries, wait)
            self.stats.purged += int(reply[1])
            self._size = int(reply[2])
            if reply[0] != b"pending":
                break
            self.pending_polls += 1
            await asyncio.sleep(_PENDING_POLL_S)
        if reply[0] == b"hit":
            try:
                entry = self._decode(reply[4])
            except _BadEntry as e:
                self._bad_entry(e, m)
                if e.reason is MissReason.CORRUPT:
                    try:  # only the very entry read: a good one stored meanwhile stays
                        await self._script(self._forget, m, reply[3], self.max_entries, "")
                    except StoreUnavailable:
                        pass
                else:
                    try:
                        await self._script(self._untouch, m, reply[5], reply[6])
                    except StoreUnavailable:
                        pass
                return self._miss(e.reason), None
            # the guard of ConversationStore.lookup (no digest: the reader verifies token ids itself)
            if not guard_passes(entry, prompt):
                try:
                    await self._script(self._untouch, m, reply[5], reply[6])
                except StoreUnavailable:
                    pass  # the entry merely looks more recently used than it was
                return self._miss(MissReason.GUARD), None
            self.stats.hits += 1
            return Lookup(entry, None), reply[3]
        return self._miss(_MISS.get(reply[3], MissReason.UNKNOWN)), None

    def _miss(self, reason: MissReason) -> Lookup:
        self.stats.misses[reason] += 1
        return Lookup(None, reason)

    async def _write(self, tenant: str, conversation_id: str, entry: ConversationEntry, now: float,
                     expect: str) -> bytes:
        until = usable_until(entry.expires_at, self.expiry_margin_s)
        backstop_ms = 0 if math.isinf(until) else max(1, int((until - now + BACKSTOP_GRACE_S) * 1000))
        reply = await self._script(self._record, self._shared(now), member(tenant, conversation_id), self.max_entries,
                                   _score(until + self.offset), self._encode(entry), backstop_ms, expect)
        self.stats.purged += int(reply[1])
        self._size = int(reply[2])
        if reply[0] == b"stored":
            self.stats.evictions += int(reply[4])
        return reply[0]

    async def record_success(self, tenant: str, conversation_id: str, entry: ConversationEntry, now: float) -> None:
        await self._write(tenant, conversation_id, entry, now, "")

    async def replace(self, tenant: str, conversation_id: str, entry: ConversationEntry, now: float,
                      expect: Any) -> bool:
        return await self._write(tenant, conversation_id, entry, now, expect) != b"conflict"

    async def forget(self, tenant: str, conversation_id: str, expect: Any = None) -> bool:
        return bool(await self._script(self._forget, member(tenant, conversation_id), expect or "", self.max_entries, ""))

    async def get(self, tenant: str, conversation_id: str) -> Versioned | None:
        key = self.prefix.encode() + b"e:" + member(tenant, conversation_id)

        async def read() -> list:
            # TYPE first, in the same round trip: a key that is not a hash is no entry of ours, and HMGET on
            # it would fail (WRONGTYPE) like an unreachable store
            async with self.client.pipeline(transaction=False) as pipe:
                return await pipe.type(key).hmget(key, "v", "d").execute(raise_on_error=False)

        kind, fields = await self._call(read)
        if kind not in (b"hash", "hash"):
            if kind not in (b"none", "none"):
                self._bad_entry(_BadEntry(MissReason.CORRUPT, f"a Redis {kind!r}, not an entry"),
                                member(tenant, conversation_id))
            return None
        if isinstance(fields, Exception):
            raise StoreUnavailable(str(fields))
        version, data = fields
        if version is None or data is None:
            return None
        try:
            return Versioned(self._decode(data), version.decode())
        except _BadEntry as e:  # a heartbeat for it: nothing to renew
            self._bad_entry(e, member(tenant, conversation_id))
            return None

    async def claim_tenancy(self, mode: str, key_map: dict[str, str] | None = None) -> None:
        """Record this fleet's tenancy (``open``: no API keys, every client is tenant ``default``;
        ``keyed``) on first start, and refuse a replica whose mode differs: its clients would share the
        other replicas' conversations under another tenancy (ValueError, at start-up).

        ``key_map`` (:meth:`impl.router.tenants.Tenants.key_map`): per API key, an id of the key -> a
        digest of its tenant keyed by the key. Each is recorded on first sight, and a replica that maps a
        key the fleet knows to another tenant is refused: a key of B's mapped to A on one replica would
        read A's conversations there. A key added later (rotation) is simply recorded; neither keys nor
        tenant names are stored."""
        key = self.prefix + "tenancy"
        await self._call(lambda: self.client.set(key, mode, nx=True))
        stored = await self._call(lambda: self.client.get(key))
        stored = stored.decode() if isinstance(stored, bytes) else stored
        if stored != mode:
            raise ValueError(f"--store: the replicas sharing this store (prefix {self.prefix!r}) run {stored} "
                             f"(API keys {'configured' if stored == 'keyed' else 'absent'}) and this one {mode}: "
                             "start every replica with the same API keys, or give this one its own --store-prefix")
        if not key_map:
            return
        fields = sorted(key_map)
        map_key = self.prefix + "key_map"

        async def claim() -> list:
            async with self.client.pipeline(transaction=True) as pipe:
                for field in fields:
                    pipe.hsetnx(map_key, field, key_map[field])
                pipe.hmget(map_key, fields)
                return (await pipe.execute())[-1]

        recorded = await self._call(claim)
        differing = sum(1 for field, value in zip(fields, recorded)
                        if value is not None and (value.decode() if isinstance(value, bytes) else value) != key_map[field])
        if differing:
            raise ValueError(f"--store: {differing} of this replica's {len(fields)} API key(s) belong to another tenant on "
                             f"the replicas sharing this store (prefix {self.prefix!r}): start every replica with the "
                             "same key file, or give this one its own --store-prefix (to remap a key fleet-wide, "
                             f"delete the {map_key!r} hash first)")

    async def mark_pending(self, tenant: str, conversation_id: str, ttl_s: float) -> None:
        key = self.prefix.encode() + b"p:" + member(tenant, conversation_id)
        await self._call(lambda: self.client.set(key, b"1", px=max(1, int(ttl_s * 1000))))

    async def clear_pending(self, tenant: str, conversation_id: str) -> None:
        key = self.prefix.encode() + b"p:" + member(tenant, conversation_id)
        await self._call(lambda: self.client.delete(key))

    async def remember_listener(self, engine_id: str, url: str) -> None:
        # bounded like the in-process directory: engine ids change when a D restarts
        key, order = self.prefix + "listeners", self.prefix + "listeners_order"

        async def write() -> None:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(key, engine_id, url).zadd(order, {engine_id: time.time()})
                pipe.zrange(order, 0, -MAX_ENGINES - 1)  # all but the newest MAX_ENGINES
                *_, stale = await pipe.execute()
            if stale:
                async with self.client.pipeline(transaction=True) as pipe:
                    await pipe.hdel(key, *stale).zrem(order, *stale).execute()

        await self._call(write)

    async def listener(self, engine_id: str) -> str | None:
        url = await self._call(lambda: self.client.hget(self.prefix + "listeners", engine_id))
        return None if url is None else url.decode()

    async def size(self) -> int:
        """The live entries right now (one round trip; ``len()`` is the last answer's count)."""
        self._size = int(await self._call(lambda: self.client.zcard(self.prefix + "lru")))
        return self._size

    def __len__(self) -> int:
        return self._size

    @property
    def evictions(self) -> int:
        return self.stats.evictions

    async def close(self) -> None:
        if self._pipe is not None:
            await self._pipe.close()
        await self.client.aclose()
