"""Simulation configuration: dataclasses with the one source of defaults, loaded from TOML and flags.

Each field's ``metadata["help"]`` is the CLI help text; :mod:`sim.commands.simulate` turns the fields into flags,
so nobody writes a default twice.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from typing import Any

from impl.policy import GiveBack, catalogue
from impl.policy.catalogue import PLACEMENT, RECOMPUTE, RETENTION, PREFILL_ON_D, UNDER_PRESSURE, SettingError, sim_field
from impl.policy.prefill_on_d import PrefillOnD
from impl.policy.return_time import LearntRetention, LearntRetentionSettings


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


MIN_NIC_BYTES_PER_S = 1e6


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
    """The policies and their settings: each field is an impl.policy.catalogue entry (name, default,
    help, bounds), chosen by name through the catalogue's registries."""

    bidirectional: bool = sim_field("bidirectional")
    prefix_caching: bool = sim_field("prefix_caching")
    decode_prefix_caching: bool = sim_field("decode_prefix_caching")
    kv_recompute_threshold: int = sim_field("kv_recompute_threshold")
    recompute_policy: str = sim_field("recompute_policy")
    retention: str = sim_field("retention")
    decoder_kv_blocks_ttl: float = sim_field("decoder_kv_blocks_ttl")
    lease_s: float = sim_field("lease_s")
    heartbeat_interval_s: float = sim_field("heartbeat_interval_s")
    lease_max_hold_s: float = sim_field("lease_max_hold_s")
    gap_quantile: float = sim_field("gap_quantile")
    gap_cap_s: float = sim_field("gap_cap_s")
    learnt_retention_fallback_s: float = sim_field("learnt_retention_fallback_s")
    learnt_retention_min_returns: int = sim_field("learnt_retention_min_returns")
    learnt_retention_budget_pct: float = sim_field("learnt_retention_budget_pct")
    expiry_margin_s: float = sim_field("expiry_margin_s")
    retained_under_pressure: str = sim_field("retained_under_pressure")
    give_back_publish_window_s: float = sim_field("give_back_publish_window_s")
    give_back_headroom: float = sim_field("give_back_headroom")
    decline_frees_d: bool = sim_field("decline_frees_d")
    placement: str = sim_field("placement")
    host_tier: bool = sim_field("host_tier")
    cpu_bytes_to_use: float = sim_field("cpu_bytes_to_use")
    eviction_policy: str = sim_field("eviction_policy")
    offload_prompt_only: bool = sim_field("offload_prompt_only")
    min_cached_token_delta: int = sim_field("min_cached_token_delta")
    host_pull_fit: str = sim_field("host_pull_fit")
    # not a catalogue setting yet: the router's max_conversations bounds a deployment's memory (100,000), this
    # one only a simulation's (effectively unbounded)
    max_conversations: int = _f(1_000_000, "router conversation-store bound (LRU)")
    # prefill on D (impl.policy.prefill_on_d; rules of NVIDIA Dynamo's conditional disaggregation,
    # https://github.com/ai-dynamo/dynamo/pull/11357)
    prefill_on_d: str = sim_field("prefill_on_d")
    prefill_on_d_suffix_tokens: int = sim_field("prefill_on_d_suffix_tokens")
    prefill_on_d_suffix_ratio: float = sim_field("prefill_on_d_suffix_ratio")
    prefill_on_d_p_busy_tokens: int = sim_field("prefill_on_d_p_busy_tokens")
    prefill_on_d_d_pending_tokens: int = sim_field("prefill_on_d_d_pending_tokens")
    prefill_on_d_d_busy_fraction: float = sim_field("prefill_on_d_d_busy_fraction")
    prefill_on_d_lapsed_s: float = sim_field("prefill_on_d_lapsed_s")

    def values(self) -> dict[str, Any]:
        """Setting name -> value, for the catalogue's registries."""
        return {name: getattr(self, name) for name in SIM_SETTINGS}

    def recompute(self, cost_model: Any) -> Any:
        return RECOMPUTE.build(self.recompute_policy, self.values(), cost_model=cost_model)

    def retention_policy(self) -> Any:
        """D's retention: the selected one, or (learnt, oracle: chosen per turn elsewhere) the TTL, D's longest hold."""
        name = self.retention if RETENTION[self.retention].make is not None else "ttl"
        return RETENTION.build(name, self.values())

    def learnt_retention(self, decode_kv_blocks_total: int) -> LearntRetention:
        """The learnt retention for a fleet of that many decode KV blocks (its budget is a share of them).
        D's ``decoder_kv_blocks_ttl`` stays the longest any turn is kept, as on the real D."""
        return LearntRetention(LearntRetentionSettings(
            budget_size=self.learnt_retention_budget_pct / 100.0 * decode_kv_blocks_total,
            fallback_s=self.learnt_retention_fallback_s, min_returns=self.learnt_retention_min_returns,
            margin_s=self.expiry_margin_s))

    def give_back(self) -> GiveBack | None:
        return UNDER_PRESSURE.build(self.retained_under_pressure, self.values())

    def prefill_on_d_policy(self) -> PrefillOnD:
        return PREFILL_ON_D.build(self.prefill_on_d, self.values())

    def placement_policy(self) -> Any:
        return PLACEMENT.build(self.placement, self.values())


SIM_SETTINGS = tuple(s.name for s in catalogue.on(catalogue.SIM))


# How simulated clients renew a heartbeat lease (sim/clients/renewal.py). Only the lease retention reads
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
            (p.max_conversations >= 1, "policy.max_conversations", "must be >= 1"),
            (math.isfinite(t.nic_line_rate_bytes_per_s), "topology.nic_line_rate_bytes_per_s", "must be finite"),
            # Below these the run does not end in any useful time (the per-node sampler ticks through
            # hours of transfer, a client through millions of heartbeats); a typo, e.g. Gbit/s for bytes/s.
            (t.nic_line_rate_bytes_per_s * t.nic_efficiency >= MIN_NIC_BYTES_PER_S, "topology.nic_line_rate_bytes_per_s",
             f"times nic_efficiency must be >= {MIN_NIC_BYTES_PER_S:g} bytes/s (p5en: 4e11)"),
            (math.isfinite(self.series_interval_s), "series_interval_s", "must be finite"),
            (self.max_sim_time_s > 0, "max_sim_time_s", "must be > 0"),
            (self.num_clients >= 0, "num_clients", "must be >= 0"),
            (self.series_interval_s > 0, "series_interval_s", "must be > 0"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"config field {name} {why}")
        for name in SIM_SETTINGS:  # kind and bounds, from the catalogue
            try:
                catalogue.setting(name).check(getattr(p, name), catalogue.SIM)
            except ValueError as exc:
                raise ValueError(f"config field policy.{name} {exc}") from None
        renewal = self.clients.client_renewal
        if renewal not in RENEWAL_BEHAVIOURS:
            raise ValueError(f"config field clients.client_renewal must be one of {RENEWAL_BEHAVIOURS}, got {renewal!r}")
        # Every policy's settings are checked whichever is selected: a flag that is ignored today
        # (--lease-s -1 under ttl) would be a silent surprise the day the retention changes.
        values = p.values()
        for registry in (RETENTION, UNDER_PRESSURE):
            for policy in registry:
                if policy.make is None or catalogue.SIM not in policy.surfaces:
                    continue
                try:
                    registry.build(policy.name, values)
                except SettingError as exc:
                    what = f"{policy.name} retention" if registry is RETENTION else policy.name
                    raise ValueError(f"config field policy ({what}): {exc}") from None
        try:
            p.prefill_on_d_policy()
        except SettingError as exc:
            raise ValueError(f"config field policy (prefill on D): {exc}") from None
        from sim.clients.renewal import linger_distribution

        linger_distribution(self.clients)  # names the field it rejects
        return self


def _apply(obj: Any, data: dict, where: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        if key not in fields and (why := catalogue.old_name_message(key, catalogue.SIM)) is not None:
            raise ValueError(f"{where}: {why}")
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
