"""``bidikv validate``: replay a recorded bench run through the simulator and compare turn by turn.

Given the JSONL of a ``bidikv bench`` run against a deployment (and the deployment's settings,
:mod:`calibration.bench_settings`) and a profile (fitted with :mod:`calibration.from_bench` on the same
or, for a held-out check, on *other* runs), the same conversations are replayed through the
simulator's :class:`sim.engine.cluster.Cluster`: the same prompt and output lengths, each conversation from
its recorded start, each later turn after the think time the client really slept
(:func:`conversations_from_bench`), one P and one D, the deployment's threshold, TTL and expiry margin, the fitted
host contention (:mod:`sim.engine.contention`). Then per turn:

* the reuse decision (:func:`classify`, one rule applied to what the real and the simulated router and
  P reported): ``pulled``, ``recomputed`` (offered below the threshold), ``declined`` (offered enough,
  pulled nothing: the blocks went within the expiry margin before P read them, or P's token check
  failed), ``expired`` (the router had nothing unexpired to offer), ``none`` (first turn, or
  bidirectional OFF), ``on_d`` (prefill on D: the router sent the turn whole to the D holding it; the
  record's ``path``, the simulator's decision) -- expected to agree exactly;
* pulled tokens (P's ``prefill_cached_tokens``; P runs without prefix caching) -- exact;
* TTFT and TPOT relative error, summarised as median and p90 of |error| by prompt bucket and turn index.

The real decision is read from what the router and P reported: tokens offered
(``reuse_offered_tokens``) and tokens P did not compute (``prefill_cached_tokens``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from calibration.bench_settings import DeploymentSettings
from calibration.profile import LatencyProfile
from calibration.bench_records import BenchRecord
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.engine.contention import HostContention, attach
from sim.engine.prefill_on_d import PREFILL_ON_D
from sim.engine.records import TurnRecord, percentile
from sim.workload.model import Conversation, Turn

@dataclass(frozen=True, slots=True)
class TurnComparison:
    conversation: str
    turn: int
    prompt_tokens: int
    real_decision: str
    sim_decision: str
    real_pulled: int
    sim_pulled: int
    real_ttft_s: float
    sim_ttft_s: float
    real_tpot_s: float  # BenchRecord.tpot_s: NaN when every token came in the first read
    sim_tpot_s: float


    def ttft_error(self) -> float:
        return (self.sim_ttft_s - self.real_ttft_s) / self.real_ttft_s

    def tpot_error(self) -> float:
        return (self.sim_tpot_s - self.real_tpot_s) / self.real_tpot_s if self.real_tpot_s > 0 else math.nan


TIMINGS = ("think", "absolute", "pool")


def conversations_from_bench(records: Sequence[BenchRecord], timing: str = "think") -> list[Conversation]:
    """The bench run's conversations; a conversation stops at its first failed turn, as the bench client
    did (it had no answer to continue from). Each conversation starts at its recorded start; then

    * ``think`` (default): each later turn follows the simulated completion of the one before by the
      think time the client really slept (recorded start - previous start - previous total). This is
      what the bench client does, and what decides expiry: D's TTL runs from *its* finish, so a
      replay at absolute times would expire a turn whenever the simulator finished the previous one
      earlier than the real, loaded machine did. First turns keep their recorded starts, so the
      simulated timeline drifts from the real one by at most one conversation's error, never by the
      whole run's: which turns collide on P stays what it was;
    * ``absolute``: each turn at its recorded start (or when the simulated previous one finishes, if later);
    * ``pool``: as ``think``, but every conversation starts when a client of the pool is free (the bench
      client's rule, :func:`bench_clients`): the run's drift accumulates across conversations, so two turns
      that followed each other on P can collide in the replay (measured on a pinned quiet rig: a pulled
      turn of 222 ms queued behind another's 800-token prefill and replayed at 1,100 ms).
    """
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    by_conv: dict[str, list[BenchRecord]] = {}
    for r in records:
        by_conv.setdefault(r.conversation, []).append(r)
    out = []
    for cid, rs in by_conv.items():
        rs.sort(key=lambda r: r.turn)
        turns = []
        previous = None
        for r in rs:
            if not r.ok:
                break
            # the bench appends the server's own ids to the history: a faithful continuation (agreement None)
            if timing == "absolute":
                turns.append(Turn(prompt_tokens=r.prompt_tokens, output_tokens=max(r.output_tokens, 1), arrival_s=r.start_s))
            else:
                think = 0.0 if previous is None else max(0.0, r.start_s - previous.start_s - previous.total_s)
                turns.append(Turn(prompt_tokens=r.prompt_tokens, output_tokens=max(r.output_tokens, 1), gap_before_s=think))
            previous = r
        if turns:
            out.append(Conversation(cid, start_s=rs[0].start_s, turns=tuple(turns)))
    out.sort(key=lambda c: c.start_s)
    return out


def sim_config(settings: DeploymentSettings, profile: LatencyProfile, bidirectional: bool) -> Any:
    config = SimConfig(profile=profile.name, seed=0)
    config.policy.bidirectional = bidirectional
    config.policy.prefix_caching = settings.prefix_caching_on_p
    config.policy.kv_recompute_threshold = settings.kv_recompute_threshold
    config.policy.decoder_kv_blocks_ttl = settings.decoder_kv_blocks_ttl
    config.policy.expiry_margin_s = settings.expiry_margin_s
    config.policy.prefill_on_d = settings.prefill_on_d
    config.policy.prefill_on_d_suffix_tokens = settings.prefill_on_d_suffix_tokens
    config.policy.prefill_on_d_suffix_ratio = settings.prefill_on_d_suffix_ratio
    config.topology.decode_kv_blocks = settings.decode_kv_blocks
    config.topology.max_num_seqs = settings.max_num_seqs
    # the wire is the profile's fitted rate (a loopback here): the NIC must not be the tighter bound
    config.topology.nic_line_rate_bytes_per_s = max(profile.transfer_bytes_per_s, 1e6)
    config.topology.nic_efficiency = 1.0
    return config.validate()


def bench_clients(records: Sequence[BenchRecord]) -> int:
    """How many clients the bench ran: the most conversations in progress at once (first start to last end)."""
    spans: dict[str, list[float]] = {}
    for r in records:
        end = r.start_s + (r.total_s if math.isfinite(r.total_s) else 0.0)
        lo_hi = spans.setdefault(r.conversation, [r.start_s, end])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], r.start_s), max(lo_hi[1], end)
    events = sorted([(lo, 1) for lo, _ in spans.values()] + [(hi, -1) for _, hi in spans.values()])
    live = most = 0
    for _, step in events:  # an end sorts before a start at the same instant: back to back is one client
        live += step
        most = max(most, live)
    return max(most, 1)


def replay(records: Sequence[BenchRecord], profile: LatencyProfile, settings: DeploymentSettings,
           contention: HostContention = HostContention(), timing: str = "think") -> Sequence[TurnRecord]:
    """The simulator's records of the same conversations (see :func:`conversations_from_bench`).

    With ``pool`` timing the conversations run on a pool of as many clients as the bench had
    (:func:`bench_clients`), each taking the next conversation when its last one ends, in the recorded
    order; otherwise each conversation starts at its recorded start."""
    modes = {r.mode for r in records}
    if len(modes) != 1:
        raise ValueError(f"a replay is one deployment: the records mix modes {sorted(modes)}")
    config = sim_config(settings, profile, modes == {"on"})
    conversations = conversations_from_bench(records, timing)
    if timing == "pool":
        config.num_clients = bench_clients(records)
        conversations = [dataclasses.replace(c, start_s=0.0) for c in conversations]
    cluster = Cluster(config, profile)
    attach(cluster, contention)
    return cluster.run(conversations).records


ON_D = "on_d"  # a turn served on D whole (prefill on D): no P, nothing pulled


def classify(bidirectional: bool, turn: int, offered: int, pulled: int, threshold: int) -> str:
    """One rule for both sides, on what the router and P report (so real and simulated mean the same):
    ``none`` (OFF, or a first turn), ``expired`` (the router offered nothing: no unexpired entry),
    ``pulled``, ``recomputed`` (offered below the threshold), ``declined`` (offered enough, pulled
    nothing: D's blocks went within the expiry margin before P read them, or P's token check failed)."""
    if not bidirectional or turn == 0:
        return "none"
    if offered == 0:
        return "expired"
    if pulled:
        return "pulled"
    return "recomputed" if offered < threshold else "declined"


def real_decision(r: BenchRecord, settings: DeploymentSettings) -> str:
    if r.path == PREFILL_ON_D:  # the router sent it whole to D (X-Bidikv-Path)
        return ON_D
    return classify(r.mode == "on", r.turn, r.reuse_offered_tokens, r.prefill_cached_tokens or 0,
                    settings.kv_recompute_threshold)


def sim_decision(rec: TurnRecord, settings: DeploymentSettings, bidirectional: bool) -> str:
    if rec.decision == PREFILL_ON_D:
        return ON_D
    offered = rec.offered_tokens if rec.store_hit else 0
    pulled = rec.pulled_tokens if rec.decision == "pull" else 0
    return classify(bidirectional, rec.turn, offered, pulled, settings.kv_recompute_threshold)


def compare(records: Sequence[BenchRecord], simulated: Sequence[TurnRecord],
            settings: DeploymentSettings) -> list[TurnComparison]:
    sims = {(s.conversation, s.turn): s for s in simulated}
    out = []
    for r in records:
        s = sims.get((r.conversation, r.turn))
        if not r.ok or s is None or s.rejected:
            continue
        sim_pulled = s.pulled_tokens if s.decision == "pull" else 0
        out.append(TurnComparison(
            r.conversation, r.turn, r.prompt_tokens, real_decision(r, settings), sim_decision(s, settings, r.mode == "on"),
            (r.prefill_cached_tokens or 0), sim_pulled, r.ttft_s, s.ttft_s,
            r.tpot_s, s.tpot_s))
    return out


def _summary(errors: Sequence[float]) -> dict[str, Any]:
    v = sorted(abs(e) for e in errors if not math.isnan(e))
    signed = [e for e in errors if not math.isnan(e)]
    return {"n": len(v), "median_abs_pct": 100 * percentile(v, 50), "p90_abs_pct": 100 * percentile(v, 90),
            "median_signed_pct": 100 * statistics.median(signed) if signed else math.nan}


def bucket(prompt_tokens: int, width: int) -> str:
    lo = prompt_tokens // width * width
    return f"{lo}-{lo + width}"


def summarize(comparisons: Sequence[TurnComparison], bucket_tokens: int = 512) -> dict[str, Any]:
    """Decision agreement and error summaries, overall, by prompt bucket and by turn index."""
    def errors(cs: Sequence[TurnComparison]) -> dict[str, Any]:
        return {"ttft": _summary([c.ttft_error() for c in cs]), "tpot": _summary([c.tpot_error() for c in cs])}

    by_bucket: dict[str, list[TurnComparison]] = {}
    by_turn: dict[int, list[TurnComparison]] = {}
    for c in comparisons:
        by_bucket.setdefault(bucket(c.prompt_tokens, bucket_tokens), []).append(c)
        by_turn.setdefault(c.turn, []).append(c)
    decisions: dict[str, dict[str, int]] = {}
    for c in comparisons:
        row = decisions.setdefault(c.real_decision, {})
        row[c.sim_decision] = row.get(c.sim_decision, 0) + 1
    return {
        "turns": len(comparisons),
        "decisions_agree": sum(c.real_decision == c.sim_decision for c in comparisons),
        "pulled_tokens_agree": sum(c.real_pulled == c.sim_pulled for c in comparisons),
        "decision_matrix": decisions,  # real -> simulated -> turns
        "pulled_tokens": {"real": sum(c.real_pulled for c in comparisons), "sim": sum(c.sim_pulled for c in comparisons)},
        "overall": errors(comparisons),
        "by_prompt_bucket": {k: errors(v) for k, v in sorted(by_bucket.items(), key=lambda kv: int(kv[0].split("-")[0]))},
        "by_turn": {str(k): errors(v) for k, v in sorted(by_turn.items())},
        "mean_ttft_ms": {"real": 1e3 * statistics.fmean(c.real_ttft_s for c in comparisons) if comparisons else math.nan,
                         "sim": 1e3 * statistics.fmean(c.sim_ttft_s for c in comparisons) if comparisons else math.nan},
    }


def contention_of(profile: LatencyProfile) -> HostContention:
    """The host contention a bench fit recorded in the profile's provenance (none for other profiles)."""
    hc = profile.provenance.get("host_contention") or {}
    return HostContention(float(hc.get("window_s", 0.0)), float(hc.get("factor", 0.0)))


def validate_run(records: Sequence[BenchRecord], profile: LatencyProfile, settings: DeploymentSettings,
                 bucket_tokens: int = 512, timing: str = "think") -> tuple[dict[str, Any], list[TurnComparison]]:
    settings = dataclasses.replace(settings, bidirectional=all(r.mode == "on" for r in records))
    comparisons = compare(records, replay(records, profile, settings, contention_of(profile), timing), settings)
    return summarize(comparisons, bucket_tokens), comparisons


def format_summary(name: str, s: dict[str, Any]) -> str:
    """A table: decisions, then TTFT/TPOT |error| overall, by prompt bucket and by turn index."""
    lines = [f"{name}: {s['turns']} turns; decisions agree {s['decisions_agree']}/{s['turns']}, pulled tokens agree "
             f"{s['pulled_tokens_agree']}/{s['turns']} (real {s['pulled_tokens']['real']}, sim {s['pulled_tokens']['sim']})"]
    for real, row in s["decision_matrix"].items():
        lines.append(f"  real {real:11} -> sim " + ", ".join(f"{k} {v}" for k, v in sorted(row.items())))
    lines.append(f"  {'':14}{'n':>4}  {'TTFT |err| p50':>15}{'p90':>8}{'signed p50':>11}  {'TPOT |err| p50':>15}{'p90':>8}{'signed p50':>11}")

    def row(label: str, e: dict[str, Any]) -> str:
        t, d = e["ttft"], e["tpot"]
        return (f"  {label:14}{t['n']:>4}  {t['median_abs_pct']:>14.1f}%{t['p90_abs_pct']:>7.1f}%{t['median_signed_pct']:>+10.1f}%"
                f"  {d['median_abs_pct']:>14.1f}%{d['p90_abs_pct']:>7.1f}%{d['median_signed_pct']:>+10.1f}%")

    lines.append(row("all", s["overall"]))
    for k, e in s["by_prompt_bucket"].items():
        lines.append(row(f"prompt {k}", e))
    for k, e in s["by_turn"].items():
        lines.append(row(f"turn {k}", e))
    return "\n".join(lines)
