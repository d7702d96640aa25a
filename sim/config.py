"""Simulation configuration: dataclasses with the one source of defaults, loaded from TOML and flags.

Each field's ``metadata["help"]`` is the CLI help text; :mod:`sim.cli` turns the fields into flags,
so nobody writes a default twice.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from typing import Any

from impl.policy.prefill_on_d import POLICIES as PREFILL_ON_D_POLICIES, PrefillOnD
from impl.policy.return_time import LearntRetention, LearntRetentionSettings
from impl.policy import (
    BreakEvenThreshold,
    FixedThreshold,
    FixedTTL,
    GapQuantileTTL,
    GiveBack,
    HeartbeatLease,
    KVAwareCost,
    LeastLoaded,
    RoundRobin,
)


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


MIN_NIC_BYTES_PER_S = 1e6
MIN_HEARTBEAT_INTERVAL_S = 0.1


@dataclass(slots=True)
class TopologyConfig:
    num_prefill: int = _f(1, "prefill instances (X in XpYd)")
    num_decode: int = _f(1, "decode instances (Y in XpYd)")
    nic_line_rate_bytes_per_s: float = _f(400e9, "per-node NIC line rate (p5en: 8 x 400 Gbps EFA = 400 GB/s)")
    nic_efficiency: float = _f(0.9, "fraction of line rate concurrent transfers can share")
    decode_kv_blocks: int = _f(0, "KV blocks per decode instance; 0 = from the profile's HBM budget")
    prefill_cache_blocks: int = _f(0, "prefix-cache blocks per prefill instance; 0 = same as a decode instance")
    max_num_batched_tokens: int = _f(8192, "prefill token budget per step (vLLM chunked prefill)")
    max_num_seqs: int = _f(256, "running sequences per decode instance")


@dataclass(slots=True)
class PolicyConfig:
    bidirectional: bool = _f(True, "bidirectional KV transfer (D keeps blocks, P pulls them next turn)")
    prefix_caching: bool = _f(False, "prefix caching on P (the published benchmark ran with it OFF)")
    decode_prefix_caching: bool = _f(True, "prefix caching on D (vLLM's default): finished blocks stay evictable")
    kv_recompute_threshold: int = _f(64, "tokens: pull iff reusable >= this (0 disables the check)")
    recompute_policy: str = _f("fixed", "pull-vs-recompute policy", choices=("fixed", "break_even"))
    apply_threshold_p_to_d: bool = _f(False, "also apply the threshold on the P->D path (vLLM #55801)")
    retention: str = _f("ttl", "decode-side retention policy (learnt: per turn, from the router's view of every "
                                "conversation's returns, impl.policy.return_time; oracle: clairvoyant bound, simulator only)",
                        choices=("ttl", "lease", "gap_quantile", "learnt", "oracle"))
    decoder_kv_blocks_ttl: float = _f(480.0, "seconds D keeps a finished turn's blocks (ttl policy; inf allowed)")
    lease_s: float = _f(30.0, "lease length in seconds (lease policy)")
    heartbeat_interval_s: float = _f(10.0, "client heartbeat interval in seconds (lease policy)")
    lease_max_hold_s: float = _f(3600.0, "cap on how long heartbeats can pin blocks (lease policy)")
    gap_quantile: float = _f(0.9, "quantile of observed inter-turn gaps used as TTL (gap_quantile policy)")
    gap_ttl_cap_s: float = _f(900.0, "upper bound on the learnt TTL (gap_quantile policy)")
    learnt_fallback_s: float = _f(480.0, "learnt retention: the hold a turn gets before its tenant has made enough "
                                         "returns to learn from (seconds; vLLM's default TTL)")
    learnt_budget_pct: float = _f(50.0, "learnt retention: decode KV it may keep retained on average, in percent of all "
                                        "decode KV blocks (the tuner's default budget); > 100 lets only the worth of a "
                                        "hold limit it")
    expiry_margin_s: float = _f(5.0, "P declines reads this close to expiry (vLLM: 5 s)")
    retained_under_pressure: str = _f(
        "pinned",
        "what D does with retained blocks when its pool runs short: pinned = vLLM (held until read or expired; new "
        "work waits, running sequences are preempted); give_back = bidikv's give-back mode (D publishes short "
        "expiries, renews one when the router asks before a turn, and under pressure stops renewing the ones "
        "impl.policy names: each is freed at its last published expiry, at once if no turn asked lately); "
        "instant_drop = frees them the moment they are needed (an upper bound: no D can do it safely, P's reads "
        "are one-sided)", choices=("pinned", "give_back", "instant_drop"))
    give_back_publish_window_s: float = _f(15.0, "give_back: how far ahead D publishes an expiry (the worst-case "
                                                 "time to give memory back; more than expiry_margin_s)")
    give_back_headroom: float = _f(0.05, "give_back: share of D's pool kept free or coming free (the watermark)")
    decline_frees_d: bool = _f(True, "a P that declines a pull (threshold, verification) frees D's blocks at once, "
                                     "as vLLM's P does (its scheduler sends D the notification of an empty read); "
                                     "off: D holds them to the TTL")
    placement: str = _f("round_robin", "instance placement", choices=("round_robin", "least_loaded", "kv_aware"))
    max_conversations: int = _f(1_000_000, "router conversation-store bound (LRU)")
    # prefill on D (impl.policy.prefill_on_d; rules of NVIDIA Dynamo's conditional disaggregation,
    # https://github.com/ai-dynamo/dynamo/pull/11357)
    prefill_on_d: str = _f(
        "off", "send a later turn to the D that holds its conversation, which computes the new suffix between its "
               "decode steps (no P leg, no KV transfer; D's other sequences wait for it): off; isl_bounding = when "
               "the suffix is short (below --prefill-on-d-suffix-tokens and --prefill-on-d-suffix-ratio of the "
               "prompt); prefill_load = when P's queue is at --prefill-on-d-p-busy-tokens or more; isl_or_load = "
               "either", choices=PREFILL_ON_D_POLICIES)
    prefill_on_d_suffix_tokens: int = _f(2048, "prefill on D (isl_bounding, isl_or_load): the suffix (prompt less what "
                                               "D holds) must be below this many tokens (Dynamo's eff_isl_threshold)")
    prefill_on_d_suffix_ratio: float = _f(0.7, "prefill on D (isl_bounding, isl_or_load): the suffix must also be below "
                                               "this share of the prompt (Dynamo's eff_isl_ratio_threshold)")
    prefill_on_d_p_busy_tokens: int = _f(16384, "prefill on D (prefill_load): P counts as busy with this many prefill "
                                                "tokens queued")
    prefill_on_d_d_pending_tokens: int = _f(8192, "prefill on D: most suffix tokens a D may have been sent and not yet "
                                                  "computed (a turn that would exceed it goes to P)")
    prefill_on_d_d_busy_fraction: float = _f(1.0, "prefill on D: no turn goes to a D whose KV use (running and "
                                                  "arriving blocks) is at this share of its pool (1: only a full D)")
    prefill_on_d_lapsed_s: float = _f(0.0, "prefill on D: how long after a conversation's entry expired (or D kept "
                                           "nothing) the router still counts on D's prefix cache holding it (seconds)")

    def recompute(self, cost_model: Any) -> Any:
        if self.recompute_policy == "break_even":
            return BreakEvenThreshold(cost_model)
        return FixedThreshold(self.kv_recompute_threshold)

    def retention_policy(self) -> Any:
        if self.retention == "lease":
            return HeartbeatLease(self.lease_s, self.heartbeat_interval_s, self.lease_max_hold_s)
        if self.retention == "gap_quantile":
            return GapQuantileTTL(quantile=self.gap_quantile, cap_s=self.gap_ttl_cap_s, initial_s=self.decoder_kv_blocks_ttl
                                  if math.isfinite(self.decoder_kv_blocks_ttl) else self.gap_ttl_cap_s)
        return FixedTTL(self.decoder_kv_blocks_ttl)

    def learnt_retention(self, decode_kv_blocks_total: int) -> LearntRetention:
        """The learnt retention for a fleet of that many decode KV blocks (its budget is a share of them).
        D's ``decoder_kv_blocks_ttl`` stays the longest any turn is kept, as on the real D."""
        return LearntRetention(LearntRetentionSettings(budget_size=self.learnt_budget_pct / 100.0 * decode_kv_blocks_total,
                                                       fallback_s=self.learnt_fallback_s, margin_s=self.expiry_margin_s))

    def give_back(self) -> GiveBack | None:
        if self.retained_under_pressure != "give_back":
            return None
        return GiveBack(self.give_back_publish_window_s, self.give_back_headroom, self.expiry_margin_s)

    def prefill_on_d_policy(self) -> PrefillOnD:
        return PrefillOnD(self.prefill_on_d, self.prefill_on_d_suffix_tokens, self.prefill_on_d_suffix_ratio,
                          self.prefill_on_d_p_busy_tokens, self.prefill_on_d_d_pending_tokens,
                          self.prefill_on_d_d_busy_fraction, self.prefill_on_d_lapsed_s)

    def placement_policy(self) -> Any:
        return {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "kv_aware": KVAwareCost}[self.placement]()


# How simulated clients renew a heartbeat lease (sim/clients.py). Only the lease retention reads
# heartbeats, so under a TTL or gap-quantile retention these fields change nothing.
RENEWAL_BEHAVIOURS = ("while_open", "tool_calls", "never", "until_next_turn")


@dataclass(slots=True)
class ClientConfig:
    client_renewal: str = _f(
        "while_open",
        "how clients renew a heartbeat lease: while_open = a chat UI or API session that renews for a linger time "
        "after every reply, whether or not the user returns; tool_calls = an agent that renews only while its tool "
        "call runs, not after answering the user; never = no heartbeats (the lease is a fixed TTL of --lease-s); "
        "until_next_turn = renews exactly until the next turn and stops after the last (knows the future: an upper "
        "bound, no real client does this)", choices=RENEWAL_BEHAVIOURS)
    # No public measurement of how long a chat page or API session stays open after a reply exists that we
    # know of: the default assumes users keep it open about as long as returning users take to come back,
    # i.e. Mooncake's parent->child gap (p50 126 s, p90 480 s, the public FAST'25 conversation trace, https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces, via sim/workload/mooncake.py).
    client_linger_p50_s: float = _f(126.0, "while_open: median seconds a client keeps renewing after a reply "
                                           "(ASSUMPTION: Mooncake's median return gap; no public measurement)")
    client_linger_p90_s: float = _f(480.0, "while_open: 90th percentile of that linger, lognormal between the two "
                                           "(ASSUMPTION: Mooncake's p90 return gap); equal to the median = constant")


@dataclass(slots=True)
class SimConfig:
    seed: int = _f(0, "seed; each subsystem derives its own stream from it")
    profile: str = _f("qwen3-32b@p5en-tp8", "latency profile: shipped name or JSON path")
    # An open loop one P carries (~6 % busy with bidirectional OFF), long enough for stable p90s: with every
    # conversation at 0 s (the generator's own default) the first turns queue behind each other on one P
    # and the TTFT table measures that queue, not reuse. `bidikv simulate` and `bidikv tune` both start here.
    workload: dict = _f({"kind": "synthetic", "num_conversations": 200, "arrival_rate_per_s": 0.05},
                        "workload spec (TOML table [workload]; see sim.workload)")
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    clients: ClientConfig = field(default_factory=ClientConfig)
    num_clients: int = _f(0, "concurrent clients, each running one conversation at a time in order "
                             "(vLLM's multi-turn benchmark: --num-clients); 0 = one client per conversation")
    max_sim_time_s: float = _f(math.inf, "stop the clock here (turns not finished are reported rejected)")
    series_interval_s: float = _f(10.0, "sampling interval of per-node series")

    def validate(self) -> "SimConfig":
        t, p = self.topology, self.policy
        checks = [
            (t.num_prefill >= 1, "topology.num_prefill", "must be >= 1"),
            (t.num_decode >= 1, "topology.num_decode", "must be >= 1"),
            (t.nic_line_rate_bytes_per_s > 0, "topology.nic_line_rate_bytes_per_s", "must be > 0"),
            (0 < t.nic_efficiency <= 1, "topology.nic_efficiency", "must be in (0, 1]"),
            (t.decode_kv_blocks >= 0, "topology.decode_kv_blocks", "must be >= 0"),
            (t.prefill_cache_blocks >= 0, "topology.prefill_cache_blocks", "must be >= 0"),
            (t.max_num_batched_tokens >= 1, "topology.max_num_batched_tokens", "must be >= 1"),
            (t.max_num_seqs >= 1, "topology.max_num_seqs", "must be >= 1"),
            (p.kv_recompute_threshold >= 0, "policy.kv_recompute_threshold", "must be >= 0"),
            (p.decoder_kv_blocks_ttl >= 0, "policy.decoder_kv_blocks_ttl", "must be >= 0 (inf allowed)"),
            (p.expiry_margin_s >= 0 and math.isfinite(p.expiry_margin_s), "policy.expiry_margin_s", "must be finite and >= 0"),
            (p.max_conversations >= 1, "policy.max_conversations", "must be >= 1"),
            (math.isfinite(t.nic_line_rate_bytes_per_s), "topology.nic_line_rate_bytes_per_s", "must be finite"),
            # Below these the run does not end in any useful time (the per-node sampler ticks through
            # hours of transfer, a client through millions of heartbeats); a typo, e.g. Gbit/s for bytes/s.
            (t.nic_line_rate_bytes_per_s * t.nic_efficiency >= MIN_NIC_BYTES_PER_S, "topology.nic_line_rate_bytes_per_s",
             f"times nic_efficiency must be >= {MIN_NIC_BYTES_PER_S:g} bytes/s (p5en: 4e11)"),
            (p.heartbeat_interval_s >= MIN_HEARTBEAT_INTERVAL_S, "policy.heartbeat_interval_s",
             f"must be >= {MIN_HEARTBEAT_INTERVAL_S:g} s"),
            (math.isfinite(self.series_interval_s), "series_interval_s", "must be finite"),
            (self.max_sim_time_s > 0, "max_sim_time_s", "must be > 0"),
            (self.num_clients >= 0, "num_clients", "must be >= 0"),
            (p.learnt_budget_pct > 0 and not math.isnan(p.learnt_budget_pct), "policy.learnt_budget_pct", "must be > 0"),
            (p.learnt_fallback_s >= 0 and math.isfinite(p.learnt_fallback_s), "policy.learnt_fallback_s",
             "must be a finite number of seconds >= 0"),
            (self.series_interval_s > 0, "series_interval_s", "must be > 0"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"config field {name} {why}")
        for name, value in (("policy.recompute_policy", p.recompute_policy), ("policy.retention", p.retention),
                            ("policy.retained_under_pressure", p.retained_under_pressure),
                            ("policy.placement", p.placement), ("policy.prefill_on_d", p.prefill_on_d),
                            ("clients.client_renewal", self.clients.client_renewal)):
            section, key = name.split(".")
            choices = _field(type(getattr(self, section)), key).metadata["choices"]
            if value not in choices:
                raise ValueError(f"config field {name} must be one of {choices}, got {value!r}")
        # Every retention's fields are checked whichever is selected: a flag that is ignored today
        # (--lease-s -1 under ttl) would be a silent surprise the day the retention changes.
        for retention in ("ttl", "lease", "gap_quantile"):
            try:
                dataclasses.replace(p, retention=retention).retention_policy()
            except ValueError as exc:
                raise ValueError(f"config field policy ({retention} retention): {_policy_field_names(str(exc))}") from None
        try:  # checked whichever mode is selected, as the retentions are
            GiveBack(p.give_back_publish_window_s, p.give_back_headroom, p.expiry_margin_s)
        except ValueError as exc:
            raise ValueError(f"config field policy (give_back): {_give_back_field_names(str(exc))}") from None
        try:
            p.prefill_on_d_policy()
        except ValueError as exc:
            raise ValueError(f"config field policy.prefill_on_d_{exc}") from None
        from sim.clients import linger_distribution

        linger_distribution(self.clients)  # names the field it rejects
        return self


# impl.policy names its constructor arguments; a user knows the config's names for them
_POLICY_ARG_FIELDS = {"max_hold_s": "lease_max_hold_s", "quantile": "gap_quantile", "cap_s": "gap_ttl_cap_s",
                      "publish_window_s": "give_back_publish_window_s", "headroom_fraction": "give_back_headroom"}


def _policy_field_names(message: str) -> str:
    head, sep, rest = message.partition(" ")
    return f"{_POLICY_ARG_FIELDS.get(head, head)}{sep}{rest}"


def _give_back_field_names(message: str) -> str:
    """GiveBack's message names its arguments anywhere in the text (the window rule names two)."""
    for arg in ("publish_window_s", "headroom_fraction"):
        message = message.replace(arg, _POLICY_ARG_FIELDS[arg])
    return message


def _field(cls: type, name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def _apply(obj: Any, data: dict, where: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        if key not in fields:
            raise ValueError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(fields))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: {key} must be a table")
            _apply(current, value, f"{where}.{key}")
            continue
        setattr(obj, key, _coerce(value, type(current), f"{where}.{key}"))


def _coerce(value: Any, kind: type, where: str) -> Any:
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if kind in (int, float):
        if isinstance(value, str) and value.lower() in ("inf", "infinity"):
            value = math.inf
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        if math.isnan(value):
            raise ValueError(f"{where} must not be NaN")
        if kind is int:
            if value != int(value) if math.isfinite(value) else True:
                raise ValueError(f"{where} must be an integer, got {value!r}")
            return int(value)
        return float(value)
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {value!r}")
    if kind is dict and not isinstance(value, dict):
        raise ValueError(f"{where} must be a table, got {value!r}")
    return value


def load_config(path: str | None = None, overrides: dict | None = None) -> SimConfig:
    """Defaults, then the TOML file, then ``overrides`` (a nested dict, e.g. from CLI flags)."""
    config = SimConfig()
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ValueError(f"config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config {path}: invalid TOML: {exc}") from None
        _apply(config, data, path)
    if overrides:
        _apply(config, overrides, "flags")
    return config.validate()


def config_to_dict(config: SimConfig) -> dict:
    return dataclasses.asdict(config)
