"""A prefill node: optional prefix cache, the pull-vs-recompute decision, the D->P pull, chunked prefill.

A turn's life on P (vLLM's NixlConnector with ``bidirectional_kv_xfer``): the local prefix-cache hit
is applied first; if the router sent D's params, P verifies which leading tokens D holds equal its
prompt's (impl.policy.prefix_check; here its count model, ``verified_tokens_model``), and impl.policy
decides pull or recompute on that verified count; a pull waits
asynchronously (other requests keep computing) and is declined, falling back to recompute
(``kv_load_failure_policy: "recompute"``), when D no longer holds the blocks or they are within the
expiry margin; then the remaining suffix joins the batch loop, which forms steps under the token
budget (chunked prefill) and charges each step from the profile.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable

import simpy

from impl.policy import PullCandidate, TransferPath
from impl.policy.prefix_check import verified_tokens_model
from sim.engine.host_tier import HostSource
from sim.engine.instant import after, at, nothing_due_now
from sim.engine.interconnect import Interconnect

if TYPE_CHECKING:
    from calibration.profile import LatencyProfile
    from sim.engine.decode import DecodeNode
    from sim.engine.host_tier import HostTier
    from sim.engine.records import TurnRecord
    from sim.workload.model import Lineage

SHARED_PREFIX_KEY = ("", "__shared_prefix__")
# read once: on CPython 3.11 reading an enum member off its class goes through EnumType's __getattr__
# hook (~150 ns), and every pull candidate names its path
_DECODE_TO_PREFILL = TransferPath.DECODE_TO_PREFILL


class PrefixCache:
    """LRU prefix cache at conversation granularity: each entry is the leading tokens of one
    conversation at one history revision (plus one entry for the prefix all conversations share).

    Coarser than vLLM's per-block LRU (a conversation's blocks leave together), which keeps the cost
    per turn O(1); reported hits are block-aligned like vLLM's. vLLM's cache is keyed by token hashes,
    so a hit never extends past the first token where the new prompt differs from the cached one
    (``Lineage.prompt_agreement``); across a history revision it serves nothing (conservative).
    """

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        # key -> (tokens, revision, turn whose prompt they are)
        self._entries: collections.OrderedDict[Any, tuple[int, int, int]] = collections.OrderedDict()
        self.used_blocks = 0

    def hit_tokens(self, key: Any, revision: int, prompt_tokens: int, shared_prefix_tokens: int,
                   lineage: "Lineage | None" = None, turn: int = 0) -> int:
        best = 0
        entry = self._entries.get(key)
        if entry is not None and entry[1] == revision:
            best = min(entry[0], prompt_tokens)
            if lineage is not None and entry[2] != turn:
                best = min(best, lineage.prompt_agreement(turn, entry[2]))
            self._entries.move_to_end(key)
        shared = self._entries.get(SHARED_PREFIX_KEY)
        if shared is not None and shared_prefix_tokens:
            best = max(best, min(shared[0], shared_prefix_tokens, prompt_tokens))
            self._entries.move_to_end(SHARED_PREFIX_KEY)
        # vLLM always computes at least the last prompt token, and reuses whole blocks only
        best = min(best, prompt_tokens - 1)
        return max(best, 0) // self.block_size * self.block_size

    def insert(self, key: Any, revision: int, tokens: int, shared_prefix_tokens: int, turn: int = 0) -> None:
        self._put(key, tokens, revision, turn)
        if shared_prefix_tokens:
            self._put(SHARED_PREFIX_KEY, shared_prefix_tokens, 0, 0)

    def _put(self, key: Any, tokens: int, revision: int, turn: int) -> None:
        blocks = -(-tokens // self.block_size)
        if blocks > self.capacity_blocks:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_blocks -= -(-old[0] // self.block_size)
        while self.used_blocks + blocks > self.capacity_blocks:
            _, (old_tokens, _, _) = self._entries.popitem(last=False)
            self.used_blocks -= -(-old_tokens // self.block_size)
        self._entries[key] = (tokens, revision, turn)
        self.used_blocks += blocks


class _Turn:
    """One turn on a prefill node, from its decision to its last chunk. Its bound methods are the
    callbacks the pull, the reuse overhead and the engine loop run, so a turn builds no closures.
    No ``__init__``: ``PrefillNode.serve`` fills it (a class call with a Python ``__init__`` is a
    layer more per turn); ``remaining``, ``context``, ``take`` and ``enqueued_at`` are set when queued."""

    __slots__ = ("node", "rec", "conv_key", "revision", "shared_prefix_tokens", "on_done", "local_hit", "d_node",
                 "remaining", "context", "take", "enqueued_at", "started_at", "fixed_done_s")
    node: "PrefillNode"
    rec: "TurnRecord"
    conv_key: Any
    revision: int
    shared_prefix_tokens: int
    on_done: Callable[[], None]
    local_hit: int
    d_node: "DecodeNode | None"  # the D it pulls from, while it pulls
    remaining: int  # tokens left to compute
    context: int  # tokens cached
    take: int  # this step's chunk
    enqueued_at: float
    started_at: float  # -1.0 until its first step
    fixed_done_s: float  # fixed prefill work already done while its pull was set up

    def pulled(self, elapsed: float) -> None:
        """The pull ended: release D's blocks, then pay the reuse overhead before computing the rest."""
        rec, node = self.rec, self.node
        rec.d2p_transfer_s = elapsed
        self.d_node.end_read(self.conv_key)  # type: ignore[union-attr]  # set: it read from D
        self.d_node = None
        overhead = rec.reuse_overhead_s = node.profile.reuse_overhead_s(rec.pulled_tokens)
        if overhead > 0:
            env = node.env
            when = env._now + overhead
            queue = env._queue
            # from the pull's end event (start ends an empty pull inline, elapsed 0) this is its last action:
            # with nothing queued before the overhead's end, its timer would be popped next (sim.engine.instant)
            if elapsed > 0 and (not queue or queue[0][0] > when):
                env._now = when
                self.overhead_paid(None)
                return
            at(env, when, self.overhead_paid)
        else:
            node.enqueue(self, rec.pulled_tokens)

    def overhead_paid(self, _timer: object) -> None:
        # the last thing this timer does: P may start its step here rather than from a wake-up event
        self.node.enqueue(self, self.rec.pulled_tokens, last_in_callback=True)

    def finish(self, _event: object = None) -> None:
        """Its last chunk was computed: record the times, cache the prompt, hand the turn on."""
        node, rec = self.node, self.rec
        waited = self.started_at - self.enqueued_at
        if waited or type(waited) is not float:  # a float 0.0 keeps the record's shared 0.0: a float less per turn
            rec.p_queue_s = waited
        rec.prefill_compute_s = node.env._now - self.started_at
        if node.cache is not None:
            node.cache.insert(self.conv_key, self.revision, rec.prompt_tokens, self.shared_prefix_tokens, rec.turn)
        self.on_done()


class PrefillNode:
    def __init__(self, env: simpy.Environment, name: str, profile: "LatencyProfile", recompute_policy: Any,
                 interconnect: Interconnect, max_num_batched_tokens: int, cache_blocks: int, prefix_caching: bool) -> None:
        self.env, self.name, self.profile = env, name, profile
        self.recompute_policy = recompute_policy
        self.interconnect = interconnect
        self.budget = max_num_batched_tokens
        self.cache = PrefixCache(cache_blocks, profile.block_size) if prefix_caching else None
        self._pull_hidden_s = profile.pull_hidden_s()  # the profile is frozen
        self._queue: collections.deque[_Turn] = collections.deque()
        self._idle = True  # no step in flight and no wake-up queued
        self._step: list[_Turn] = []  # the turns of the step in flight (a prefix of the queue)
        self._step_s = 0.0
        self._end_step_bound = self._end_step  # every step timer's callback, bound once
        self.queued_tokens = 0
        self.load_dirty: set[PrefillNode] = set()  # the router's: this node adds itself when queued_tokens changes
        self.busy_s = 0.0
        # P tells D when it declines a pull: vLLM's P scheduler, given 0 external tokens for a request with
        # D's block ids, queues an empty read whose notification frees them (nixl/pull_scheduler.py,
        # update_state_after_alloc); set by the cluster from PolicyConfig.decline_frees_d
        self.decline_frees_d = False
        self.host: HostTier | None = None  # sim.engine.host_tier's, set by the cluster when the host tier is on

    # -- one turn -----------------------------------------------------------------------------
    def serve(self, rec: "TurnRecord", conv_key: Any, revision: int, shared_prefix_tokens: int,
              remote: "tuple[DecodeNode, int, int, int] | HostSource | None", lineage: "Lineage | None",
              on_done: Callable[[], None]) -> None:
        """Prefill ``rec``'s prompt, pulling the verified part of what ``remote`` = (D, tokens held, turn
        held, that turn's prompt tokens) holds if worth it, or what D's host tier holds when ``remote`` is a
        :class:`sim.engine.host_tier.HostSource`; ``on_done()`` runs from the event that ends the
        prefill. ``lineage``: what the prompt shares with earlier turns (None: every turn continues the
        last faithfully)."""
        profile = self.profile
        n = rec.prompt_tokens
        local_hit = (self.cache.hit_tokens(conv_key, revision, n, shared_prefix_tokens, lineage, rec.turn)
                     if self.cache else 0)
        rec.p_local_hit_tokens = local_hit
        turn = _Turn()
        turn.node, turn.rec, turn.conv_key, turn.revision = self, rec, conv_key, revision
        turn.shared_prefix_tokens, turn.on_done, turn.local_hit = shared_prefix_tokens, on_done, local_hit
        turn.d_node, turn.started_at, turn.fixed_done_s = None, -1.0, 0.0
        if remote is not None:
            if type(remote) is HostSource:  # D's HBM no longer holds the turn; D's host tier may
                self.host.serve(self, turn, remote, lineage)  # type: ignore[union-attr]
                return
            d_node, remote_tokens, held_turn, held_prompt = remote
            agreeing = remote_tokens if lineage is None else lineage.held_agreement(rec.turn, held_turn)
            verified = verified_tokens_model(remote_tokens, held_prompt, agreeing, n, profile.block_size)
            # min and max written out below: the builtin calls cost more than the comparisons (once per turn)
            candidate = PullCandidate(n, verified if verified < remote_tokens else remote_tokens, local_hit,
                                      profile.block_size, _DECODE_TO_PREFILL)
            # what P's connector reports (impl/connector/scheduler.py): each count beyond the local hit
            offered = (n if n < remote_tokens else remote_tokens) - local_hit
            rec.offered_tokens = offered if offered > 0 else 0
            reusable = candidate.reusable_tokens
            rec.verified_tokens = reusable if reusable > 0 else 0
            decision = self.recompute_policy.decide(candidate)
            # ``_value_``: the member's value as Enum stores it (``.value`` is a property: ~1.7k instructions)
            reason = rec.decision_reason = decision.reason._value_
            if decision.pull:
                refusal = d_node.begin_read(conv_key, self.env._now)
                if refusal:  # gone, or within the margin: vLLM's worker declines that read without a word to D
                    rec.decision, rec.miss_reason = "recompute", refusal
                    if self.host is not None and self._from_host(turn, conv_key, revision, lineage):
                        return
                else:
                    rec.decision = "pull"
                    reused = rec.pulled_tokens = decision.tokens
                    turn.d_node = d_node
                    # pull, end the read, pay the reuse overhead, queue: callbacks from the events themselves
                    self.interconnect.start(d_node.name, self.name, profile.transfer_bytes(reused),
                                            profile.transfer_fixed_s(profile.blocks_for(reused)), turn.pulled)
                    return
            else:
                # below the threshold only because the prompt diverges from what D holds: say so
                diverged = rec.verified_tokens < rec.offered_tokens
                rec.decision, rec.miss_reason = "recompute", "diverged" if diverged else reason
                if self.decline_frees_d:
                    d_node.declined(conv_key, self.env._now)
                # impl.policy.host_tier.choose_source: a declined HBM read leaves the host tier's own rule
                if self.host is not None and self._from_host(turn, conv_key, revision, lineage):
                    return
        else:
            rec.decision = "none"
        self.enqueue(turn, 0)

    def _from_host(self, turn: _Turn, conv_key: Any, revision: int, lineage: "Lineage | None") -> bool:
        """D's HBM will not serve the turn: if D offloaded it, D's host tier decides and serves it."""
        source = self.host.source(conv_key, revision)  # type: ignore[union-attr]  # the caller checked
        if source is None:
            return False
        self.host.serve(self, turn, source, lineage)  # type: ignore[union-attr]
        return True

    def enqueue(self, turn: _Turn, reused: int, last_in_callback: bool = False) -> None:
        """Queue the part of the prompt left to compute, waking the engine loop if it is idle.

        ``last_in_callback``: the caller is an event callback that does nothing after this call, so when
        nothing else is due now the loop's wake-up event would be processed next: the step starts here."""
        rec = turn.rec
        n, local_hit = rec.prompt_tokens, turn.local_hit
        if n - local_hit - reused < 1:  # vLLM always computes the last prompt token (it needs its logits)
            reused = max(n - 1 - local_hit, 0)
        context = local_hit + reused
        new_tokens = n - context
        rec.reused_tokens, rec.recomputed_tokens = reused, new_tokens
        turn.remaining, turn.context = new_tokens, context
        turn.enqueued_at = self.env._now
        if reused:
            turn.fixed_done_s = self._pull_hidden_s
        self._queue.append(turn)
        self.queued_tokens += new_tokens
        self.load_dirty.add(self)
        if self._idle:
            self._idle = False
            if last_in_callback and nothing_due_now(self.env):
                self._start_step()
            else:
                after(self.env, 0, self._start_step)  # the queue entry the loop's wake-up event had

    # -- the engine loop ----------------------------------------------------------------------
    # Callbacks rather than a process: a step is formed when the loop wakes or the previous step ends,
    # in the same order of events a process loop had, without a process resume per step.
    def _start_step(self, _wake: object = None) -> None:
        now = self.env._now
        budget = self.budget
        chunks: list[tuple[int, int]] = []
        step = self._step = []
        hidden = 0.0
        for turn in self._queue:
            if budget <= 0:
                break
            remaining = turn.remaining
            take = turn.take = budget if budget < remaining else remaining  # min(), without the builtin call
            if turn.started_at < 0:
                turn.started_at = now
                if turn.fixed_done_s > hidden:
                    hidden = turn.fixed_done_s
            chunks.append((take, turn.context))
            step.append(turn)
            budget -= take
        step_s = self._step_s = self.profile.prefill_step_s(chunks) - hidden
        after(self.env, step_s, self._end_step_bound)

    def _end_step(self, _timer: object) -> None:
        env, queue = self.env, self._queue
        self.busy_s += self._step_s
        for turn in self._step:
            take = turn.take
            turn.remaining -= take
            turn.context += take
            self.queued_tokens -= take
        self.load_dirty.add(self)
        # every turn of a step but its last took all it had left, so the finished turns lead the queue
        finished = []
        while queue and queue[0].remaining <= 0:
            finished.append(queue.popleft())
        # nothing else due now: the one finished turn's done event, queued before the next step's timer
        # (at or after now), would be processed next, so it runs here once the next step is formed
        on_the_spot = finished[0] if len(finished) == 1 and nothing_due_now(env) else None
        if on_the_spot is None:
            for turn in finished:
                after(env, 0, turn.finish)  # queued as a done event would be
        if queue:
            self._start_step()
        else:
            self._idle = True
        if on_the_spot is not None:
            on_the_spot.finish()
