"""The conversation store as the router sees it: awaited, so it can live in this process or in Redis.

:class:`impl.policy.ConversationStore` is pure and synchronous (the rules: tenant scoping, expiry
with margin, the continuation guard, single-use ``take``, bounded LRU). A router fleet
needs those same rules on a server every replica reaches, so the router talks to this
protocol and never to a backend directly:

* :class:`MemoryStore` -- the embedded default: impl.policy's store, wrapped (no I/O, ~1 us a call);
* :class:`impl.router.store_redis.RedisStore` -- ``--store redis://...``: shared by replicas, survives
  router restarts, atomic through Lua scripts.

Entries carry an opaque ``version`` so that a read-modify-write (a heartbeat renewing an entry, a
410 forgetting one) replaces exactly the entry it read: in one process "is it still the same
object" was enough; across replicas another replica may have stored a newer turn in between, and
writing back the renewed *older* entry would point the conversation at blocks that newer turn's P
has already read (D frees them on that read).

A backend that cannot answer raises :class:`StoreUnavailable`; the router then serves the turn
without reuse (impl.router.proxy / recorder count it), never fails it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from impl.policy import ConversationEntry, ConversationStore, Lookup
from impl.policy.continuation import PromptView


class StoreUnavailable(Exception):
    """The store could not be reached (or answered nonsense): serve without reuse."""


@dataclass(frozen=True, slots=True)
class Versioned:
    entry: ConversationEntry
    version: Any  # opaque; equal only for the very same stored entry


class RouterStore(Protocol):
    async def lookup(self, tenant: str, conversation_id: str, prompt: PromptView, now: float) -> Lookup: ...

    # lookup, and a hit leaves the store in the same step (a single-use history key)
    async def take(self, tenant: str, conversation_id: str, prompt: PromptView, now: float) -> Lookup: ...

    async def record_success(self, tenant: str, conversation_id: str, entry: ConversationEntry, now: float) -> None: ...

    async def get(self, tenant: str, conversation_id: str) -> Versioned | None: ...

    async def replace(self, tenant: str, conversation_id: str, entry: ConversationEntry, now: float,
                      expect: Any) -> bool: ...

    async def forget(self, tenant: str, conversation_id: str, expect: Any = None) -> bool: ...

    async def mark_pending(self, tenant: str, conversation_id: str, ttl_s: float) -> None: ...

    async def clear_pending(self, tenant: str, conversation_id: str) -> None: ...

    # D's heartbeat listener per engine (impl.router.heartbeat): learnt by the replica D notified,
    # needed by whichever replica a client's heartbeat reaches
    async def remember_listener(self, engine_id: str, url: str) -> None: ...

    async def listener(self, engine_id: str) -> str | None: ...

    def __len__(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    async def close(self) -> None: ...


class MemoryStore:
    """impl.policy's store behind the awaited protocol; the version is the entry object itself."""

    def __init__(self, store: ConversationStore) -> None:
        self.store = store

    async def lookup(self, tenant: str, conversation_id: str, prompt: PromptView, now: float) -> Lookup:
        return self.store.lookup(tenant, conversation_id, prompt, now)

    async def take(self, tenant: str, conversation_id: str, prompt: PromptView, now: float) -> Lookup:
        return self.store.take(tenant, conversation_id, prompt, now)

    async def record_success(self, tenant: str, conversation_id: str, entry: ConversationEntry, now: float) -> None:
        self.store.record_success(tenant, conversation_id, entry, now)

    async def get(self, tenant: str, conversation_id: str) -> Versioned | None:
        entry = self.store.get(tenant, conversation_id)
        # the object's id: the caller holds the entry, so the id cannot be reused while it compares
        return None if entry is None else Versioned(entry, id(entry))

    async def replace(self, tenant: str, conversation_id: str, entry: ConversationEntry, now: float,
                      expect: Any) -> bool:
        if id(self.store.get(tenant, conversation_id)) != expect:
            return False
        self.store.record_success(tenant, conversation_id, entry, now)
        return True

    async def forget(self, tenant: str, conversation_id: str, expect: Any = None) -> bool:
        if expect is not None and id(self.store.get(tenant, conversation_id)) != expect:
            return False
        return self.store.forget(tenant, conversation_id)

    # one process: the recorder's own per-conversation wait (TurnRecorder.wait_pending) covers it
    async def mark_pending(self, tenant: str, conversation_id: str, ttl_s: float) -> None:
        pass

    async def clear_pending(self, tenant: str, conversation_id: str) -> None:
        pass

    async def remember_listener(self, engine_id: str, url: str) -> None:
        pass  # the relay's own directory is the whole truth in one process

    async def listener(self, engine_id: str) -> str | None:
        return None

    def __len__(self) -> int:
        return len(self.store)

    @property
    def evictions(self) -> int:
        return self.store.stats.evictions

    async def close(self) -> None:
        pass


STORE_SCHEMES = ("redis", "rediss", "unix")
# listener URLs remembered per store, in process or in Redis (engine ids change when a D restarts)
MAX_ENGINES = 4096


def check_store_url(url: str) -> None:
    """``memory`` or a Redis URL; raises ValueError naming ``--store`` otherwise (no connection made)."""
    if url == "memory":
        return
    shown = redact(url)  # the message may reach logs: never the password
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as e:
        raise ValueError(f"--store: not a valid URL ({e}): {shown!r}") from None
    if parts.scheme not in STORE_SCHEMES:
        raise ValueError(f"--store must be 'memory' or a redis://HOST:PORT/DB, rediss://... or unix://PATH URL, "
                         f"got {shown!r}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"--store: a unix:// URL needs a socket path, got {shown!r}")
        return
    if not parts.hostname:
        raise ValueError(f"--store: the URL needs a host, got {shown!r}")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"--store: the database must be a number (redis://HOST:PORT/0), got {db!r}")


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{hostpart}"
