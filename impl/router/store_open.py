"""Which conversation store a router runs: the one ``--store`` names, built from the router's config.

Kept out of :mod:`impl.router.stores`: every backend builds on that protocol module, so the one place
that knows every backend cannot live in it without each depending on the other.
"""

from __future__ import annotations

from typing import Any

from impl.policy import ConversationStore
from impl.router.stores import MemoryStore, RouterStore


def open_store(config: Any, environ: dict[str, str] | Any) -> RouterStore:
    """The store ``config.store`` names (impl.router.config.RouterConfig). Replicas sharing a Redis
    store should share ``--max-conversations`` too: the bound is enforced by whichever one stores."""
    if config.store == "memory":
        return MemoryStore(ConversationStore(max_entries=config.max_conversations, expiry_margin_s=config.expiry_margin_s,
                                             max_bytes=config.max_store_bytes))
    from impl.router.store_redis import RedisStore  # the redis client is imported only when used

    return RedisStore.from_url(config.store, password=environ.get(config.store_password_env) or None,
                               max_entries=config.max_conversations, expiry_margin_s=config.expiry_margin_s,
                               timeout_s=config.store_timeout_s, retry_s=config.store_retry_s,
                               max_connections=config.store_max_connections,
                               prefix=config.store_prefix, pending_wait_s=config.notify_wait_s)
