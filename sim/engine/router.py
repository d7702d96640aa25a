"""The router, as a real one sees the world: it runs impl.policy's conversation store and placement
verbatim, learns D's params and expiry from D's finished response, and never reads a turn's future
(output length, next arrival).

Like the real router since P verifies token ids (impl.policy.prefix_check), it offers D's blocks
without the message-level guard (entries carry ``held_digest=None``); tenant scoping and the expiry
margin stay. D's published checkpoints are modelled by the turn D holds and that turn's prompt length
(the checkpoints' anchor), which P turns into a verified count with ``verified_tokens_model``."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import simpy

from impl.policy import ConversationEntry, ConversationStore, InstanceLoad, LeastLoaded, LeastLoadedIndex, PlacementRequest
from impl.policy.prefill_affinity import PrefillAffinity

if TYPE_CHECKING:
    from sim.workload.model import Lineage
    from sim.engine.decode import DecodeNode, _Seq
    from sim.engine.prefill import PrefillNode
    from sim.engine.records import TurnRecord


class SyntheticPrompt(NamedTuple):
    """impl.policy.PromptView for a simulated prompt: the content of a conversation at one history
    revision is a stream identified by (conversation, revision), so a prefix digest is that pair
    while the prefix fits; a rewritten history is a new revision and no longer continues the old.
    (A named tuple: one is built per turn, at a third of a frozen dataclass's cost.)"""

    conversation: str
    revision: int
    length: int

    def prefix_digest(self, n: int) -> str:
        if n > self.length:
            raise ValueError(f"prefix of {n} requested from a prompt of {self.length}")
        return f"{self.conversation}\x00{self.revision}"


# SyntheticPrompt._make without its Python layer: the named tuple built in C (one per turn)
_new_prompt = tuple.__new__


class _Prefilled:
    """A turn P is prefilling, for what the router does when P is done: its bound ``done`` is P's
    ``on_done`` (a closure per turn over nine of the router's locals cost more). No ``__init__``:
    ``Router.handle`` fills it."""

    __slots__ = ("router", "rec", "key", "revision", "p_name", "block_size", "lineage", "on_done")
    router: "Router"
    rec: "TurnRecord"
    key: tuple[str, str]
    revision: int
    p_name: str
    block_size: int
    lineage: "Lineage | None"
    on_done: Callable[[], None]

    def done(self) -> None:
        """P prefilled the turn: pick D, which takes it from there."""
        router, rec, key = self.router, self.rec, self.key
        n = rec.prompt_tokens
        if router.prefix_caching:  # only placement under prefix caching reads it
            router.affinity.served(key, self.p_name, n)
        d_name = router._pick_d(n, self.block_size)
        rec.decode_instance = d_name
        router._decode_by_name[d_name].serve(rec, key, self.revision, self.p_name, self.lineage, self.on_done)


class Router:
    def __init__(self, env: simpy.Environment, prefill: list["PrefillNode"], decode: list["DecodeNode"],
                 store: ConversationStore, p_placement: Any, d_placement: Any, rng: random.Random,
                 bidirectional: bool, prefix_caching: bool) -> None:
        self.env = env
        self.prefill = prefill
        self._prefill_by_name = {p.name: p for p in prefill}
        self.store = store
        self.p_placement, self.d_placement = p_placement, d_placement
        self.rng = rng
        self.bidirectional = bidirectional
        self.prefix_caching = prefix_caching
        # which P last prefilled each conversation (what this router sent where: its own knowledge), bounded as the store
        self.affinity = PrefillAffinity(store.max_entries)
        self.learnt: Any = None  # sim.engine.learnt.LearntHolds under the learnt retention: it sees every arrival and finish
        self.host: Any = None  # sim.engine.host_tier.HostTier when the host tier is on: D's offloads, offered to P
        self._last_finish: dict[Any, tuple[DecodeNode, float]] = {}  # (decode node, finish time) of the last turn
        self._p_snaps: list[InstanceLoad | None] = [None] * len(prefill)
        self._d_snaps: list[InstanceLoad | None] = []
        # A pool of one has no choice to make: every placement policy picks its one (always healthy)
        # node without drawing from ``rng``, so the router neither asks the policy nor follows the load.
        self._sole_p: str | None = prefill[0].name if len(prefill) == 1 else None
        self._sole_d: str | None = None
        self.on_d: Any = None  # sim.engine.prefill_on_d.PrefillOnDRouting when prefill on D is on
        # LeastLoaded's choice kept in an index updated from the nodes whose load changed since the last
        # pick (each node adds itself to its ``load_dirty`` set when it changes what placement reads)
        self._p_index: LeastLoadedIndex | None = None
        self._d_index: LeastLoadedIndex | None = None
        self._p_dirty: set[PrefillNode] = set()
        self._d_dirty: set[DecodeNode] = set()
        self._indexed: dict[Any, Any] = {}  # node -> what the index holds of its load
        if type(p_placement) is LeastLoaded and self._sole_p is None:
            self._p_index = LeastLoadedIndex([InstanceLoad(p.name) for p in prefill])
            for p in prefill:
                p.load_dirty = self._p_dirty
                self._p_dirty.add(p)
        self.add_decode(decode)

    def add_decode(self, decode: list["DecodeNode"]) -> None:
        """The decode nodes (built after the router: they report to it when a turn finishes)."""
        self.decode = decode
        self._decode_by_name = {d.name: d for d in decode}
        self._d_snaps = [None] * len(decode)
        self._sole_d = decode[0].name if len(decode) == 1 else None
        if type(self.d_placement) is LeastLoaded and len(decode) > 1:
            self._d_index = LeastLoadedIndex([InstanceLoad(d.name, total_blocks=d.capacity) for d in decode])
            for d in decode:
                d.load_dirty = self._d_dirty
                self._d_dirty.add(d)

    def handle(self, rec: "TurnRecord", key: tuple[str, str], revision: int, shared_prefix_tokens: int,
               lineage: "Lineage | None", on_done: Callable[[], None]) -> None:
        """Route one turn through P then D; ``on_done()`` runs from the event that ends it (callbacks, no
        process: a turn resumes nothing in between). ``lineage``: what the conversation's prompts share
        with earlier turns (None: every turn continues the last faithfully); only P's verification and
        the caches read it."""
        env = self.env
        now = env._now
        n = rec.prompt_tokens
        last = self._last_finish.get(key)
        if last is not None:  # a later turn: the gap feeds retention policies that learn from gaps
            last[0].retention.observe_gap(now - last[1])
        if self.learnt is not None:
            self.learnt.arrived(key, rec.turn, now)
        remote = None
        if self.bidirectional:
            # the entry or why it missed, without a Lookup around it (one per turn)
            found = self.store.lookup_entry(key[0], key[1], _new_prompt(SyntheticPrompt, (key[1], revision, n)), now)
            if type(found) is ConversationEntry:
                rec.store_hit = True
                params = found.kv_params
                remote = (self._decode_by_name[found.decode_instance], found.num_tokens,
                          params["held_turn"], params["held_prompt_tokens"])
            elif rec.turn > 0:
                # what ``.value`` returns, without the property (~1.7k instructions)
                rec.miss_reason = found._value_  # type: ignore[union-attr]
        elif rec.turn > 0:
            rec.miss_reason = "bidirectional_off"
        if self.on_d and rec.turn:
            d_node = self.on_d.choose(rec, key, remote, now)
            if d_node is not None:  # the whole request to the D that holds the conversation: no P leg
                rec.decode_instance = d_node.name
                rec.recomputed_tokens = n  # until D takes its held prefix (if it rejects the turn, nothing was)
                d_node.serve(rec, key, revision, "", lineage, on_done)
                return
        if remote is None and self.host is not None:  # no live HBM entry: D's host tier, if D offloaded the turn
            remote = self.host.source(key, revision)
        p_name = self._pick_p(key, n, remote[1] if remote else 0)
        p_node = self._prefill_by_name[p_name]
        rec.prefill_instance = p_name
        then = _Prefilled()
        then.router, then.rec, then.key, then.revision, then.p_name = self, rec, key, revision, p_name
        then.block_size, then.lineage, then.on_done = p_node.profile.block_size, lineage, on_done
        p_node.serve(rec, key, revision, shared_prefix_tokens, remote, lineage, then.done)

    # -- placement -------------------------------------------------------------------------------
    # The PlacementRequest is built only for a policy that reads it: the LeastLoaded index does not.
    def _pick_p(self, key: tuple[str, str], prompt_tokens: int, remote_tokens: int) -> str:
        if self._sole_p is not None:
            return self._sole_p
        index = self._p_index
        if index is None:
            cached = self.affinity.cached_tokens(key) if self.prefix_caching else {}
            request = PlacementRequest(prompt_tokens, cached, remote_tokens)
            return self.p_placement.pick(self._p_loads(), request, self.rng)
        indexed = self._indexed
        for p in self._p_dirty:
            if indexed.get(p) != p.queued_tokens:  # marked, but what placement reads may be unchanged
                indexed[p] = p.queued_tokens
                index.update_load(p.name, queued_prefill_tokens=p.queued_tokens)
        self._p_dirty.clear()
        return index.pick(self.rng)  # type: ignore[return-value]  # every node is healthy

    def _pick_d(self, prompt_tokens: int, block_size: int) -> str:
        if self._sole_d is not None:
            return self._sole_d
        index = self._d_index
        if index is None:
            request = PlacementRequest(prompt_tokens, new_blocks=-(-prompt_tokens // block_size))
            return self.d_placement.pick(self._d_loads(), request, self.rng)
        indexed = self._indexed
        for d in self._d_dirty:  # LeastLoaded reads neither retained blocks nor the request
            load = (len(d.running), d.running_blocks + d.arriving_blocks)
            if indexed.get(d) != load:
                indexed[d] = load
                index.update_load(d.name, running_requests=load[0], used_blocks=load[1], total_blocks=d.capacity)
        self._d_dirty.clear()
        return index.pick(self.rng)  # type: ignore[return-value]  # every node is healthy

    # -- load snapshots for the other placement policies -------------------------------------------
    # Building a frozen InstanceLoad per node per turn was most of a 64P64D run, so a node's snapshot
    # is rebuilt only when what it reports changed (equal values: the policy sees the same loads).
    def _p_loads(self) -> list[InstanceLoad]:
        snaps = self._p_snaps
        for i, p in enumerate(self.prefill):
            if snaps[i] is None or snaps[i].queued_prefill_tokens != p.queued_tokens:  # type: ignore[union-attr]
                snaps[i] = InstanceLoad(p.name, queued_prefill_tokens=p.queued_tokens)
        return snaps  # type: ignore[return-value]  # none is None any more

    def _d_loads(self) -> list[InstanceLoad]:
        snaps = self._d_snaps
        for i, d in enumerate(self.decode):
            old = snaps[i]
            running, used, retained = len(d.running), d.running_blocks + d.arriving_blocks, d.retained.blocks
            if (old is None or old.running_requests != running or old.used_blocks != used
                    or old.retained_blocks != retained or old.total_blocks != d.capacity):
                snaps[i] = InstanceLoad(d.name, running_requests=running, used_blocks=used, retained_blocks=retained,
                                        total_blocks=d.capacity)
        return snaps  # type: ignore[return-value]  # none is None any more

    def on_decode_finish(self, d_node: "DecodeNode", seq: "_Seq", expires_at: float | None) -> None:
        """D's response finished: store the params it returned (only now, after success)."""
        key = seq.key
        now = self.env._now
        self._last_finish[key] = (d_node, now)
        if self.learnt is not None:
            self.learnt.finished(key, seq.blocks, now)
        if self.on_d:
            self.on_d.finished(key, d_node.name, seq.context, expires_at, now)
        if self.host is not None:
            self.host.offloaded(d_node, seq, now)
        if expires_at is None:
            return
        # D's params with its checkpoints, modelled as the turn it holds and that turn's prompt (the anchor);
        # no guard digest: P verifies token ids (the real router stores these entries the same way)
        rec = seq.rec
        params = {"remote_num_tokens": seq.context, "held_turn": rec.turn, "held_prompt_tokens": rec.prompt_tokens}
        entry = ConversationEntry(d_node.name, params, expires_at, seq.context, seq.context, None, now)
        self.store.record_success(key[0], key[1], entry, now)

    def heartbeat(self, key: tuple[str, str]) -> None:
        """Relay a client heartbeat to the D holding the conversation; update the stored expiry."""
        entry = self.store.get(*key)
        if entry is None:
            return
        renewed = self._decode_by_name[entry.decode_instance].renew(key, self.env._now)
        if renewed is not None and renewed != entry.expires_at:
            self.store.record_success(key[0], key[1], _with_expiry(entry, renewed), self.env._now)


def _with_expiry(entry: ConversationEntry, expires_at: float) -> ConversationEntry:
    return ConversationEntry(entry.decode_instance, entry.kv_params, expires_at, entry.num_tokens, entry.held_len,
                             entry.held_digest, entry.stored_at)

