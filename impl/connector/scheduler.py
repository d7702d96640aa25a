"""Scheduler side: the decisions, taken from impl.policy, on top of vLLM's pull scheduler.

Runs in vLLM's engine-core process, on the scheduler thread; no NIXL here (the worker side moves
the bytes). What changes relative to vLLM 0.32's ``NixlPullConnectorScheduler``:

* **Pull or recompute, on both paths** (``get_num_new_matched_tokens``). The reader builds an
  :class:`impl.policy.PullCandidate` -- prompt tokens, tokens the peer holds, its own block-aligned
  prefix-cache hit, block size, :class:`impl.policy.TransferPath` -- and asks the configured
  :class:`impl.policy.RecomputePolicy`. D->P (a later turn: P reads what D kept) as upstream, but
  through the policy, only when ``bidirectional_kv_xfer`` is on, and only once per request
  (upstream reports external tokens it then never loads in both cases: after a declined or failed
  read -- D's blocks expired -- the request hangs in WAITING_FOR_REMOTE_KVS; seen on this CPU
  deployment). P->D (ordinary disaggregation: D reads what P computed)
  goes through the same policy when ``bidikv_apply_threshold_p_to_d`` (vLLM #55801); a declined
  read makes D compute the prompt itself and still tells P to free its blocks.
* **Safe block alignment** (``update_state_after_alloc``). vLLM pairs the reader's newly allocated
  blocks with the *last* blocks of the peer's list. When the prompt is shorter than what the peer
  holds, those hold later positions; the peer's list is cut to the blocks that cover the pulled
  positions (:meth:`impl.policy.PullCandidate.peer_block_span`) before vLLM pairs them.
* **Retention** (``request_finished``). When D keeps a finished turn's blocks, their expiry -- the
  one D enforces and the one it publishes in ``remote_blocks_expiry_time`` -- is the retention
  policy's ``expiry_on_finish(now)`` on vLLM's clock (``time.perf_counter``, the clock the
  handshake's offset estimate is taken on). GapQuantileTTL learns from the gaps D observes: a
  retained request released *before* its expiry was read (or declined) by P's next turn, so
  release - finish is an inter-turn gap. HeartbeatLease is renewed with :meth:`renew`, by client
  heartbeats the router relays to D's heartbeat listener (``bidikv_heartbeat_port``,
  :mod:`impl.connector.heartbeat`): its threads only queue them; this thread applies them at every
  step and during the idle wait below, and the listener's URL reaches the router in the notification.
* **A per-turn hold asked by the router** (``bidikv_retention_s`` in the request's kv_transfer_params,
  :mod:`impl.policy.return_time`): the router's learnt retention for this turn. It can only shorten
  what the retention policy gives (D's ``decoder_kv_blocks_ttl`` stays the longest any turn is kept);
  0 frees the blocks at the worker's next expiry scan; a malformed value is logged and D's own applies.
* **Giving retained KV back under pressure** (``bidikv_retained_under_pressure: "give_back"``,
  :mod:`impl.policy.give_back`). vLLM pins a retained turn's blocks until P reads them or the TTL
  passes, so a D short of blocks makes new work wait at the head of its queue for up to the TTL. Here
  D publishes a short expiry with each retained turn (``remote_blocks_expiry_time``; the router keeps
  the entry until the retention policy's expiry, sent as the notification's ``expires_in_s``), the
  router renews it through the heartbeat listener just before it sends a turn to P, and at every step
  D compares its free blocks (vLLM's block pool, which counts evictable cached blocks) and the head
  waiting request's need with the headroom watermark: short, it stops renewing the entries the policy
  orders first and hands the worker their last published expiry as the new deadline (vLLM's worker
  takes a re-sent deadline), so it frees them then -- at once for an entry no turn asked for within
  the window -- and never before any expiry a P was given.
* **Releasing a turn its successor superseded on D** (prefill on D, ``bidikv_supersedes`` in the
  successor's params, :mod:`impl.policy.prefill_on_d`): once the successor answered, the retained turn it
  continued is released (its deadline re-sent as now) instead of pinned to its expiry. A D meant to serve
  turns whole needs vLLM's prefix caching (on by default): without it a turn sent to D recomputes its
  whole history, so a bidirectional D with it off says so at start.
* **Notification** of the router (vLLM 0.32, :mod:`impl.connector.notify`), queued here, posted by
  a background thread.
* **Idle-step throttle** (``build_connector_meta``). While a node holds blocks for a peer (D for
  its TTL, 480 s by default; P until D read them) vLLM's engine loop keeps stepping with nothing to
  run (1 ms apart), and each step wakes the worker process, whose shared-memory reader then spins
  for 1 s: ~100 % of a core per engine for the whole retention (measured on this project's CPU
  deployment). Peers' reads do not need those steps (the NIXL progress thread serves them, see
  worker.py); only the bookkeeping after a read (freeing the blocks) and lease expiry do. So when a
  step schedules nothing and no read of ours is in flight, this waits up to
  ``bidikv_idle_step_sleep_s`` (default 5 s: the worker spins 1 s of every 5 instead of always),
  returning within 5 ms when a request or an abort arrives on the engine's input queue, so no new
  request waits for it. Blocks a peer has read are freed up to that much later. Without access to
  that queue (not inside a vLLM engine core) it waits 10 ms at most.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import queue
import time
from typing import TYPE_CHECKING, Any, Callable

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.v1.request import RequestStatus

from impl.connector.config import ConfigError, ConnectorSettings
from impl.connector.heartbeat import HeartbeatListener
from impl.connector.notify import NOTIFY_KEY, Notifier, parse_notify_field
from impl.connector.prefix import CHECK_KEY, PrefixChecker, ReuseReport, hash_block_size_of, report_of
from impl.connector.stats import BidikvKVConnectorStats
from impl.policy import GiveBackLedger, PullCandidate, RecomputeDecision, TransferPath
from impl.policy.give_back import RENEW_BEFORE_READ_KEY
from impl.policy.prefill_on_d import superseded
from impl.policy.return_time import asked_retention_s
from impl.policy.store import usable_until
from impl.policy.prefix_check import REPORT_KEY, PrefixVerification, VerifyReason

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("bidikv.connector")
_DEBUG = os.environ.get("BIDIKV_CONNECTOR_DEBUG") == "1"

_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


_ANSWERED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
_GIVEN_BACK_MEMORY = 65536  # request ids (~100 B each): far more than a pool's retained turns
_IDLE_SLICE_S = 0.005  # how often an idle wait checks the engine's input queue
_BLIND_IDLE_SLEEP_S = 0.01  # the longest idle wait when that queue cannot be seen


def _find_engine_inbox() -> queue.Queue | None:
    """The input queue of the vLLM engine core constructing us (None outside an engine core).

    vLLM builds the scheduler (and so this connector) inside ``EngineCoreProc.__init__``, after it
    created ``self.input_queue``, where new requests and aborts arrive between steps.
    """
    owner = _calling_owner(lambda o: isinstance(getattr(o, "input_queue", None), queue.Queue), 40)
    return None if owner is None else owner.input_queue


def _find_vllm_scheduler() -> Any:
    """vLLM's Scheduler calling us (its ``_build_kv_connector_meta``), or None: the owner of the
    block pool and the waiting queue, which the connector API does not pass to a connector."""
    return _calling_owner(lambda o: hasattr(o, "kv_cache_manager") and hasattr(o, "waiting"), 12)


def _calling_owner(is_it: Callable[[Any], bool], depth: int) -> Any:
    """The first ``self`` up the call stack (within ``depth`` frames) for which ``is_it`` holds."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if owner is not None and is_it(owner):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


def _block_count(block_ids: Any) -> int:
    """Blocks a finished request holds: its largest group's (a flat list is one group); at least 1."""
    if not isinstance(block_ids, (list, tuple)) or not block_ids:
        return 1
    if isinstance(block_ids[0], int):
        return len(block_ids)
    return max(1, max(len(group) for group in block_ids))


def _count(value: Any) -> int | None:
    """A token count from a peer's params, or None if it is not a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


class BidikvPullScheduler(NixlPullConnectorScheduler):
    def __init__(self, vllm_config: "VllmConfig", engine_id: str, kv_cache_config: "KVCacheConfig",
                 settings: ConnectorSettings, *, clock: Callable[[], float] = time.perf_counter,
                 notifier: Notifier | None = None) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.settings = settings
        self.recompute_policy = settings.recompute_policy
        self.retention_policy = settings.make_retention()
        self._clock = clock
        if notifier is None and settings.notify:
            notifier = Notifier(timeout_s=settings.notify_timeout_s)
        self.notifier = notifier
        # request -> the candidate it will read for: the alignment of its read
        self._pull_plans: dict[str, PullCandidate] = {}
        # the router's per-turn holds (impl.policy.return_time.RETENTION_KEY): applied, malformed
        self.retention_asked: collections.Counter[str] = collections.Counter()
        # D: retained request -> (finished at, expiry) on self._clock
        self._retained: dict[str, tuple[float, float]] = {}
        # (path, reason) -> count, and how many peer block lists were cut (introspection, logs)
        self.decisions: collections.Counter[tuple[str, str]] = collections.Counter()
        self.trimmed_reads = 0
        # prefill on D: what became of the retained turns requests named as superseded (released, not_held, ...)
        self.superseded_outcomes: collections.Counter[str] = collections.Counter()
        # requests of ours whose KV is being read (no idle throttling while any is in flight)
        self._awaiting_recv: set[str] = set()
        self._sleep: Callable[[float], None] = time.sleep
        self.idle_sleeps = 0
        self._engine_inbox = _find_engine_inbox()
        self._warned_host_buffer = False
        # retained requests D gave back and freed, remembered (bounded) so a late renewal is told why
        self._given_back: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.heartbeats = self._start_heartbeat_listener(vllm_config, engine_id)
        give_back = settings.make_give_back()
        self.give_back = GiveBackLedger(give_back) if give_back is not None else None
        if self.give_back is not None and self.heartbeats is None \
                and vllm_config.kv_transfer_config.kv_role != "kv_producer":
            raise ConfigError("bidikv_retained_under_pressure", "'give_back' needs bidikv_heartbeat_port: the router "
                              "renews each retained turn through D's heartbeat listener before P reads it")
        self._vllm_scheduler: Any = None  # found at the first step
        # token-exact reuse: what this node publishes of what it holds, and how it checks a peer's
        self.prefix = PrefixChecker(vllm_config, hash_block_size_of(vllm_config, kv_cache_config, self.block_size))
        self._reports: dict[str, ReuseReport] = {}  # request -> its read's report, counted when it finishes
        self._stats = BidikvKVConnectorStats()  # the same counts, for vLLM's /metrics (stats.py)
        if (settings.bidirectional and vllm_config.kv_transfer_config.kv_role != "kv_producer"
                and not vllm_config.cache_config.enable_prefix_caching):
            log.warning("bidikv connector %s: prefix caching is off on this D (--no-enable-prefix-caching): a turn the "
                        "router serves here whole (bidikv router --prefill-on-d) cannot reuse what D holds and "
                        "recomputes its whole prompt; P's pulls are unaffected", engine_id)
        log.info("bidikv connector scheduler %s: recompute=%s (threshold %d, P->D %s), retention=%s, "
                 "bidirectional=%s", engine_id, settings.recompute, settings.kv_recompute_threshold,
                 "on" if settings.apply_threshold_p_to_d else "off", settings.retention, settings.bidirectional)

    # -- pull or recompute ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params:
            return 0, False
        if params.get("do_remote_prefill"):
            return self._prefill_to_decode(request, params, num_computed_tokens)
        if (params.get("do_remote_decode") and params.get("remote_block_ids")
                and all(p in params for p in _REMOTE_FIELDS)
                # one read per request: after a failed or declined read (e.g. D's blocks expired) vLLM
                # re-schedules the request from scratch and asks again; upstream then reports the
                # tokens once more but queues no read, and the request waits forever
                and not params.get("_remote_blocks_processed")):
            return self._decode_to_prefill(request, params, num_computed_tokens)
        return 0, False

    def _prefill_to_decode(self, request: "Request", params: dict[str, Any], local_hit: int) -> tuple[int, bool]:
        prompt = self._get_remote_prefill_token_count(len(request.prompt_token_ids or []))
        if prompt - local_hit <= 0:
            return 0, False
        remote = _count(params.get("remote_num_tokens"))
        remote = prompt if remote is None else min(remote, prompt)
        # P computed this very prompt, so its KV matches unless something between P and D re-tokenized
        # differently; P's checkpoints (this connector on P) say so, a P without them is trusted as
        # upstream trusts it (the ordinary disaggregated path must keep working with a plain P)
        offered = remote - local_hit
        verification = self.prefix.verify(request, params) if params.get(CHECK_KEY) is not None else None
        if verification is not None:
            remote = min(remote, verification.tokens)
        if not self.settings.apply_threshold_p_to_d:
            pulled = max(0, remote - local_hit)
            self._report(request, TransferPath.PREFILL_TO_DECODE, offered, verification, pulled, pulled)
            if pulled <= 0:
                return 0, False
            self._pull_plans[request.request_id] = PullCandidate(prompt, remote, local_hit, self.block_size,
                                                                 TransferPath.PREFILL_TO_DECODE)
            self._awaiting_recv.add(request.request_id)
            return pulled, True
        candidate = PullCandidate(prompt, remote, local_hit, self.block_size, TransferPath.PREFILL_TO_DECODE)
        tokens, load = self._decide(request, candidate, local_hit)
        self._report(request, candidate.path, offered, verification, candidate.reusable_tokens, tokens)
        return tokens, load

    def _decode_to_prefill(self, request: "Request", params: dict[str, Any], local_hit: int) -> tuple[int, bool]:
        if not self.is_bidirectional_kv_xfer_enabled:
            return 0, False  # upstream would report tokens it never loads without bidirectional_kv_xfer
        if self.use_host_buffer:
            # GPU with kv_buffer_device "cpu": upstream's update_state_after_alloc only stages P's
            # blocks for saving and never queues the D->P read, so the request would wait forever
            if not self._warned_host_buffer:
                self._warned_host_buffer = True
                log.warning("bidikv: D->P reads are not supported with a host staging buffer "
                            "(kv_buffer_device 'cpu' on a GPU); recomputing instead")
            return 0, False
        remote = _count(params.get("remote_num_tokens") or 0)
        if remote is None:
            log.warning("request %s: ignoring remote_num_tokens %r from the router", request.request_id,
                        params.get("remote_num_tokens"))
            return 0, False
        offered = min(remote, request.num_prompt_tokens) - local_hit
        verification: PrefixVerification | None = self.prefix.verify(request, params)
        if verification.reason is VerifyReason.NO_CHECK and not self.settings.require_verified_prefix:
            verification = None  # the operator chose to trust a D that publishes no checkpoints
        else:
            remote = min(remote, verification.tokens)
        candidate = PullCandidate(request.num_prompt_tokens, remote, local_hit, self.block_size,
                                  TransferPath.DECODE_TO_PREFILL)
        tokens, load = self._decide(request, candidate, local_hit)
        self._report(request, candidate.path, offered, verification, candidate.reusable_tokens, tokens)
        return tokens, load

    def _report(self, request: "Request", path: TransferPath, offered: int,
                verification: PrefixVerification | None, verified: int, pulled: int) -> None:
        if offered <= 0:
            return
        report = report_of(path.value, offered, verification, verified, pulled)
        self._reports[request.request_id] = report
        if report.verified < report.offered:
            log.info("request %s %s: peer offered %d tokens, %d verified equal to the prompt's (%s), pulling %d",
                     request.request_id, path.value, report.offered, report.verified, report.reason, report.pulled)

    def _decide(self, request: "Request", candidate: PullCandidate, local_hit: int) -> tuple[int, bool]:
        decision: RecomputeDecision = self.recompute_policy.decide(candidate)
        self.decisions[(candidate.path.value, decision.reason.value)] += 1
        log.debug("request %s %s: %s %d tokens (%s)", request.request_id, candidate.path.value,
                  "pull" if decision.pull else "recompute", decision.tokens, decision.reason.value)
        if not decision.pull:
            self._pull_plans.pop(request.request_id, None)
            return 0, False
        # vLLM hands us a block-aligned hit, so this is decision.tokens; never beyond what the peer holds
        tokens = min(decision.tokens, min(candidate.remote_num_tokens, candidate.prompt_tokens) - local_hit)
        if tokens <= 0:
            return 0, False
        self._pull_plans[request.request_id] = candidate
        # from now on the engine must keep stepping promptly: vLLM 0.33 may defer the load by a step
        self._awaiting_recv.add(request.request_id)
        return tokens, True

    # -- alignment -----------------------------------------------------------------------------
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        candidate = self._pull_plans.pop(request.request_id, None)
        params = request.kv_transfer_params
        if candidate is not None and num_external_tokens > 0 and params and params.get("remote_block_ids"):
            _, stop = candidate.peer_block_span(num_external_tokens)
            trimmed = self._trim_peer_blocks(params["remote_block_ids"], stop)
            if trimmed is not None:
                params["remote_block_ids"] = trimmed
                self.trimmed_reads += 1
                log.debug("request %s: reading the peer's first %d blocks (prompt %d < peer's %d tokens)",
                          request.request_id, stop, candidate.prompt_tokens, candidate.remote_num_tokens)
        if num_external_tokens > 0:
            self._awaiting_recv.add(request.request_id)
        else:
            self._awaiting_recv.discard(request.request_id)  # the scheduler dropped the load
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _trimmable(self, group: int) -> bool:
        """Full-attention groups list a block per position from 0; window/SSM groups hold other things."""
        if not self._is_hma_required:
            return True
        return (group < len(self.blocks_per_sw) and not self.blocks_per_sw[group]
                and self._ssm_spec_blocks[group] is None)

    def _trim_peer_blocks(self, remote_block_ids: Any, stop: int) -> list | None:
        """The peer's block lists cut to ``stop`` blocks, or None if nothing is cut."""
        if not isinstance(remote_block_ids, (list, tuple)) or not remote_block_ids:
            return None
        if isinstance(remote_block_ids[0], int):  # a flat list: one group
            return list(remote_block_ids[:stop]) if len(remote_block_ids) > stop else None
        out, cut = [], False
        for g, group in enumerate(remote_block_ids):
            group = list(group)
            if len(group) > stop and self._trimmable(g):
                group, cut = group[:stop], True
            out.append(group)
        return out if cut else None

    # -- retention and notification ------------------------------------------------------------
    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._pull_plans.pop(request.request_id, None)
        self._awaiting_recv.discard(request.request_id)
        report = self._reports.pop(request.request_id, None)
        if report is not None:
            self._stats.record_reuse(report)
        request_params = request.kv_transfer_params
        delay, out = super().request_finished(request, block_ids)
        if delay and out is not None and out.get("remote_num_tokens"):
            # what the reader of these blocks will check its prompt against; D's previous answer is
            # where a next prompt drifts (re-tokenized, trimmed, reasoning dropped): checkpoints are
            # dense just after D's prompt
            anchors = (request.num_prompt_tokens,) if out.get("do_remote_decode") else ()
            check = self.prefix.publish(request, int(out["remote_num_tokens"]), anchors)
            if check is not None:
                out[CHECK_KEY] = check
        if out is not None and report is not None and report.path == TransferPath.DECODE_TO_PREFILL.value:
            out[REPORT_KEY] = report.as_params()  # P's answer to the router: what its pull was
        if _DEBUG:
            log.warning("bidikv scheduler %s: request_finished %s status=%s delay=%s", self.engine_id,
                        request.request_id, request.status, delay)
        if delay and out is not None and out.get("do_remote_decode") and out.get("remote_blocks_expiry_time") is not None:
            now = self._clock()
            expiry = self.retention_policy.expiry_on_finish(now)
            asked, malformed = asked_retention_s(request_params)
            if asked is not None:  # the router's learnt hold for this turn: shorter only, D's policy is the cap
                expiry = min(expiry, now + asked)
                self.retention_asked["applied"] += 1
            elif malformed is not None:
                self.retention_asked["malformed"] += 1
                log.warning("bidikv scheduler %s: request %s: %s; D's own retention applies", self.engine_id,
                            request.request_id, malformed)
            self._reqs_need_send[request.request_id] = expiry
            out["remote_blocks_expiry_time"] = expiry
            if self.give_back is not None:
                self.give_back.remove(request.request_id)  # a re-finished id (never in vLLM) starts afresh
                out["remote_blocks_expiry_time"] = self.give_back.add(request.request_id, _block_count(block_ids),
                                                                      now, expiry)
                out[RENEW_BEFORE_READ_KEY] = True
            self._retained[request.request_id] = (now, expiry)
            self._notify(request, request_params, out, expiry - now)
        else:
            # nothing kept for a later turn (bidirectional OFF, aborted, failed): say so, or the router holds
            # the conversation's next turn for up to its notify_wait_s waiting for params that never come
            self._notify(request, request_params, None, None)
        if request.status in _ANSWERED:  # an aborted or failed turn leaves its predecessor as it was
            self._release_superseded(request, request_params)
        return delay, out

    def _release_superseded(self, request: "Request", params: dict[str, Any] | None) -> None:
        """Prefill on D: ``request`` continued a turn this D retains (the router names it, SUPERSEDES_KEY) and
        answered it; nothing will read that turn any more (the router's store handed it out once, to this
        request), so its blocks are released now rather than pinned to its expiry. The worker frees them at
        its next expiry scan; the full blocks the two turns share stay in use by ``request`` (retained in its
        turn, or freed into vLLM's prefix cache), the rest go to the free queue, still cached until reused."""
        named, malformed = superseded(params)
        if malformed is not None:
            self.superseded_outcomes["malformed"] += 1
            log.warning("bidikv scheduler %s: request %s: %s; nothing released", self.engine_id, request.request_id,
                        malformed)
            return
        if named is None:
            return
        previous, engine = named
        if engine != self.engine_id or previous == request.request_id:
            self.superseded_outcomes["other_engine"] += 1
            return
        held = self._retained.pop(previous, None)
        if held is None:  # read, expired or given back meanwhile: nothing pinned
            self.superseded_outcomes["not_held"] += 1
            return
        now = self._clock()
        self._reqs_need_send[previous] = now  # a re-sent deadline: vLLM's worker takes it (pull_worker.py)
        if self.give_back is not None:
            self.give_back.remove(previous)
        self.superseded_outcomes["released"] += 1
        self._stats.record_superseded(max(0.0, held[1] - now))
        log.debug("bidikv scheduler %s: %s superseded by %s on D: released %.1f s before its expiry",
                  self.engine_id, previous, request.request_id, max(0.0, held[1] - now))

    def take_stats(self) -> BidikvKVConnectorStats | None:
        """This step's prefix-verification counts for vLLM's stats path (None when there are none)."""
        return None if self._stats.is_empty() else self._stats.clone_and_reset()

    def _start_heartbeat_listener(self, vllm_config: "VllmConfig", engine_id: str) -> HeartbeatListener | None:
        port = self.settings.heartbeat_port
        # a pure producer (P) never keeps a finished turn for a later one: nothing to renew there, and
        # P and D on one host may share one extra config, so P must not take D's port
        if port == 0 or vllm_config.kv_transfer_config.kv_role == "kv_producer":
            return None
        # one engine core per data-parallel rank, each with its own scheduler: offset like NIXL's side channel
        port += vllm_config.parallel_config.data_parallel_index
        try:
            # the scheduler's dict, read from the listener's threads: one membership test, atomic under the GIL
            listener = HeartbeatListener(self.settings.heartbeat_host, port, engine_id, self._retained.__contains__,
                                         advertised_host=getattr(self, "side_channel_host", None),
                                         was_given_back=self._given_back.__contains__)
        except (OSError, OverflowError) as e:
            raise ConfigError("bidikv_heartbeat_port", f"cannot listen on {self.settings.heartbeat_host}:{port} "
                                                       f"({e})") from None
        log.info("bidikv heartbeat listener of engine %s at %s (retention %s)", engine_id, listener.url,
                 self.settings.retention)
        return listener

    def _drain_heartbeats(self) -> int:
        return 0 if self.heartbeats is None else self.heartbeats.drain(self._answer_heartbeat)

    def _answer_heartbeat(self, request_id: str) -> dict[str, Any]:
        """Apply one relayed heartbeat and say what D now enforces (the listener's protocol)."""
        held = self._retained.get(request_id)
        now = self._clock()
        if held is None:
            if request_id in self._given_back:
                return {"status": "not_held", "reason": "given_back"}
            return {"status": "not_held", "reason": "unknown"}  # read by P's next turn, or reaped
        if now > held[1]:
            # lapsed: the worker frees it at its next expiry scan, and a lapsed lease stays lapsed
            return {"status": "not_held", "reason": "expired"}
        renewed = self.renew(request_id, now)
        if self.give_back is not None:
            return self._answer_give_back(request_id, renewed, now)
        answer: dict[str, Any] = {"status": "held", "renewed": renewed > held[1], "retention": self.settings.retention,
                                  "expiry_time": renewed, "expires_in_s": max(0.0, renewed - now)}
        interval = getattr(self.retention_policy, "heartbeat_interval_s", None)
        if interval is not None:
            answer["heartbeat_interval_s"] = interval
        return answer

    def _answer_give_back(self, request_id: str, intended: float, now: float) -> dict[str, Any]:
        """give_back: a renewal the router asks for before P reads (or a client's heartbeat). The answer's
        ``expiry_time`` is what D publishes (P's deadline: the window from now), ``expires_in_s`` how long
        the router keeps the entry (the retention policy's expiry)."""
        ledger = self.give_back
        assert ledger is not None
        published = ledger.renew(request_id, now)
        if published is None:
            last = ledger.published(request_id)
            if last is None or now >= usable_until(last, ledger.rules.expiry_margin_s):
                # given back: freed at its last published expiry, which P may no longer read before
                return {"status": "not_held", "reason": "given_back"}
            # lapsing: P may still read it before the expiry it was given, and no later
            return {"status": "held", "renewed": False, "retention": self.settings.retention, "given_back": True,
                    "expiry_time": last, "expires_in_s": max(0.0, last - now)}
        return {"status": "held", "renewed": True, "retention": self.settings.retention, "expiry_time": published,
                "expires_in_s": max(0.0, intended - now)}

    def _give_back_under_pressure(self) -> None:
        """give_back, at every step: below the watermark (or with a request waiting), stop renewing what
        the policy names; the worker frees each at its last published expiry (a re-sent deadline)."""
        ledger, sched = self.give_back, self._vllm_scheduler
        if ledger is None or not len(ledger) or sched is None:
            return
        pool = sched.kv_cache_manager.block_pool
        capacity = pool.num_gpu_blocks - 1  # the null block is never handed out
        waiting_blocks = 0
        if len(sched.waiting):
            head = sched.waiting.peek_request()
            waiting_blocks = -(-head.num_tokens // self.block_size)
        short = ledger.rules.shortfall(capacity, pool.get_num_free_blocks(), ledger.lapsing_blocks, waiting_blocks)
        if not short:
            return
        now = self._clock()
        for req_id in ledger.withhold_for(short, now):
            self._reqs_need_send[req_id] = free_at = ledger.free_at(req_id)  # never before what P was given
            self._stats.record_give_back(ledger.pool.blocks_of(req_id))
            log.info("bidikv give-back: %s lapses (frees at its last published expiry, in %.1f s)", req_id,
                     max(0.0, free_at - now))

    def _notify(self, request: "Request", request_params: dict[str, Any] | None, out: dict[str, Any] | None,
                expires_in_s: float | None) -> None:
        if self.notifier is None or not request_params or NOTIFY_KEY not in request_params:
            return
        try:
            target = parse_notify_field(request_params.get(NOTIFY_KEY))
        except ValueError as e:
            log.warning("request %s: not notifying the router: %s", request.request_id, e)
            return
        if target is not None:
            self.notifier.submit(target, out, expires_in_s,
                                 heartbeat_url=self.heartbeats.url if self.heartbeats is not None else None)

    def renew(self, request_id: str, now: float | None = None) -> float | None:
        """Apply the retention policy's renewal to a retained request (a heartbeat); its new expiry or None.

        The new expiry reaches the worker with the next connector metadata (vLLM's worker takes a
        re-sent deadline for a request not read yet). Called on this thread only: the heartbeat
        listener's renewals come through :meth:`_drain_heartbeats`.
        """
        held = self._retained.get(request_id)
        if held is None:
            return None
        finished_at, expiry = held
        now = self._clock() if now is None else now
        if self.give_back is not None and self.give_back.is_lapsing(request_id):
            return expiry  # given back: a lapsing entry stays lapsing, its deadline stays
        renewed = self.retention_policy.renew(expiry, finished_at, now)
        if renewed != expiry:
            self._retained[request_id] = (finished_at, renewed)
            self._reqs_need_send[request_id] = renewed
            if self.give_back is not None:
                self.give_back.extend(request_id, renewed)
        return renewed

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        super().update_connector_output(connector_output)
        if _DEBUG and (connector_output.finished_sending or connector_output.finished_recving):
            log.warning("bidikv scheduler %s: finished_sending=%s finished_recving=%s", self.engine_id,
                        connector_output.finished_sending, connector_output.finished_recving)
        for req_id in connector_output.finished_recving or ():
            self._awaiting_recv.discard(req_id)
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self._awaiting_recv.discard(req_id)
        if not self._retained:
            return
        now = self._clock()
        for req_id in connector_output.finished_sending or ():
            held = self._retained.pop(req_id, None)
            if self.give_back is not None:
                withheld_at = self.give_back.withheld_at(req_id)
                if withheld_at is not None:
                    self._stats.record_given_back_freed(max(0.0, now - withheld_at))
                    self._given_back[req_id] = None
                    if len(self._given_back) > _GIVEN_BACK_MEMORY:
                        self._given_back.popitem(last=False)
                self.give_back.remove(req_id)
            if held is None:
                continue
            finished_at, expiry = held
            if now < expiry:  # released before expiry: P's next turn read it (or declined and said so)
                self.retention_policy.observe_gap(now - finished_at)

    # -- idle-step throttle ----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: "SchedulerOutput"):
        self._drain_heartbeats()  # renewed deadlines go out with this step's metadata
        if self._vllm_scheduler is None:
            self._vllm_scheduler = _find_vllm_scheduler()
        self._give_back_under_pressure()  # and shortened ones (give_back)
        meta = super().build_connector_meta(scheduler_output)
        pause = self.settings.idle_step_sleep_s
        # no idle throttling while a request waits for blocks: the step that frees them must come soon
        waiting = self._vllm_scheduler is not None and len(self._vllm_scheduler.waiting)
        if (pause > 0 and scheduler_output.total_num_scheduled_tokens == 0 and not meta.reqs_to_recv
                and not self._awaiting_recv and not waiting):
            self.idle_sleeps += 1
            self._idle_wait(pause)
        return meta

    def _idle_wait(self, pause: float) -> None:
        """Sleep up to ``pause``, in slices, returning as soon as the engine has new input.

        A heartbeat is new input too: it is answered within a slice, and the wait ends so the renewed
        deadline reaches the worker with the very next step instead of up to ``pause`` later.
        """
        inbox = self._engine_inbox
        heartbeats = self.heartbeats
        if inbox is None:
            self._sleep(min(pause, _BLIND_IDLE_SLEEP_S))
            self._drain_heartbeats()
            return
        deadline = time.monotonic() + pause
        while inbox.empty():
            if heartbeats is not None and heartbeats.pending():
                self._drain_heartbeats()
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._sleep(min(_IDLE_SLICE_S, left))

    def shutdown(self):
        super().shutdown()
        if self.heartbeats is not None:
            self.heartbeats.close()
        if self.notifier is not None:
            self.notifier.close()
