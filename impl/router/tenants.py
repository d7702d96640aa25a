"""API keys -> tenants. Conversations are scoped to the tenant of the key that sent them.

vLLM's example proxy has no tenants: anyone who knows a conversation id reuses its KV. Here the
store key is ``(tenant, conversation_id)``, so the same id under another key is a different
conversation (and the store reports the collision as a ``tenant`` miss).

Sources, merged: a file of ``<tenant> <key>`` lines (``#`` comments, blank lines ignored) and an
environment variable ``tenant=key,tenant=key``. A tenant may have several keys (rotation). With no
key configured at all the router runs open with a single tenant, :data:`DEFAULT_TENANT`: fine for a
single-user or already-authenticated deployment, and it keeps the behaviour of vLLM's proxy.

The store is not the only shared state: P's and D's own prefix caches hash blocks across requests,
so a tenant could time its own requests to learn whether another tenant sent a prefix. With keys
configured the router therefore sets vLLM's per-request ``cache_salt`` to :func:`cache_salt_for` the
tenant (folding in a salt the client sent, which then partitions further within its tenant). A pull
reads blocks by id, not by hash, so reuse across a tenant's own turns is unaffected.

A fleet sharing one store must agree on this: a replica without keys maps every client to
``default``, so keyed tenants may not take that name, and a shared store remembers whether its fleet runs
open or keyed and refuses a replica that differs, or that maps a key the fleet knows to another tenant
(:meth:`impl.router.store_redis.RedisStore.claim_tenancy`, with :meth:`Tenants.key_map`).

Keys are kept only as SHA-256 digests and looked up by the digest of the presented key, so the
lookup time does not depend on how much of a key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Mapping

DEFAULT_TENANT = "default"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class Tenants:
    by_key_digest: Mapping[bytes, str]

    @property
    def open(self) -> bool:
        """True when no key is configured: every request is the default tenant."""
        return not self.by_key_digest

    def key_map(self) -> dict[str, str]:
        """What a shared store compares between replicas (impl.router.store_redis.claim_tenancy), per key: an
        id of the key -> a digest of its tenant keyed by the key. Neither key nor tenant can be read back,
        and without the key nobody can tell which tenant an id maps to."""
        return {hashlib.blake2b(d, digest_size=16, person=b"bidikv-key-id").hexdigest():
                hmac.new(d, b"bidikv-tenant\0" + tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
                for d, tenant in self.by_key_digest.items()}

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer <key>`` header, or None if it does not authenticate."""
        if self.open:
            return DEFAULT_TENANT
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self.by_key_digest.get(_digest(key.strip()))

    @classmethod
    def load(cls, path: str | None = None, env_var: str | None = None, environ: Mapping[str, str] | None = None) -> "Tenants":
        pairs: list[tuple[str, str]] = []
        if path:
            with open(path, encoding="utf-8") as f:
                for lineno, raw in enumerate(f, 1):
                    line = raw.strip()
                    if not line or line.startswith("#"):
                        continue
                    parts = line.split()
                    if len(parts) != 2:
                        raise ValueError(f"{path}:{lineno}: expected '<tenant> <key>'")
                    pairs.append((parts[0], parts[1]))
        environ = os.environ if environ is None else environ
        value = environ.get(env_var, "") if env_var else ""
        for i, item in enumerate(p for p in value.split(",") if p.strip()):
            tenant, sep, key = item.strip().partition("=")
            if not sep or not tenant or not key:
                raise ValueError(f"{env_var}: item {i} must be 'tenant=key'")
            pairs.append((tenant, key))
        table: dict[bytes, str] = {}
        for tenant, key in pairs:
            if tenant == DEFAULT_TENANT:
                # a router without keys names every client so: a keyed tenant of that name would share
                # conversations with an open replica on the same store (impl.router.store_redis: tenancy)
                raise ValueError(f"API keys: a tenant cannot be named {DEFAULT_TENANT!r}, the tenant of every "
                                 "request on a router without keys; rename it")
            d = _digest(key)
            if table.get(d, tenant) != tenant:
                raise ValueError(f"one API key is configured for two tenants ({table[d]!r} and {tenant!r})")
            table[d] = tenant
        return cls(table)


def cache_salt_for(tenant: str, client_salt: str | None) -> str:
    """vLLM ``cache_salt`` for a tenant's request. Bound to the tenant name, so no client salt of one
    tenant can reproduce another tenant's salt."""
    material = tenant.encode("utf-8", "surrogatepass") + b"\0" + (client_salt or "").encode("utf-8", "surrogatepass")
    return "bidikv-" + hashlib.sha256(material).hexdigest()[:32]
