"""Wire a cluster (XpYd) from a config and a profile, drive it with conversations, collect results.

This is the only module that builds things; the event loop is simpy's queue, stepped by
:func:`sim.engine.instant.run`. Clients are closed loop per conversation (:mod:`sim.clients.conversation`): a
turn is released a think/tool gap after the previous one completed (or at its trace arrival time, if
later). Under a heartbeat lease a client heartbeats after a turn for as long as its renewal behaviour
says (:mod:`sim.clients.renewal`: while the session is open, while a tool call runs, never, or the clairvoyant
"until the next turn").
"""

from __future__ import annotations

import collections
import contextlib
import gc
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import simpy

from calibration.profile import LatencyProfile
from impl.policy import ConversationStore
from sim.clients.renewal import ClientRenewal
from sim.clients.conversation import Arrivals, ConversationClient
from sim.engine.config import SimConfig
from sim.engine.decode import DecodeNode
from sim.engine.host_tier import HostTier, build_host_tier, host_summary
from sim.engine.instant import after, call_soon, process_now, run
from sim.engine.interconnect import Interconnect
from sim.engine.learnt import LearntHolds
from sim.engine.oracle import OracleRetention
from sim.engine.prefill import PrefillNode
from sim.engine.prefill_on_d import PrefillOnDRouting
from sim.engine.records import RecordTable, TurnRecord, fields_of, summarize
from sim.engine.rng import stream
from sim.engine.router import Router
from sim.workload.model import Conversation, Lineage, agreement


@dataclass
class SimResult:
    records: Sequence[TurnRecord]  # a RecordTable from Cluster.run
    summary: dict
    series: list[tuple[float, str, int, int, int, int]] = field(default_factory=list)  # t, node, running, retained, cached, capacity
    config: SimConfig | None = None
    # per decode node: (the most blocks it ever had in use, its capacity): how close it came to pressure
    decode_peaks: list[tuple[int, int]] = field(default_factory=list)


class Cluster:
    def __init__(self, config: SimConfig, profile: LatencyProfile) -> None:
        self.config, self.profile = config, profile
        topo, pol = config.topology, config.policy
        self.env = env = simpy.Environment()
        self.interconnect = Interconnect(env, topo.nic_line_rate_bytes_per_s * topo.nic_efficiency,
                                         profile.transfer_bytes_per_s)
        decode_blocks = topo.decode_kv_blocks or profile.decode_blocks()
        cache_blocks = topo.prefill_cache_blocks or decode_blocks
        recompute = pol.recompute(profile)
        self.prefill = [PrefillNode(env, f"p{i}", profile, recompute, self.interconnect, topo.max_num_batched_tokens,
                                    cache_blocks, pol.prefix_caching) for i in range(topo.num_prefill)]
        self.decode: list[DecodeNode] = []
        self.store = ConversationStore(pol.max_conversations, pol.expiry_margin_s)
        self.router = Router(env, self.prefill, self.decode, self.store, pol.placement_policy(), pol.placement_policy(),
                             stream(config.seed, "placement"), pol.bidirectional, pol.prefix_caching)
        for i in range(topo.num_decode):
            self.decode.append(DecodeNode(env, f"d{i}", profile, decode_blocks, topo.max_num_seqs, pol.retention_policy(),
                                          pol.bidirectional, pol.decode_prefix_caching, pol.expiry_margin_s,
                                          self.interconnect, self.router.on_decode_finish,
                                          pressure_mode=pol.retained_under_pressure, give_back=pol.give_back()))
        for p in self.prefill:
            p.decline_frees_d = pol.decline_frees_d
        self.router.add_decode(self.decode)
        if pol.prefill_on_d != "off":
            self.router.on_d = PrefillOnDRouting(pol.prefill_on_d_policy(), self.router._decode_by_name, self.prefill,
                                                 pol.expiry_margin_s)
            for d in self.decode:
                d.step_token_budget = topo.max_num_batched_tokens
        self.host: HostTier | None = None
        if pol.host_tier:
            self.host = build_host_tier(env, pol, profile)
            self.host.add_decode(self.decode)
            self.router.host = self.host
            for p in self.prefill:
                p.host = self.host
        # each conversation's turn in flight, for the oracle's look at the next one (only it reads them)
        self._conversations: dict[tuple[str, str], Conversation] = {}
        self._turn_index: dict[tuple[str, str], int] = {}
        self._tracks_turns = pol.retention == "oracle"
        if pol.retention == "oracle":
            oracle = OracleRetention(self._next_reuse, pol.expiry_margin_s)
            for d in self.decode:
                d.retention = oracle
                d.retention_expiry = oracle.expiry_for
        self.learnt: LearntHolds | None = None
        if pol.retention == "learnt":
            self.learnt = LearntHolds(pol.learnt_retention(decode_blocks * topo.num_decode), pol.decoder_kv_blocks_ttl)
            self.router.learnt = self.learnt
            for d in self.decode:
                d.retention_expiry = self.learnt.expiry_for
        # every turn's record in arrival order: packed when the turn is over (see send_turn)
        self.records = RecordTable()
        self.series: list[tuple[float, str, int, int, int, int]] = []
        self._live_clients = 0
        self._stuck_at = math.nan  # when nothing but the sampler was left to happen, with clients still waiting
        self.renewal = ClientRenewal(config.clients, config.seed)
        self.heartbeats_sent = 0

    @property
    def live_clients(self) -> int:
        """Clients still to send or finish a turn: the sampler and the heartbeats run while any is."""
        return self._live_clients

    def client_exited(self) -> None:
        """A client started by :meth:`run` (or its ``clients`` hook) is done with its last turn."""
        self._live_clients -= 1

    def _next_reuse(self, key: tuple[str, str], now: float) -> float | None:
        """Arrival of the conversation's next turn if it continues the current one (oracle only)."""
        conv = self._conversations[key]
        index = self._turn_index[key] + 1
        if index >= len(conv.turns):
            return None
        turn = conv.turns[index]
        if agreement(conv.turns[index - 1], turn) == 0:  # the next prompt shares nothing D holds
            return None
        return now + turn.gap_before_s if turn.arrival_s is None else max(turn.arrival_s, now)

    def _sample(self, _event: object = None) -> None:
        """One row per D of the series, then again an interval later, while any client is live (a
        callback where a sampling process resumed: the same queue entries, without the resumes)."""
        if self._live_clients <= 0:
            return
        now = self.env._now
        if not self.env._queue:
            # nothing else will ever happen: every live client waits on a turn no event can end (a D whose
            # pool is pinned by retained blocks that never expire, with nothing running to free any)
            self._stuck_at = now
            return
        for d in self.decode:
            d.advance_retention(now)
            self.series.append((now, d.name, d.running_blocks, d.retained.blocks, d.cached_blocks, d.capacity))
        after(self.env, self.config.series_interval_s, self._sample)

    def send_turn(self, conv: Conversation, index: int, lineage: Lineage | None,
                  on_done: Callable[[], None], key: tuple[str, str] | None = None) -> TurnRecord:
        """Send turn ``index`` of ``conv`` now; ``on_done()`` runs from the event that ends it. ``key``:
        the conversation's (tenant, id), if the caller keeps one: the store's and nodes' dicts then all
        hold that one tuple rather than several turns' equal ones, for as long as the run lasts."""
        if key is None:
            key = (conv.tenant, conv.conversation_id)
        if self._tracks_turns:
            self._conversations[key] = conv
            self._turn_index[key] = index
        turn = conv.turns[index]
        rec = TurnRecord(conv.conversation_id, index, conv.tenant, turn.prompt_tokens, turn.output_tokens, self.env._now)
        end = _TurnEnd()
        records = end.records = self.records
        end.row, end.on_done = records.reserve(rec), on_done
        self.router.handle(rec, key, turn.history_revision, conv.shared_prefix_tokens, lineage, end.done)
        return rec

    def serve_turn(self, conv: Conversation, index: int, lineage: Lineage) -> Generator[simpy.Event, Any, TurnRecord]:
        """Send turn ``index`` of ``conv`` now and wait until it finishes: the hook for a client loop that
        interleaves conversations (vLLM's benchmark clients, sim/clients/bench.py)."""
        finished = self.env.event()
        # processed on the spot: the turn's last event resumes this process, as when the turn was a generator
        rec = self.send_turn(conv, index, lineage, lambda: process_now(finished))
        yield finished
        return rec

    def run(self, conversations: Sequence[Conversation], progress: Callable[[float], None] | None = None,
            clients: Callable[["Cluster", Sequence[Conversation]], int] | None = None) -> SimResult:
        """``clients``: starts the client processes itself and returns how many (each calls
        :meth:`client_exited` when it exits); turns it never sends are not recorded. Default: one process per
        conversation, or a pool of ``config.num_clients``."""
        with without_cyclic_gc():  # the summary's lists too: at a million turns they are millions of objects
            return self._run(conversations, progress, clients)

    def _run(self, conversations: Sequence[Conversation], progress: Callable[[float], None] | None,
             clients: Callable[["Cluster", Sequence[Conversation]], int] | None) -> SimResult:
        env = self.env
        self._live_clients = len(conversations)
        if clients is not None:
            self._live_clients = clients(self, conversations)
        else:
            # clients started here act where their processes would first have run: every process
            # started at time 0 before any other event, in this order
            lease = self.router.decode[0].retention if self.config.policy.retention == "lease" else None
            if self.config.num_clients:
                queue = collections.deque(conversations)

                def next_conversation() -> None:
                    if queue:
                        ConversationClient(self, queue.popleft(), lease, next_conversation).start()

                for _ in range(self.config.num_clients):
                    next_conversation()
            else:
                Arrivals(self, conversations, lease)
        call_soon(env, self._sample)  # where a sampling process started now would first run
        until = self.config.max_sim_time_s
        # One run for the whole simulation, with or without a bar, so the clock stops where it would
        # without one (chunked env.run(until=now + 60) calls never end: simpy re-queues its stop event,
        # so peek() never reaches inf; they also stopped the clock on a chunk boundary).
        run(env, None if math.isinf(until) else until, progress)
        if progress is not None:
            progress(env.now)
        end = env.now
        for d in self.decode:
            d.advance_retention(end)
        self._reject_unfinished(conversations if clients is None else ())
        bytes_per_block = self.profile.kv_bytes_per_token * self.profile.block_size
        summary = summarize(self.records, bytes_per_block, {d.name: d.totals for d in self.decode}, end)
        summary["prefill_utilisation"] = {p.name: (p.busy_s / end if end > 0 else 0.0) for p in self.prefill}
        summary["bytes_moved"] = self.interconnect.bytes_moved
        summary["transfers"] = self.interconnect.transfers
        summary["heartbeats"] = self.heartbeats_sent  # client heartbeats relayed to D (lease retention only)
        if self.learnt is not None:
            summary["learnt_retention"] = self.learnt.summary()
        if self.host is not None:
            summary["host_tier"] = host_summary(self.host, end)
        return SimResult(self.records, summary, self.series, self.config,
                         [(d.totals.peak_used_blocks, d.capacity) for d in self.decode])

    def _reject_unfinished(self, conversations: Sequence[Conversation]) -> None:
        # a turn's record is packed when the turn ends, completed or rejected: only records still held
        # as objects (the turns in flight) can be unfinished
        records = self.records
        why = ("unfinished at max_sim_time_s" if math.isnan(self._stuck_at) else
               "stuck: waiting for decode blocks pinned by retained turns that never expire")
        for rec in records.held():
            if math.isnan(rec.completion_s) and not rec.rejected:
                rec.rejected = why
        records.pack_held()
        if math.isnan(self._stuck_at) and math.isinf(self.config.max_sim_time_s):
            return  # the run went to its end with no client stuck: every turn was sent (invariant 1 checks it)
        # a conversation's turns are sent in order, so those sent are a prefix: one count per conversation,
        # not a set entry per turn; per id, and per (tenant, id) for an id two tenants share (two conversations)
        tenants: dict[str, str] = {}  # conversation id -> its tenant, or "" for an id two tenants share
        for conv in conversations:
            if tenants.setdefault(conv.conversation_id, conv.tenant) != conv.tenant:
                tenants[conv.conversation_id] = ""
        sent: dict[Any, int] = {}
        for conversation, index in fields_of(records, "conversation", "turn"):
            if index >= sent.get(conversation, 0):
                sent[conversation] = index + 1
        if "" in tenants.values():  # then count those ids per tenant (rare: a second pass, over their records)
            for tenant, conversation, index in fields_of(records, "tenant", "conversation", "turn"):
                if not tenants.get(conversation, True) and index >= sent.get((tenant, conversation), 0):
                    sent[(tenant, conversation)] = index + 1
        for conv in conversations:
            shared = not tenants[conv.conversation_id]
            key = (conv.tenant, conv.conversation_id) if shared else conv.conversation_id
            for index in range(sent.get(key, 0), len(conv.turns)):
                turn = conv.turns[index]
                rec = TurnRecord(conv.conversation_id, index, conv.tenant, turn.prompt_tokens, turn.output_tokens, math.nan)
                rec.rejected = ("not released by max_sim_time_s" if math.isnan(self._stuck_at) else
                                "not sent: the run was stuck on pinned decode blocks")
                records.pack(records.reserve(rec))


class _TurnEnd:
    """A sent turn's end: its bound ``done`` is what the router calls back (a closure per turn cost more).
    No ``__init__``: ``Cluster.send_turn`` fills it."""

    __slots__ = ("records", "row", "on_done")
    records: RecordTable
    row: int
    on_done: Callable[[], None]

    def done(self) -> None:
        # every end of a turn (completed, or rejected by D) runs this once, after the last write to its
        # record: the table keeps its values instead of the object
        self.records.pack(self.row)
        self.on_done()


@contextlib.contextmanager
def without_cyclic_gc():
    """Run with the cyclic GC off, restored as the caller had it. A run frees what it allocates by
    reference counting (no cycle per turn: tests/sim/test_no_cycles.py; sim/engine/interconnect breaks the one a
    flow and its timer made), so while it runs the collector only rescans what the run keeps, the
    records and store entries, over and over. On a million-turn tune point (gc.callbacks, CPU time): 8.3 s
    of collections with the youngest generation at 50,000 allocations and the workload frozen out of the
    scans, two full collections among them; off, one collection of 6.5 s once the point's objects are
    garbage (the cluster is a cycle; what it kept is freed then)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate(config: SimConfig, conversations: Sequence[Conversation], profile: LatencyProfile | None = None,
             progress: Callable[[float], None] | None = None) -> SimResult:
    profile = profile or LatencyProfile.load(config.profile)
    return Cluster(config, profile).run(conversations, progress)
