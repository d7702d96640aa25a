"""The router's conversation store: (tenant, conversation_id) -> where the last turn's KV lives.

vLLM's example proxy keeps an unbounded dict, pops the entry on use (a failed turn loses it while D
keeps the blocks pinned) and lets any client that knows an id reuse another's KV. This store:

* scopes entries by tenant (a foreign tenant's id is a miss, reported as such);
* answers a hit only if unexpired with a safety margin (default 5 s: vLLM's P declines reads that
  close to ``remote_blocks_expiry_time``) and the new prompt continues the sequence D holds;
* offers each entry once (``take``, what the router calls): P's read makes D free the blocks, so a
  turn that fails after P read must not offer them to its retry; ``lookup`` (no consumption) is for
  callers that never hand the params to a P. A successful turn stores the next entry;
* is bounded, evicting the least recently used entry, and purges expired entries in amortised O(1)
  per entry through a wheel of one-second buckets.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from impl.policy.block_ids import BLOCK_IDS, CompactParams
from impl.policy.continuation import PromptView, continues
from impl.policy.fastinit import frozen_init

DEFAULT_EXPIRY_MARGIN_S = 5.0


def usable_until(expires_at: float, margin_s: float) -> float:
    """When an entry stops being offered: ``margin_s`` before D's expiry (P declines reads that close
    to it). Usable while ``now < usable_until(...)``; the one statement of the rule, for every backend
    of the store and every model of it."""
    return expires_at - margin_s


class MissReason(enum.Enum):
    UNKNOWN = "unknown"  # never stored, or forgotten long enough ago that we no longer remember it
    EXPIRED = "expired"  # past expiry minus the margin
    GUARD = "guard"  # the new prompt does not continue the held sequence
    TENANT = "tenant"  # the id exists, under another tenant
    EVICTED = "evicted"  # dropped by the LRU bound
    TAKEN = "taken"  # a history entry another turn took first (impl.policy.history_key: single-use)
    # a shared store's entry this router cannot use: damaged or not a router's (deleted), or written by a
    # newer router (kept for it) -- impl.router.store_redis
    CORRUPT = "corrupt"
    OTHER_VERSION = "other_version"


@frozen_init  # built per turn: see impl.policy.fastinit
@dataclass(frozen=True, slots=True)
class ConversationEntry:
    decode_instance: str
    kv_params: Mapping[str, Any]  # D's kv_transfer_params, forwarded verbatim to P next turn
    expires_at: float  # D's remote_blocks_expiry_time on the router's clock
    num_tokens: int  # tokens of KV D holds (remote_num_tokens)
    held_len: int  # guard: length of the held sequence in digest items
    # guard: digest of those items; None when the reader verifies token ids itself (D published
    # impl.policy.prefix_check checkpoints), so the message-level guard is not needed and not applied
    held_digest: str | None
    stored_at: float = 0.0


def guard_passes(entry: ConversationEntry, prompt: PromptView) -> bool:
    """The store's continuation rule, one for every backend: an entry whose reader verifies token ids
    itself (no digest) passes; otherwise the prompt must continue the held sequence."""
    return entry.held_digest is None or continues(prompt, entry.held_len, entry.held_digest)


@frozen_init  # built per turn: see impl.policy.fastinit
@dataclass(frozen=True, slots=True)
class Lookup:
    entry: ConversationEntry | None
    miss: MissReason | None

    @property
    def hit(self) -> bool:
        return self.entry is not None


@dataclass(slots=True)
class StoreStats:
    hits: int = 0
    misses: collections.Counter = field(default_factory=collections.Counter)
    evictions: int = 0
    purged: int = 0


Key = tuple[str, str]

# What one entry costs besides its params, measured with tracemalloc on CPython 3.11: the entry
# object, its slots in the OrderedDict, the expiry wheel, the per-id tenant counter and the key tuple.
_ENTRY_OVERHEAD_BYTES = 400


def _approx_bytes(value: Any) -> int:
    """Bytes ``value`` holds, estimated cheaply: D's block id lists (nearly all of an entry) are sized
    from their length, not walked element by element (an int from json is 28 bytes, 32 allocated)."""
    t = type(value)
    if t is int:
        return 32 if not -5 <= value <= 256 else 0
    if t is str or t is float or t is bytes:
        return sys.getsizeof(value)
    if t is list or t is tuple:
        size = sys.getsizeof(value)
        if len(value) > 8 and type(value[0]) is int and type(value[-1]) is int:
            return size + 32 * len(value)  # D's ids: homogeneous ints
        return size + sum(_approx_bytes(v) for v in value)
    if t is dict:
        size = sys.getsizeof(value)
        # every stored entry's params are sized: str keys and D's scalar values (ints, strs) are sized
        # here rather than through a call each; anything else recurses
        for k, v in value.items():
            size += sys.getsizeof(k) if type(k) is str else _approx_bytes(k)
            tv = type(v)
            if tv is int:
                size += 32 if not -5 <= v <= 256 else 0
            elif tv is str:
                size += sys.getsizeof(v)
            else:
                size += _approx_bytes(v)
        return size
    if value is None or t is bool:
        return 0
    return sys.getsizeof(value)


def entry_bytes(key: Key, entry: ConversationEntry) -> int:
    """What storing ``entry`` under ``key`` costs in memory (the store's byte bound counts this)."""
    params = entry.kv_params
    if type(params) is CompactParams:
        params_bytes = (sys.getsizeof(params) + _approx_bytes(params.fields()) + params.group_bytes()
                        + sum(_approx_bytes(g) for g in params.unpacked_groups()))
    else:
        params_bytes = _approx_bytes(params if type(params) is dict else dict(params))
    size = _ENTRY_OVERHEAD_BYTES + params_bytes
    for text in (key[0], key[1], entry.decode_instance, entry.held_digest):  # strs (a digest may be None)
        if text is not None:
            size += sys.getsizeof(text) if type(text) is str else _approx_bytes(text)
    return size


def _compacted(entry: ConversationEntry) -> ConversationEntry:
    """``entry`` with D's block ids packed (impl.policy.block_ids): ~40 bytes per id become a range
    or 4 bytes, and readers still get D's exact lists."""
    params = entry.kv_params
    blocks = params.get(BLOCK_IDS)
    if type(params) is CompactParams or type(blocks) is not list:
        return entry
    if sum(len(g) for g in blocks if type(g) is list) < 64:
        return entry  # a short context: packing would save less than the ~7 us it costs on every turn
    return dataclasses.replace(entry, kv_params=CompactParams(params))


# a miss carries nothing but its reason, so each is built once (Lookup is immutable)
_MISSES = {reason: Lookup(None, reason) for reason in MissReason}


class ConversationStore:
    def __init__(self, max_entries: int = 100_000, expiry_margin_s: float = DEFAULT_EXPIRY_MARGIN_S, bucket_s: float = 1.0,
                 max_bytes: int | None = None) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        # An entry grows with D's remote_block_ids (~80 KB at 2,000 blocks), so a bound in entries
        # alone is no memory bound: both hold, LRU eviction serves whichever is exceeded.
        self.max_bytes = max_bytes
        self._bytes = 0  # entry_bytes summed over the live entries in _sizes
        self._sizes: dict[Key, int] = {}
        # Without a byte bound nothing needs an entry's size when it is stored, only a reader of
        # ``bytes``: live entries are sized then, so one replaced before anyone looks is never sized.
        self._unsized: dict[Key, None] = {}
        if not (expiry_margin_s >= 0 and math.isfinite(expiry_margin_s)):
            raise ValueError(f"expiry_margin_s must be a finite number >= 0, got {expiry_margin_s}")
        if not (bucket_s > 0 and math.isfinite(bucket_s)):
            raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
        self.max_entries = max_entries
        self.expiry_margin_s = expiry_margin_s
        self._bucket_s = bucket_s
        self._entries: collections.OrderedDict[Key, ConversationEntry] = collections.OrderedDict()
        self._tenants_per_id: dict[str, int] = {}  # conversation id -> live entries under it (never 0)
        # Remembers why recent keys left, only to report the miss reason; bounded like the store.
        self._gone: collections.OrderedDict[Key, MissReason] = collections.OrderedDict()
        self._wheel: dict[int, dict[Key, ConversationEntry]] = {}  # holds exactly the live entries
        self._bucket_of: dict[Key, int] = {}  # each live entry's wheel bucket
        self._swept_below = -math.inf  # every bucket index below this has been swept
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """entry_bytes summed over the live entries (what ``max_bytes`` bounds)."""
        if self._unsized:
            for key in self._unsized:
                size = self._sizes[key] = entry_bytes(key, self._entries[key])
                self._bytes += size
            self._unsized.clear()
        return self._bytes

    def lookup(self, tenant: str, conversation_id: str, prompt: PromptView, now: float) -> Lookup:
        found = self.lookup_entry(tenant, conversation_id, prompt, now)
        return _MISSES[found] if type(found) is MissReason else Lookup(found, None)

    def lookup_entry(self, tenant: str, conversation_id: str, prompt: PromptView,
                     now: float) -> ConversationEntry | MissReason:
        """:meth:`lookup` without the Lookup: the entry on a hit, else why it missed (the same checks,
        stats and recency update), for a caller that reads one or the other once per request."""
        # purge's own first test, here: ``now`` still in the bucket swept last (nearly every call)
        if not -math.inf < now / self._bucket_s < self._swept_below + 1:
            self.purge(now)
        key = (tenant, conversation_id)
        entry = self._entries.get(key)
        if entry is None:
            # another tenant holding this id is the signal worth counting (probing or a collision)
            if conversation_id in self._tenants_per_id:
                return self._miss(MissReason.TENANT)
            return self._miss(self._gone.get(key, MissReason.UNKNOWN))
        if now >= usable_until(entry.expires_at, self.expiry_margin_s):
            return self._miss(MissReason.EXPIRED)
        if entry.held_digest is not None and not guard_passes(entry, prompt):
            return self._miss(MissReason.GUARD)
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry

    def take(self, tenant: str, conversation_id: str, prompt: PromptView, now: float) -> Lookup:
        """:meth:`lookup`, and on a hit the entry leaves the store: for keys that can be offered once
        (impl.policy.history_key). A later lookup of the key misses as ``taken``."""
        found = self.lookup_entry(tenant, conversation_id, prompt, now)
        if type(found) is MissReason:
            return _MISSES[found]
        key = (tenant, conversation_id)
        self._remove(key, MissReason.TAKEN)
        return Lookup(found, None)

    def _miss(self, reason: MissReason) -> MissReason:
        self.stats.misses[reason] += 1
        return reason

    def record_success(self, tenant: str, conversation_id: str, entry: ConversationEntry, now: float) -> None:
        """Store the params of a turn D finished successfully, replacing the previous turn's."""
        bucket_s = self._bucket_s
        if not -math.inf < now / bucket_s < self._swept_below + 1:  # purge's own first test (see lookup_entry)
            self.purge(now)
        key = (tenant, conversation_id)
        until = usable_until(entry.expires_at, self.expiry_margin_s)
        if now >= until:  # born expired: not stored, and the previous turn's entry is superseded
            self._remove(key, None)
            self._remember_gone(key, MissReason.EXPIRED)
            return
        params = entry.kv_params
        if type(params) is not CompactParams and type(params.get(BLOCK_IDS)) is list:  # what _compacted packs
            entry = _compacted(entry)
        entries = self._entries
        unbounded = self.max_bytes is None
        if key in entries:  # the conversation's next turn: its id, tenant and (absent) gone reason stay
            if unbounded and key in self._unsized:
                # the one bookkeeping _unbook does that matters here is the wheel's (the key stays
                # unsized: nobody read its size, and the new entry is sized only if someone does)
                bucket = self._wheel[self._bucket_of[key]]
                del bucket[key]
                if not bucket:
                    del self._wheel[self._bucket_of[key]]
            else:
                self._unbook(key)
                if unbounded:
                    self._unsized[key] = None
            entries.move_to_end(key)
        else:
            self._gone.pop(key, None)
            self._tenants_per_id[conversation_id] = self._tenants_per_id.get(conversation_id, 0) + 1
            if unbounded:
                self._unsized[key] = None
        entries[key] = entry
        # _bucket(until), inline
        bucket_index = self._bucket_of[key] = 1 << 62 if until == math.inf else math.floor(until / bucket_s)
        bucket = self._wheel.get(bucket_index)
        if bucket is None:
            self._wheel[bucket_index] = {key: entry}
        else:
            bucket[key] = entry
        if not unbounded:
            size = self._sizes[key] = entry_bytes(key, entry)
            self._bytes += size
        while len(self._entries) > self.max_entries or (self.max_bytes is not None and self.bytes > self.max_bytes
                                                        and self._entries):
            old_key = next(iter(self._entries))
            self._remove(old_key, MissReason.EVICTED)
            self.stats.evictions += 1

    def forget(self, tenant: str, conversation_id: str) -> bool:
        key = (tenant, conversation_id)
        present = key in self._entries
        self._remove(key, None)
        self._gone.pop(key, None)
        return present

    def get(self, tenant: str, conversation_id: str) -> ConversationEntry | None:
        """The raw entry, no checks and no recency update (for admin views and tests)."""
        return self._entries.get((tenant, conversation_id))

    def _remove(self, key: Key, reason: MissReason | None) -> None:
        if self._entries.pop(key, None) is None:
            return
        self._unbook(key)
        conv = key[1]
        left = self._tenants_per_id[conv] - 1
        if left:
            self._tenants_per_id[conv] = left
        else:
            del self._tenants_per_id[conv]
        if reason is not None:
            self._remember_gone(key, reason)

    def _unbook(self, key: Key) -> None:
        """Take a live entry's bytes and wheel slot off the books (it is leaving or being replaced)."""
        self._bytes -= self._sizes.pop(key, 0)
        self._unsized.pop(key, None)
        bucket_index = self._bucket_of.pop(key)
        bucket = self._wheel[bucket_index]
        del bucket[key]
        if not bucket:
            del self._wheel[bucket_index]

    def _remember_gone(self, key: Key, reason: MissReason) -> None:
        self._gone[key] = reason
        self._gone.move_to_end(key)
        while len(self._gone) > self.max_entries:
            self._gone.popitem(last=False)

    def _bucket(self, t: float) -> int:
        if math.isinf(t):
            return 1 << 62  # never swept: lives until evicted or replaced
        return math.floor(t / self._bucket_s)

    def purge(self, now: float) -> int:
        """Drop entries whose usable time ended before the current bucket; returns how many."""
        # ``now`` still in the bucket swept last (most calls): floor(now / bucket_s) <= _swept_below,
        # tested without the floor; an infinite ``now`` takes the general path
        if -math.inf < now / self._bucket_s < self._swept_below + 1:
            return 0
        upto = self._bucket(now)  # sweep buckets strictly below this one
        swept, wheel = self._swept_below, self._wheel
        if upto <= swept:
            return 0
        # walk the elapsed buckets, or the occupied ones if fewer (a long idle jump); most sweeps pass a
        # second or two of empty buckets, so an empty one costs a dict lookup and no list
        if upto - swept <= len(wheel):
            indices: Iterable[int] = range(int(swept), upto)
        else:
            indices = sorted(b for b in wheel if b < upto)
        removed = 0
        for b in indices:
            bucket = wheel.get(b)
            if bucket:
                keys = list(bucket)  # _remove empties the bucket (and drops it from the wheel)
                for key in keys:
                    self._remove(key, MissReason.EXPIRED)
                removed += len(keys)
        self._swept_below = upto
        if removed:
            self.stats.purged += removed
        return removed
