"""Screening: every fixed-TTL point of a sweep from one pass over the workload, without simulating it.

Under a fixed TTL D keeps a finished turn's blocks until ``finish + TTL`` (impl.policy.FixedTTL), and
the router offers them, and P reads them, only up to the expiry margin before that
(impl.policy.ConversationStore: vLLM's P declines reads within 5 s of expiry). With closed-loop gaps
(a turn is sent ``gap_before_s`` after the previous one finished) the time between the finish and the
next arrival is the workload's gap, not the simulation's; with P's prefix cache off, the pull decision
is impl.policy's recompute policy applied to counts the workload fixes (what D holds, what P verifies
of it). So one pass over the turns gives, for every TTL at once, exactly which turns pull and how many
tokens: the reuse figures (tokens recomputed, reused, pulled, offered, verified; the hit rate) of every
fixed-TTL point, exactly as the full simulation counts them.

What the pass cannot know is timing: when a declined or late turn reaches D (its blocks are held until
then), where the run ends (the last turns' holds are cut there) and TTFT. For those it gives bounds:
retained block-seconds between a lower and an upper bound, and TTFT from below (each turn's service
with nothing else in the cluster: no queue, no shared prefill step, the whole NIC, D's largest
possible local hit), so its p50/p90/p99/mean are lower bounds of the simulated ones (a percentile of
element-wise smaller values is smaller).

Premises (:func:`premise_failures` names each one that fails; then nothing is screened): closed-loop
gaps, P's prefix cache off, bidirectional transfer on, every prompt fits a decode instance, no time
limit, the router's store holds every conversation; and no memory pressure on D (a retained entry
dropped before its next turn turns a hit into a miss). The last cannot be read from the workload: the
tuner checks it on every fixed-TTL point it simulates (:func:`pressure_seen`) and simulates everything
if one shows pressure.

Independently of every premise, :meth:`TurnTable.compute_bound_tokens` is a true lower bound on the
prompt tokens any configuration recomputes (every turn reuses the most P could: the verified part of
what D holds after the previous turn, or its own prefix-cache hit), which the tuner reports compute
savings against.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Sequence

import numpy as np

from calibration.profile import LatencyProfile
from impl.policy import FixedTTL, PullCandidate, TransferPath
from impl.policy.prefix_check import verified_tokens_model
from impl.policy.store import usable_until
from sim.engine.config import SimConfig
from sim.engine.records import percentile
from sim.workload.model import Conversation, Lineage, held_tokens

# Turns whose gap lies this close to a TTL's last usable instant (TTL - margin) are left to the
# simulation: its clock adds the gap to the finish time in floating point, so a tie can fall either way.
TIE_S = 1e-6


def premise_failures(config: SimConfig, conversations: Sequence[Conversation], decode_blocks: int,
                     block_size: int) -> list[str]:
    """Why a fixed TTL's hits would depend on the simulation's timing for this workload ('' each)."""
    pol = config.policy
    out = []
    if not pol.bidirectional:
        out.append("bidirectional transfer is off")
    if pol.prefix_caching:
        out.append("P's prefix cache is on (its hits depend on what other turns left there, in time order)")
    if math.isfinite(config.max_sim_time_s):
        out.append("max_sim_time_s is finite (turns cut by the clock)")
    if len(conversations) > pol.max_conversations:
        out.append(f"{len(conversations)} conversations exceed the router's store bound ({pol.max_conversations})")
    if any(t.arrival_s is not None for c in conversations for t in c.turns[1:]):
        out.append("turns carry trace arrival times (the gap after a finish depends on when it finished)")
    if any(-(-t.prompt_tokens // block_size) > decode_blocks for c in conversations for t in c.turns):
        out.append("a prompt exceeds a decode instance's KV capacity (rejected turns)")
    return out


def pressure_seen(metrics: dict[str, Any]) -> bool:
    """A simulated point shows the memory pressure that would make screened hits inexact."""
    return bool(metrics["dropped_under_pressure"] or metrics["preemptions"] or metrics["rejected"]
                or metrics.get("d_waits_behind_retained") or metrics.get("given_back"))


class TurnTable:
    """The one pass: per turn what D holds after it, what the turn can reuse, and how fast it can be served.

    Arrays (numpy) over every turn, and over the continuations (turns after their conversation's first),
    so a point's figures are a few vector operations whatever the TTL."""

    def __init__(self, config: SimConfig, conversations: Sequence[Conversation], profile: LatencyProfile) -> None:
        topo, pol = config.topology, config.policy
        self.margin_s = pol.expiry_margin_s
        self.block_size = bs = profile.block_size
        self.gb_per_block = profile.kv_bytes_per_token * bs / 1e9
        rate = min(profile.transfer_bytes_per_s, topo.nic_line_rate_bytes_per_s * topo.nic_efficiency)
        budget = topo.max_num_batched_tokens
        prompt, held_blocks, local_max, verified_max, ttft_rec = [], [], [], [], []
        c_index, c_gap, c_offered, c_ttft_pull, c_to_d = [], [], [], [], []
        self.candidates: list[PullCandidate] = []  # what P decides on when the router offers D's blocks
        last_index, last_finish = [], []
        for conv in conversations:
            lineage = Lineage(conv.turns)
            clock = conv.start_s  # the conversation's earliest possible timeline
            for k, turn in enumerate(conv.turns):
                n = turn.prompt_tokens
                index = len(prompt)
                prompt.append(n)
                held_blocks.append(-(-held_tokens(turn) // bs))
                local = conv.shared_prefix_tokens if pol.prefix_caching else 0
                if k and pol.prefix_caching:
                    local = max(local, lineage.prompt_agreement(k, k - 1))
                local_max.append(min(local, n - 1) // bs * bs if n > 0 else 0)
                dhit = self._d_hit_max(conv, lineage, k)
                rec_s, rec_to_d = _service_lb(profile, n, 0, dhit, budget, rate)
                ttft_rec.append(rec_s)
                if k == 0:
                    verified_max.append(0)
                    clock += rec_s
                else:
                    prev = conv.turns[k - 1]
                    remote = held_tokens(prev)
                    verified = verified_tokens_model(remote, prev.prompt_tokens, lineage.agreement[k], n, bs)
                    candidate = PullCandidate(n, min(remote, verified), 0, bs, TransferPath.DECODE_TO_PREFILL)
                    reusable = max(0, candidate.reusable_tokens)
                    verified_max.append(reusable)
                    reused = min(reusable, n - 1)
                    pull_s = _service_lb(profile, n, reused, dhit, budget, rate)[0] if reused > 0 else rec_s
                    self.candidates.append(candidate)
                    c_index.append(index)
                    c_gap.append(turn.gap_before_s)
                    c_offered.append(min(remote, n))
                    c_ttft_pull.append(pull_s)
                    c_to_d.append(rec_to_d)
                    clock += turn.gap_before_s + min(rec_s, pull_s)
                clock += _decode_lb(profile, n, turn.output_tokens)
            last_index.append(len(prompt) - 1)
            last_finish.append(clock)
        self.prompt = np.array(prompt, dtype=np.int64)
        self.held_blocks = np.array(held_blocks, dtype=np.float64)
        self.local_max = np.array(local_max, dtype=np.int64)
        self.verified_max = np.array(verified_max, dtype=np.int64)
        self.ttft_lb_recompute_s = np.array(ttft_rec, dtype=np.float64)
        self.c_index = np.array(c_index, dtype=np.int64)
        self.c_gap_s = np.array(c_gap, dtype=np.float64)
        self.c_offered = np.array(c_offered, dtype=np.int64)
        self.c_reusable = np.array([max(0, c.reusable_tokens) for c in self.candidates], dtype=np.int64)
        self.c_ttft_lb_pull_s = np.array(c_ttft_pull, dtype=np.float64)
        self.c_to_d_lb_s = np.array(c_to_d, dtype=np.float64)  # arrival to D when recomputing
        self.last_index = np.array(last_index, dtype=np.int64)
        # estimated finish of each conversation and of the run (for the estimate of holds the run's end cuts)
        self.last_finish_estimate_s = np.array(last_finish, dtype=np.float64)
        # the run ends at the sampler's first tick after the last turn (sim.engine.cluster)
        end = float(self.last_finish_estimate_s.max()) if last_finish else 0.0
        self.end_estimate_s = math.ceil(end / config.series_interval_s) * config.series_interval_s

    @staticmethod
    def _d_hit_max(conv: Conversation, lineage: Lineage, k: int) -> int:
        """The most D's own copy (retained or cached, same history revision) can serve turn ``k``."""
        turns = conv.turns
        for j in range(k - 1, -1, -1):
            if turns[j].history_revision == turns[k].history_revision:
                return max(0, min(held_tokens(turns[j]), lineage.held_agreement(k, j), turns[k].prompt_tokens - 1))
        return 0

    def compute_bound_tokens(self) -> int:
        """Prompt tokens recomputed if every turn reused the most P could (a bound for runs that reject nothing)."""
        reuse = np.minimum(np.maximum(self.verified_max, self.local_max), np.maximum(self.prompt - 1, 0))
        return int((self.prompt - reuse).sum())


def _service_lb(profile: LatencyProfile, n: int, reused: int, d_hit_max: int, budget: int,
                rate: float) -> tuple[float, float]:
    """(TTFT, arrival to D) of a turn alone in the cluster: lower bounds of the simulated ones.

    Alone, a prefill takes the fewest steps (a full budget each) and the whole NIC; sharing a step adds
    work, and the hidden fixed part a pulled turn brings is subtracted as if every step had it."""
    t = 0.0
    if reused:
        t += profile.transfer_fixed_s(profile.blocks_for(reused)) + profile.transfer_bytes(reused) / rate
        t += profile.reuse_overhead_s(reused)
    new, context = n - reused, reused
    steps = 0
    while new > 0:
        take = min(new, budget)
        t += profile.prefill_step_s(((take, context),))
        new, context, steps = new - take, context + take, steps + 1
    t -= profile.pull_hidden_s() * steps
    to_d = t
    p2d = n - d_hit_max // profile.block_size * profile.block_size
    if p2d > 0:
        t += profile.handoff_fixed_s(profile.blocks_for(p2d)) + profile.transfer_bytes(p2d) / rate
    return t + profile.ttft_overhead_s(n, reused), to_d


def _decode_lb(profile: LatencyProfile, n: int, output_tokens: int) -> float:
    """Decode steps of one sequence alone (batch 1, its own context only)."""
    steps = max(output_tokens - 1, 0)
    return steps * profile.decode_step_s(1, n) + profile.decode_per_ctx_token_s * steps * (steps - 1) / 2


class Screen:
    """Screened figures of fixed-TTL points on one workload, for any TTL and recompute policy."""

    def __init__(self, table: TurnTable) -> None:
        self.table = table
        self._decisions: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def _decide(self, policy: Any) -> tuple[np.ndarray, np.ndarray]:
        """impl.policy's decision on every continuation's candidate: (pull?, tokens), once per policy."""
        key = repr(policy)
        if key not in self._decisions:
            decisions = [policy.decide(c) for c in self.table.candidates]
            self._decisions[key] = (np.array([d.pull for d in decisions], dtype=bool),
                                    np.array([d.tokens for d in decisions], dtype=np.int64))
        return self._decisions[key]

    def figures(self, ttl_s: float, recompute_policy: Any) -> dict[str, Any] | None:
        """The point's figures, or None when a gap ties the TTL (only the simulation can tell)."""
        t = self.table
        expiry = FixedTTL(ttl_s).expiry_on_finish(0.0)  # relative to the finish: impl.policy's rule
        last_usable = usable_until(expiry, t.margin_s)  # the store's and P's last instant
        gap = t.c_gap_s
        if expiry > 0 and (np.any(np.abs(gap - last_usable) <= TIE_S) or np.any(np.abs(gap - expiry) <= TIE_S)):
            return None
        pull, tokens = self._decide(recompute_policy)
        hit = (gap < last_usable) if expiry > 0 else np.zeros(len(gap), dtype=bool)
        pulled = hit & pull
        n = t.prompt[t.c_index]
        reused = np.where(pulled, np.minimum(tokens, n - 1), 0)
        ttft = t.ttft_lb_recompute_s.copy()
        ttft[t.c_index] = np.where(pulled, t.c_ttft_lb_pull_s, t.ttft_lb_recompute_s[t.c_index])
        # hold of each turn's blocks (indexed by the turn holding them): lower bound, estimate, upper bound
        lo, est, hi = (np.zeros(len(t.prompt)) for _ in range(3))
        if expiry > 0:
            prev = t.c_index - 1
            expired = gap >= expiry
            read = pulled  # P's read begins at the arrival: held exactly the gap
            lo[prev] = np.where(read, gap, np.where(expired, expiry, gap))
            hi[prev] = np.where(read, gap, expiry)
            # declined or too late for P: held until the turn reaches D after its prefill, or the expiry
            est[prev] = np.where(read, gap, np.minimum(expiry, gap + np.where(expired, expiry, t.c_to_d_lb_s)))
            # a conversation's last blocks: until the expiry or the run's end, whichever first
            lo[t.last_index] = 0.0
            est[t.last_index] = np.minimum(expiry, np.maximum(0.0, t.end_estimate_s - t.last_finish_estimate_s))
            hi[t.last_index] = expiry
        blocks = t.held_blocks * t.gb_per_block
        ordered = np.sort(ttft)
        # Two points with one retention whose policies pull the same tokens on every turn that reaches a
        # decision run the same simulation, event for event: one stands for the other.
        digest = hashlib.blake2b(np.where(pulled, tokens, -1).tobytes(), digest_size=16).hexdigest()
        later = len(t.c_index)
        return {
            "tokens_recomputed": int(t.prompt.sum() - reused.sum()), "tokens_reused": int(reused.sum()),
            "tokens_pulled": int(np.where(pulled, tokens, 0).sum()),
            "tokens_offered": int(np.where(hit, t.c_offered, 0).sum()),
            "tokens_verified": int(np.where(hit, t.c_reusable, 0).sum()),
            "reuse_hit_rate": float((reused > 0).sum() / later) if later else math.nan,
            "same_simulation_key": (float(expiry), digest),
            "retained_hbm_gb_s_bounds": (_total(blocks, lo), _total(blocks, hi)),
            "retained_hbm_gb_s_estimate": _total(blocks, est),
            "ttft_lower_bound_ms": {"p50": percentile(ordered, 50) * 1e3, "p90": percentile(ordered, 90) * 1e3,
                                    "p99": percentile(ordered, 99) * 1e3,
                                    "mean": float(ordered.mean()) * 1e3 if len(ordered) else math.nan},
        }


def _total(gb: np.ndarray, hold_s: np.ndarray) -> float:
    """GB*s held: numpy's own pairwise sum, not a BLAS dot, whose threads split the sum (its last bits
    follow the thread count) and spin on the cores the simulations run on."""
    return float((gb * hold_s).sum())


def screenable(policy: Any) -> bool:
    """A point the screen can stand for: a fixed TTL with bidirectional transfer (sim.engine.config.PolicyConfig)."""
    return policy.retention == "ttl" and policy.bidirectional


# The settings that only build P's recompute policy (sim.engine.config.PolicyConfig.recompute): with the host
# tier and prefill on D off, the simulation reads them through that policy's decide() and nowhere else.
RECOMPUTE_SETTINGS = ("recompute_policy", "kv_recompute_threshold")


def offerable_candidates(conversations: Sequence[Conversation], block_size: int) -> list[PullCandidate]:
    """Every candidate P can decide on in any run of this workload, whatever D retains, with P's prefix cache
    off: turn ``k`` offered what D held after any earlier turn ``j`` of its conversation (the router's entry
    is the last retained turn's, which need not be ``k - 1``'s when a hold was skipped), verified as
    sim.engine.prefill does it. One per distinct (prompt, offered) pair: decide() sees nothing else."""
    seen: set[tuple[int, int]] = set()
    for conv in conversations:
        turns = conv.turns
        lineage = Lineage(turns)
        for k in range(1, len(turns)):
            n = turns[k].prompt_tokens
            for j in range(k):
                held = turns[j]
                remote = held_tokens(held)
                verified = verified_tokens_model(remote, held.prompt_tokens, lineage.held_agreement(k, j), n,
                                                 block_size)
                seen.add((n, min(remote, verified)))
    return [PullCandidate(n, r, 0, block_size, TransferPath.DECODE_TO_PREFILL) for n, r in sorted(seen)]


class Screener:
    """The tuner's hook: a candidate's screened figures (None: not screenable or a tie), and which points run
    the same simulation because only their recompute policies differ and those decide alike everywhere."""

    def __init__(self, config: SimConfig, conversations: Sequence[Conversation], profile: LatencyProfile,
                 table: TurnTable | None = None) -> None:
        self.config, self.profile = config, profile
        self.screen = Screen(table or TurnTable(config, conversations, profile))
        self._offerable = offerable_candidates(conversations, profile.block_size)
        self._anywhere: dict[str, str] = {}

    def __call__(self, candidate: Any) -> dict[str, Any] | None:
        policy = dataclasses.replace(self.config.policy, **candidate.policy)
        if not screenable(policy):
            return None
        return self.screen.figures(policy.decoder_kv_blocks_ttl, policy.recompute(self.profile))

    def same_simulation_key(self, config: SimConfig, overrides: dict[str, Any]) -> tuple[str, str] | None:
        """A key equal for two points (base config, policy overrides) exactly when they differ at most in their
        recompute policies and those make the same decision (pull or not, and how many tokens) on every
        candidate any run of the workload can offer P: then every turn meets the same decision in both
        simulations, and the two run event for event alike (the recompute policy enters a run only through
        decide(); the decision's reason is in no figure). None where that argument does not hold (host tier
        or prefill on D: both read the recompute settings elsewhere) or the config is not the screened one."""
        policy = dataclasses.replace(config.policy, **overrides)
        if (dataclasses.replace(config, policy=self.config.policy) != self.config or not policy.bidirectional
                or policy.prefix_caching or policy.host_tier or policy.prefill_on_d != "off"):
            return None
        rest = {k: v for k, v in overrides.items() if k not in RECOMPUTE_SETTINGS}
        return repr(config) + repr(sorted(rest.items())), self._decides_anywhere(policy.recompute(self.profile))

    def _decides_anywhere(self, recompute_policy: Any) -> str:
        key = repr(recompute_policy)
        if key not in self._anywhere:
            decided = [recompute_policy.decide(c) for c in self._offerable]
            pulls = np.array([d.tokens if d.pull else -1 for d in decided], dtype=np.int64)
            self._anywhere[key] = hashlib.blake2b(pulls.tobytes(), digest_size=16).hexdigest()
        return self._anywhere[key]


def screener(config: SimConfig, conversations: Sequence[Conversation], profile: LatencyProfile,
             decode_blocks: int, table: TurnTable | None = None) -> tuple[Screener | None, list[str]]:
    """(the tuner's hook, or None with why nothing is screened)."""
    reasons = premise_failures(config, conversations, decode_blocks, profile.block_size)
    if reasons:
        return None, reasons
    return Screener(config, conversations, profile, table), []
