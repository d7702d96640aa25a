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
from sim.instant import after, nothing_due_now
from sim.interconnect import Interconnect

if TYPE_CHECKING:
    from calibration.profile import LatencyProfile
    from sim.decode import DecodeNode
    from sim.records import TurnRecord
    from sim.workload.model import Lineage

SHARED_PREFIX_KEY = ("", "__shared_prefix__")


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


class _Job:
    __slots__ = ("remaining", "context", "on_end", "enqueued_at", "started_at", "fixed_done_s")

    def __init__(self, remaining: int, context: int, on_end: Callable[[], None], now: float, fixed_done_s: float) -> None:
        self.remaining, self.context, self.on_end = remaining, context, on_end
        self.enqueued_at, self.started_at = now, -1.0
        self.fixed_done_s = fixed_done_s  # fixed prefill work already done while its pull was set up


class PrefillNode:
    def __init__(self, env: simpy.Environment, name: str, profile: "LatencyProfile", recompute_policy: Any,
                 interconnect: Interconnect, max_num_batched_tokens: int, cache_blocks: int, prefix_caching: bool) -> None:
        self.env, self.name, self.profile = env, name, profile
        self.recompute_policy = recompute_policy
        self.interconnect = interconnect
        self.budget = max_num_batched_tokens
        self.cache = PrefixCache(cache_blocks, profile.block_size) if prefix_caching else None
        self._queue: collections.deque[_Job] = collections.deque()
        self._wake: simpy.Event | None = None
        self.queued_tokens = 0
        self.load_dirty: set[PrefillNode] = set()  # the router's: this node adds itself when queued_tokens changes
        self.busy_s = 0.0
        self._idle()

    # -- one turn -----------------------------------------------------------------------------
    def serve(self, rec: "TurnRecord", conv_key: Any, revision: int, shared_prefix_tokens: int,
              remote: "tuple[DecodeNode, int, int, int] | None", lineage: "Lineage | None",
              on_done: Callable[[], None]) -> None:
        """Prefill ``rec``'s prompt, pulling the verified part of what ``remote`` = (D, tokens held, turn
        held, that turn's prompt tokens) holds if worth it; ``on_done()`` runs from the event that ends the
        prefill. ``lineage``: what the prompt shares with earlier turns (None: every turn continues the
        last faithfully)."""
        profile = self.profile
        n = rec.prompt_tokens
        local_hit = (self.cache.hit_tokens(conv_key, revision, n, shared_prefix_tokens, lineage, rec.turn)
                     if self.cache else 0)
        rec.p_local_hit_tokens = local_hit
        reused = 0
        if remote is not None:
            d_node, remote_tokens, held_turn, held_prompt = remote
            agreeing = remote_tokens if lineage is None else lineage.held_agreement(rec.turn, held_turn)
            verified = verified_tokens_model(remote_tokens, held_prompt, agreeing, n, profile.block_size)
            candidate = PullCandidate(n, min(remote_tokens, verified), local_hit, profile.block_size,
                                      TransferPath.DECODE_TO_PREFILL)
            # what P's connector reports (impl/connector/scheduler.py): each count beyond the local hit
            rec.offered_tokens = max(0, min(remote_tokens, n) - local_hit)
            rec.verified_tokens = max(0, candidate.reusable_tokens)
            decision = self.recompute_policy.decide(candidate)
            rec.decision_reason = decision.reason.value
            if decision.pull:
                refusal = d_node.begin_read(conv_key, revision, self.env._now)
                if refusal:
                    rec.decision, rec.miss_reason = "recompute", refusal
                else:
                    rec.decision = "pull"
                    reused = rec.pulled_tokens = decision.tokens
                    nbytes = profile.transfer_bytes(reused)
                    fixed = profile.transfer_fixed_s(profile.blocks_for(reused))
                    # pull, end the read, pay the reuse overhead, queue: callbacks from the events themselves
                    job: _Job | None = None

                    def pulled(elapsed: float, d_node: "DecodeNode" = d_node, reused: int = reused) -> None:
                        rec.d2p_transfer_s = elapsed
                        d_node.end_read(conv_key, self.env._now)
                        rec.reuse_overhead_s = profile.reuse_overhead_s(reused)
                        if rec.reuse_overhead_s > 0:
                            after(self.env, rec.reuse_overhead_s, lambda _event: enqueue())
                        else:
                            enqueue()

                    def enqueue() -> None:
                        nonlocal job
                        job = self._enqueue(rec, local_hit, reused, finished)

                    def finished() -> None:
                        self._finished(rec, job, conv_key, revision, shared_prefix_tokens)
                        on_done()

                    self.interconnect.start(d_node.name, self.name, nbytes, fixed, pulled)
                    return
            else:
                # below the threshold only because the prompt diverges from what D holds: say so
                diverged = rec.verified_tokens < rec.offered_tokens
                rec.decision, rec.miss_reason = "recompute", "diverged" if diverged else decision.reason.value
        else:
            rec.decision = "none"
        def computed() -> None:
            self._finished(rec, queued, conv_key, revision, shared_prefix_tokens)
            on_done()

        queued = self._enqueue(rec, local_hit, reused, computed)

    def _enqueue(self, rec: "TurnRecord", local_hit: int, reused: int, on_end: Callable[[], None]) -> _Job:
        """Queue the part of the prompt left to compute; ``on_end()`` runs from the event that ends it."""
        n = rec.prompt_tokens
        if n - local_hit - reused < 1:  # vLLM always computes the last prompt token (it needs its logits)
            reused = max(n - 1 - local_hit, 0)
        context = local_hit + reused
        new_tokens = n - context
        rec.reused_tokens, rec.recomputed_tokens = reused, new_tokens
        job = _Job(new_tokens, context, on_end, self.env._now, self.profile.pull_hidden_s() if reused else 0.0)
        self._queue.append(job)
        self.queued_tokens += new_tokens
        self.load_dirty.add(self)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        return job

    def _finished(self, rec: "TurnRecord", job: "_Job | None", conv_key: Any, revision: int,
                  shared_prefix_tokens: int) -> None:
        assert job is not None
        waited = job.started_at - job.enqueued_at
        if waited or type(waited) is not float:  # a float 0.0 keeps the record's shared 0.0: a float less per turn
            rec.p_queue_s = waited
        rec.prefill_compute_s = self.env._now - job.started_at
        if self.cache is not None:
            self.cache.insert(conv_key, revision, rec.prompt_tokens, shared_prefix_tokens, rec.turn)

    # -- the engine loop ----------------------------------------------------------------------
    # Callbacks rather than a process: a step is formed when the loop wakes or the previous step ends,
    # in the same order of events a process loop had, without a process resume per step.
    def _idle(self) -> None:
        self._wake = self.env.event()
        self._wake.callbacks.append(self._on_wake)

    def _on_wake(self, _event: simpy.Event) -> None:
        self._wake = None
        self._start_step()

    def _start_step(self) -> None:
        env, queue = self.env, self._queue
        budget = self.budget
        chunks: list[tuple[int, int]] = []
        scheduled: list[tuple[_Job, int]] = []
        hidden = 0.0
        for job in queue:
            if budget <= 0:
                break
            take = min(job.remaining, budget)
            if job.started_at < 0:
                job.started_at = env._now
                hidden = max(hidden, job.fixed_done_s)
            chunks.append((take, job.context))
            scheduled.append((job, take))
            budget -= take
        step_s = self.profile.prefill_step_s(chunks) - hidden
        after(env, step_s, lambda _event: self._end_step(step_s, scheduled))

    def _end_step(self, step_s: float, scheduled: list[tuple["_Job", int]]) -> None:
        env, queue = self.env, self._queue
        self.busy_s += step_s
        for job, take in scheduled:
            job.remaining -= take
            job.context += take
            self.queued_tokens -= take
        self.load_dirty.add(self)
        finished = []
        while queue and queue[0].remaining <= 0:
            finished.append(queue.popleft())
        if any(job.remaining <= 0 for job in queue):  # a short job behind a long one finished too
            for job in [j for j in queue if j.remaining <= 0]:
                queue.remove(job)
                finished.append(job)
        if len(finished) == 1 and nothing_due_now(env):
            # nothing else is due now, so the one finished turn's done event, queued before the next
            # step's timer (at or after now), would be processed next: form the step, then process it
            self._start_step() if queue else self._idle()
            finished[0].on_end()
            return
        for job in finished:
            after(env, 0, lambda _event, j=job: j.on_end())  # queued as a done event would be
        self._start_step() if queue else self._idle()
