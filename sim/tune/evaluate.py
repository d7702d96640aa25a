"""One sweep point: simulate a candidate and reduce it to the figures the frontier needs.

A top-level function of plain data in, plain data out, so a process pool or Ray can run it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Sequence

from impl.policy.give_back import GiveBack
from sim.engine.cluster import without_cyclic_gc
from sim.engine.config import SimConfig
from sim.engine.records import fields_of, percentile
from sim.engine.runner import run_config
from sim.workload import load_workload
from sim.workload.model import Conversation


def evaluate(config: SimConfig, policy_overrides: dict[str, Any],
             conversations: Sequence[Conversation] | None = None) -> dict[str, Any]:
    """``conversations``: the workload, if not the one ``config`` generates (tests give their own)."""
    cfg = dataclasses.replace(config, policy=dataclasses.replace(config.policy, **policy_overrides)).validate()
    if conversations is None:
        try:
            conversations = _workload(json.dumps(cfg.workload, sort_keys=True), cfg.seed)
        except TypeError:  # a spec JSON cannot carry: generate it for this point alone
            conversations = load_workload(cfg.workload, cfg.seed)
    with without_cyclic_gc():  # reducing a million records allocates millions of objects, none in a cycle
        return _figures(cfg, run_config(cfg, conversations=conversations))


def _figures(cfg: SimConfig, result: Any) -> dict[str, Any]:
    s = result.summary
    # the completed turns' TTFTs and total queueing, from the table's columns (no record built)
    ttfts: list[float] = []
    tpots: list[float] = []  # sim.engine.records.TurnRecord.tpot_s of the turns with two output tokens or more
    queued = 0  # a left fold from the int 0 in record order: what sum() over the records computed
    for rejected, ttft_s, p_queue_s, d_queue_s, arrival_s, completion_s, output_tokens in fields_of(
            result.records, "rejected", "ttft_s", "p_queue_s", "d_queue_s", "arrival_s", "completion_s", "output_tokens"):
        if not rejected:
            ttfts.append(ttft_s)
            queued += p_queue_s + d_queue_s
            if output_tokens > 1:
                tpots.append((completion_s - arrival_s - ttft_s) / (output_tokens - 1))
    ttfts.sort()
    tpots.sort()
    return {
        "ttft_p50_ms": s["ttft"]["p50_ms"], "ttft_p90_ms": s["ttft"]["p90_ms"], "ttft_p99_ms": s["ttft"]["p99_ms"],
        "ttft_mean_ms": s["ttft"]["mean_ms"],
        # time per output token after the first: what the other sequences on a D pay for work D takes on
        # (None when no turn has two output tokens: NaN would make equal runs' figures compare unequal)
        "tpot_p50_ms": percentile(tpots, 50) * 1e3 if tpots else None,
        "tpot_p90_ms": percentile(tpots, 90) * 1e3 if tpots else None,
        # over the NICs, both directions, every transfer: the interconnect's and the host tier's pulls
        "bytes_moved": s["bytes_moved"] + s.get("host_tier", {}).get("bytes_moved", 0.0),
        "host_dram_gb_s": s.get("host_tier", {}).get("dram_byte_seconds", 0.0) / 1e9,  # the host tier's KV, held
        "tokens_recomputed": s["tokens_recomputed"], "tokens_reused": s["tokens_reused"],
        # D's tokens the router offered, P verified equal to its prompt's ids, and P pulled
        "tokens_offered": s["tokens_offered"], "tokens_verified": s["tokens_verified"], "tokens_pulled": s["tokens_pulled"],
        "retained_hbm_gb_s": s["retained_hbm_gb_s"], "peak_retained_hbm_gb": s["peak_retained_hbm_gb"],
        "preemptions": s["preemptions"], "rejected": s["rejected"], "dropped_under_pressure": s["dropped_under_pressure"],
        "reuse_hit_rate": s["reuse_hit_rate"], "sim_time_s": s["sim_time_s"], "heartbeats": s["heartbeats"],
        # what D's memory cost: turns' time waiting for blocks, and how much of it retained blocks caused
        "d_wait_total_s": s["d_wait"]["total_s"], "d_wait_p99_ms": s["d_wait"]["p99_ms"] if s["d_wait"]["n"] else 0.0,
        "d_waits_behind_retained": s["d_waits_behind_retained"],
        "preemptions_behind_retained": s["preemptions_behind_retained"], "given_back": s["given_back"],
        # capacity, for the tuner's warning that an answer is about queueing rather than reuse
        "prefill_utilisation_max": max(s["prefill_utilisation"].values(), default=0.0),
        "queue_share_of_ttft": (queued / sum(ttfts)) if sum(ttfts) > 0 else 0.0,
        "ttft_cdf_ms": [t * 1e3 for t in ttfts[:: max(1, len(ttfts) // 200)]],
        "retained_series": _retained_series(result, cfg),
        "give_back_idle": give_back_idle(cfg, s, result.decode_peaks),
    }


def give_back_idle(cfg: SimConfig, summary: dict[str, Any], decode_peaks: Sequence[tuple[int, int]]) -> bool:
    """A pinned run that giving back would not have changed, event for event: no turn waited for blocks, nothing
    was preempted, dropped or rejected, and no D ever had fewer free blocks than give_back's headroom watermark
    (sim/engine/decode.py gives back only below the watermark or while a turn waits; otherwise the two modes run the
    same events: the renewals it adds are answered at once). Its give_back twin takes its figures."""
    pol = cfg.policy
    if pol.retained_under_pressure != "pinned" or summary["d_waits"] or summary["preemptions"] or summary["rejected"] \
            or summary["dropped_under_pressure"]:
        return False
    headroom = GiveBack(pol.give_back_publish_window_s, pol.give_back_headroom, pol.expiry_margin_s).headroom_blocks
    return all(capacity - peak >= headroom(capacity) for peak, capacity in decode_peaks)


@functools.lru_cache(maxsize=1)
def _workload(spec: str, seed: int) -> tuple[Conversation, ...]:
    """The sweep's workload, generated once per worker process (a million turns take seconds to make;
    conversations are frozen, so every point sees the same ones)."""
    return tuple(load_workload(json.loads(spec), seed))


def _retained_series(result: Any, cfg: SimConfig) -> list[tuple[float, float]]:
    """Total retained GB across decode nodes over time (sampled)."""
    from calibration.profile import LatencyProfile

    profile = LatencyProfile.load(cfg.profile)
    gb_per_block = profile.kv_bytes_per_token * profile.block_size / 1e9
    totals: dict[float, float] = {}
    for t, _node, _running, retained, _cached, _cap in result.series:
        totals[t] = totals.get(t, 0.0) + retained * gb_per_block
    return sorted(totals.items())


def pinned_twin(policy: dict[str, Any]) -> dict[str, Any] | None:
    """The pinned point a give_back point runs the same simulation as whenever giving back never acts
    (:func:`give_back_idle`); None for any other point."""
    if policy.get("retained_under_pressure") != "give_back":
        return None
    return {**policy, "retained_under_pressure": "pinned"}


def run_with_twins(configs: Sequence[SimConfig], policies: Sequence[dict[str, Any]],
                   run: Callable[[list[SimConfig], list[dict[str, Any]]], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every point's figures (``configs[i]`` with ``policies[i]``), a give_back point taking its pinned twin's
    when that run shows giving back would not have acted (the same simulation, event for event): the pinned
    points first, then the give_back points whose twins came near D's memory limit."""
    twins = [pinned_twin(p) for p in policies]
    first = [(c, p) for c, p, t in zip(configs, policies, twins) if t is None]
    first += [(c, t) for c, t in zip(configs, twins) if t is not None]
    done = dict(zip((twin_key(c, p) for c, p in first), run([c for c, _ in first], [p for _, p in first])))
    rest = [(c, p) for c, p, t in zip(configs, policies, twins) if t is not None and not done[twin_key(c, t)]["give_back_idle"]]
    done.update(zip((twin_key(c, p) for c, p in rest), run([c for c, _ in rest], [p for _, p in rest])))
    return [done[twin_key(c, p)] if t is None or twin_key(c, p) in done else done[twin_key(c, t)]
            for c, p, t in zip(configs, policies, twins)]


def twin_key(config: SimConfig, policy: dict[str, Any]) -> str:
    """One simulation's identity: its base config and its policy overrides."""
    return repr(config) + json.dumps(policy, sort_keys=True, default=repr)
