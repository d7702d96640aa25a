"""The connector's settings, read once from ``kv_connector_extra_config`` and validated at construction.

Pure (stdlib + impl.policy, plus calibration only when a break-even profile is named), so it can be
imported and tested without vLLM. Every error names the offending key::

    ValueError: kv_connector_extra_config['bidikv_retention']: must be one of 'ttl', 'lease',
    'gap_quantile', got 'forever'

Keys and defaults
=================

vLLM's own keys keep their meaning (``bidirectional_kv_xfer``, ``kv_recompute_threshold``,
``decoder_kv_blocks_ttl``, ``num_threads``, ``kv_lease_duration``, ``backends``); they are only
type-checked here. One default differs: ``num_threads`` (UCX worker threads) defaults to **1**
instead of vLLM's 4, see ``bidikv_nixl_progress_thread`` and impl/connector/worker.py.

=================================  =========  ==========================================================
key                                default    meaning
=================================  =========  ==========================================================
bidikv_recompute_policy            "fixed"    ``fixed``: impl.policy.FixedThreshold(kv_recompute_threshold);
                                              ``break_even``: impl.policy.BreakEvenThreshold priced by
                                              the latency profile ``bidikv_cost_profile``
bidikv_cost_profile                (none)     profile name (calibration/profiles) or JSON path; only
                                              with ``break_even``, and then required
bidikv_apply_threshold_p_to_d      true       apply the same policy on the ordinary P->D read too
                                              (vLLM applies it only to D->P: vLLM #55801)
bidikv_retention                   "ttl"      D-side retention: ``ttl`` FixedTTL(decoder_kv_blocks_ttl),
                                              ``lease`` HeartbeatLease, ``gap_quantile`` GapQuantileTTL
bidikv_lease_s                     30         HeartbeatLease.lease_s              (``lease`` only)
bidikv_heartbeat_interval_s        10         HeartbeatLease.heartbeat_interval_s (``lease`` only)
bidikv_lease_max_hold_s            3600       HeartbeatLease.max_hold_s           (``lease`` only)
bidikv_gap_quantile                0.9        GapQuantileTTL.quantile      (``gap_quantile`` only)
bidikv_gap_cap_s                   900        GapQuantileTTL.cap_s         (``gap_quantile`` only)
bidikv_gap_floor_s                 10         GapQuantileTTL.floor_s       (``gap_quantile`` only)
bidikv_gap_initial_s               TTL        GapQuantileTTL.initial_s (default decoder_kv_blocks_ttl)
bidikv_gap_min_samples             20         GapQuantileTTL.min_samples   (``gap_quantile`` only)
bidikv_gap_window                  2048       GapQuantileTTL.window        (``gap_quantile`` only)
bidikv_gap_margin_s                5          GapQuantileTTL.margin_s      (``gap_quantile`` only)
bidikv_retained_under_pressure     "pinned"   D: ``pinned`` as vLLM (retained blocks held until read or expired, whatever
                                              the pool's state); ``give_back``: impl.policy.give_back (short
                                              published expiries the router renews before each turn; under
                                              pressure D stops renewing the entries impl.policy names and frees
                                              each at its last published expiry). Needs the heartbeat listener
bidikv_give_back_publish_window_s  15         GiveBack.publish_window_s: how far ahead D publishes (``give_back``)
bidikv_give_back_headroom          0.05       GiveBack.headroom_fraction: share of the pool kept free or coming
                                              free (``give_back``)
bidikv_nixl_progress_thread        true       NIXL agent progress thread (``nixl_agent_config
                                              (enable_prog_thread=...)``); it must run for a holder's
                                              blocks to be readable while its engine is idle
bidikv_nixl_progress_delay_us      1000       the progress thread's delay between rounds (NIXL's Python
                                              API hardcodes 0 = spin a core); 0 restores spinning
bidikv_keep_cpu_affinity           true       undo vLLM's re-pinning of the model thread (0.32 on CPU: the last
                                              core of each NUMA node, i.e. every P and D of a host on one core)
bidikv_idle_step_sleep_s           5.0        longest wait of an engine step that schedules nothing while
                                              blocks are only held for a peer; it ends within 5 ms of a new
                                              request (0: off, vLLM's 1 ms stepping); see scheduler.py
bidikv_notify                      true       post D's kv_transfer_params to the router when the
                                              request carries ``bidikv_notify`` (impl.router.notify)
bidikv_notify_timeout_s            1.0        timeout of one notification POST
bidikv_heartbeat_port              0          D: port of the heartbeat listener the router relays client
                                              heartbeats to (impl/connector/heartbeat.py), plus the
                                              engine's data-parallel index; 0: no listener (a lease
                                              then acts as a fixed TTL of ``bidikv_lease_s``)
bidikv_heartbeat_host              "0.0.0.0"  address that listener binds to
bidikv_require_verified_prefix     true       P: pull D's kept KV only for the prefix whose token ids are
                                              verified equal to the prompt's (impl.policy.prefix_check);
                                              with false, a D that publishes no checkpoints (not this
                                              connector) is trusted as vLLM does. A published check is
                                              always applied, on both read paths
=================================  =========  ==========================================================

Keys that belong to a retention policy that is not selected are rejected (a lease length under
``ttl`` is a misconfiguration, not a no-op), and so is any unknown ``bidikv_*`` key (a typo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from impl.policy import (
    BreakEvenThreshold,
    FixedThreshold,
    FixedTTL,
    GapQuantileTTL,
    GiveBack,
    HeartbeatLease,
    RecomputePolicy,
    RetentionPolicy,
)

RECOMPUTE_POLICIES = ("fixed", "break_even")
RETENTION_POLICIES = ("ttl", "lease", "gap_quantile")
VLLM_DEFAULT_THRESHOLD = 64  # vLLM's kv_recompute_threshold default
DEFAULT_NUM_THREADS = 1  # vLLM's default is 4; see bidikv_nixl_progress_thread and the README

def _field_default(cls: type, name: str) -> Any:
    """A dataclass field's default: the policies and ConnectorSettings are the one source of defaults."""
    return cls.__dataclass_fields__[name].default  # type: ignore[attr-defined]


# key -> (the policy's field, its default)
_LEASE_KEYS = {key: (name, _field_default(HeartbeatLease, name)) for key, name in (
    ("bidikv_lease_s", "lease_s"),
    ("bidikv_heartbeat_interval_s", "heartbeat_interval_s"),
    ("bidikv_lease_max_hold_s", "max_hold_s"),
)}
_GAP_KEYS = {key: (name, _field_default(GapQuantileTTL, name)) for key, name in (
    ("bidikv_gap_quantile", "quantile"),
    ("bidikv_gap_cap_s", "cap_s"),
    ("bidikv_gap_floor_s", "floor_s"),
    ("bidikv_gap_initial_s", "initial_s"),  # default here: decoder_kv_blocks_ttl, not the policy's
    ("bidikv_gap_min_samples", "min_samples"),
    ("bidikv_gap_window", "window"),
    ("bidikv_gap_margin_s", "margin_s"),
)}
_OTHER_KEYS = (
    "bidikv_recompute_policy",
    "bidikv_cost_profile",
    "bidikv_apply_threshold_p_to_d",
    "bidikv_retention",
    "bidikv_nixl_progress_thread",
    "bidikv_nixl_progress_delay_us",
    "bidikv_idle_step_sleep_s",
    "bidikv_keep_cpu_affinity",
    "bidikv_notify",
    "bidikv_notify_timeout_s",
    "bidikv_heartbeat_port",
    "bidikv_heartbeat_host",
    "bidikv_require_verified_prefix",
    "bidikv_retained_under_pressure",
)
_GIVE_BACK_KEYS = {key: (name, _field_default(GiveBack, name)) for key, name in (
    ("bidikv_give_back_publish_window_s", "publish_window_s"),
    ("bidikv_give_back_headroom", "headroom_fraction"),
)}
RETAINED_UNDER_PRESSURE = ("pinned", "give_back")
KNOWN_BIDIKV_KEYS = frozenset(_OTHER_KEYS) | frozenset(_LEASE_KEYS) | frozenset(_GAP_KEYS) | frozenset(_GIVE_BACK_KEYS)


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config`` value; the message starts with the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"kv_connector_extra_config[{key!r}]: {message}")
        self.key = key


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):  # from a CLI JSON typed by hand
        return value.lower() == "true"
    raise ConfigError(key, f"must be a boolean, got {value!r}")


def _int(extra: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _seconds(extra: Mapping[str, Any], key: str, default: float, *, positive: bool = False) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(key, f"must be a finite number of seconds {bound}, got {value!r}")
    return float(value)


def _choice(extra: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = extra.get(key, default)
    if value not in choices:
        raise ConfigError(key, f"must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def _construct(keys: Mapping[str, str], fallback: str, build: Callable[[], Any],
               explicit: frozenset[str] = frozenset()) -> Any:
    """Run a policy constructor, turning its ValueError into a ConfigError on the key it is about.

    That is the first key the message mentions, preferring keys the user set over defaults.
    """
    try:
        return build()
    except ValueError as e:
        message = str(e)
        mentioned = sorted((key not in explicit, message.find(name), key) for name, key in keys.items()
                           if name in message)
        raise ConfigError(mentioned[0][2] if mentioned else fallback, message) from None


@dataclass(frozen=True)
class ConnectorSettings:
    """Validated settings; ``recompute_policy`` and ``make_retention()`` are impl.policy objects."""

    bidirectional: bool = False
    kv_recompute_threshold: int = VLLM_DEFAULT_THRESHOLD
    decoder_kv_blocks_ttl: float = 480.0
    num_threads: int = DEFAULT_NUM_THREADS
    num_threads_explicit: bool = False
    recompute: str = "fixed"
    cost_profile: str | None = None
    apply_threshold_p_to_d: bool = True
    retention: str = "ttl"
    lease: dict[str, float] = field(default_factory=dict)
    gap: dict[str, float] = field(default_factory=dict)
    nixl_progress_thread: bool = True
    nixl_progress_delay_us: int = 1000
    idle_step_sleep_s: float = 5.0
    keep_cpu_affinity: bool = True
    notify: bool = True
    notify_timeout_s: float = 1.0
    heartbeat_port: int = 0
    heartbeat_host: str = "0.0.0.0"
    require_verified_prefix: bool = True
    retained_under_pressure: str = "pinned"
    give_back: dict[str, float] = field(default_factory=dict)
    recompute_policy: RecomputePolicy = field(default=FixedThreshold(VLLM_DEFAULT_THRESHOLD), compare=False)
    explicit_keys: frozenset[str] = frozenset()

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("bidikv_") and k not in KNOWN_BIDIKV_KEYS)
        if unknown:
            raise ConfigError(unknown[0], f"unknown key (known bidikv_* keys: {', '.join(sorted(KNOWN_BIDIKV_KEYS))})")

        bidirectional = _bool(extra, "bidirectional_kv_xfer", _default("bidirectional"))
        threshold = _int(extra, "kv_recompute_threshold", _default("kv_recompute_threshold"), 0)
        ttl = _seconds(extra, "decoder_kv_blocks_ttl", _default("decoder_kv_blocks_ttl"))
        num_threads = _int(extra, "num_threads", _default("num_threads"), 0)
        if "kv_lease_duration" in extra:
            _int(extra, "kv_lease_duration", 30, 1)
        backends = extra.get("backends", ["UCX"])
        if not isinstance(backends, (list, tuple)) or not backends or not all(isinstance(b, str) for b in backends):
            raise ConfigError("backends", f"must be a non-empty list of NIXL backend names, got {backends!r}")

        recompute = _choice(extra, "bidikv_recompute_policy", _default("recompute"), RECOMPUTE_POLICIES)
        profile = extra.get("bidikv_cost_profile")
        if recompute == "break_even":
            if not isinstance(profile, str) or not profile:
                raise ConfigError("bidikv_cost_profile", "is required with bidikv_recompute_policy 'break_even' "
                                  "(a profile name such as 'qwen3-32b@p5en-tp8' or a JSON path)")
            policy: RecomputePolicy = BreakEvenThreshold(_load_cost_model(profile))
        else:
            if profile is not None:
                raise ConfigError("bidikv_cost_profile", "is only used with bidikv_recompute_policy 'break_even'")
            policy = FixedThreshold(threshold)

        retention = _choice(extra, "bidikv_retention", _default("retention"), RETENTION_POLICIES)
        for family, keys in (("lease", _LEASE_KEYS), ("gap_quantile", _GAP_KEYS)):
            if retention != family:
                stray = sorted(k for k in keys if k in extra)
                if stray:
                    raise ConfigError(stray[0], f"only applies with bidikv_retention '{family}', "
                                                f"but bidikv_retention is '{retention}'")
        lease = {name: _seconds(extra, key, default, positive=True) for key, (name, default) in _LEASE_KEYS.items()}
        gap: dict[str, float] = {}
        for key, (name, default) in _GAP_KEYS.items():
            if name in ("min_samples", "window"):
                gap[name] = _int(extra, key, default, 1)
            elif name == "quantile":
                value = extra.get(key, default)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                    raise ConfigError(key, f"must be a number in (0, 1], got {value!r}")
                gap[name] = float(value)
            else:
                gap[name] = _seconds(extra, key, ttl if name == "initial_s" else default)

        under_pressure = _choice(extra, "bidikv_retained_under_pressure", _default("retained_under_pressure"),
                                 RETAINED_UNDER_PRESSURE)
        give_back: dict[str, float] = {}
        if under_pressure != "give_back":
            stray = sorted(k for k in _GIVE_BACK_KEYS if k in extra)
            if stray:
                raise ConfigError(stray[0], "only applies with bidikv_retained_under_pressure 'give_back', but it is "
                                            f"'{under_pressure}'")
        else:
            window_key, headroom_key = _GIVE_BACK_KEYS
            give_back["publish_window_s"] = _seconds(extra, window_key, _GIVE_BACK_KEYS[window_key][1], positive=True)
            headroom = extra.get(headroom_key, _GIVE_BACK_KEYS[headroom_key][1])
            if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
                raise ConfigError(headroom_key, f"must be a number in [0, 1), got {headroom!r}")
            give_back["headroom_fraction"] = float(headroom)

        settings = cls(
            bidirectional=bidirectional,
            kv_recompute_threshold=threshold,
            decoder_kv_blocks_ttl=ttl,
            num_threads=num_threads,
            num_threads_explicit="num_threads" in extra,
            recompute=recompute,
            cost_profile=profile if recompute == "break_even" else None,
            apply_threshold_p_to_d=_bool(extra, "bidikv_apply_threshold_p_to_d", _default("apply_threshold_p_to_d")),
            retention=retention,
            lease=lease if retention == "lease" else {},
            gap=gap if retention == "gap_quantile" else {},
            nixl_progress_thread=_bool(extra, "bidikv_nixl_progress_thread", _default("nixl_progress_thread")),
            nixl_progress_delay_us=_int(extra, "bidikv_nixl_progress_delay_us", _default("nixl_progress_delay_us"), 0),
            idle_step_sleep_s=_idle_sleep(extra),
            keep_cpu_affinity=_bool(extra, "bidikv_keep_cpu_affinity", _default("keep_cpu_affinity")),
            notify=_bool(extra, "bidikv_notify", _default("notify")),
            notify_timeout_s=_seconds(extra, "bidikv_notify_timeout_s", _default("notify_timeout_s"), positive=True),
            heartbeat_port=_port(extra, "bidikv_heartbeat_port"),
            heartbeat_host=_host(extra, "bidikv_heartbeat_host"),
            require_verified_prefix=_bool(extra, "bidikv_require_verified_prefix",
                                          _default("require_verified_prefix")),
            retained_under_pressure=under_pressure,
            give_back=give_back,
            recompute_policy=policy,
            explicit_keys=frozenset(k for k in extra if isinstance(k, str)),
        )
        settings.make_retention()  # constructor-level checks (e.g. heartbeat interval < lease) fail now
        settings.make_give_back()
        return settings

    def make_retention(self) -> RetentionPolicy:
        """A fresh retention policy (GapQuantileTTL is stateful: one per scheduler)."""
        if self.retention == "lease":
            names = {name: key for key, (name, _) in _LEASE_KEYS.items()}
            return _construct(names, "bidikv_retention", lambda: HeartbeatLease(**self.lease), self.explicit_keys)
        if self.retention == "gap_quantile":
            names = {name: key for key, (name, _) in _GAP_KEYS.items()}
            return _construct(names, "bidikv_retention", lambda: GapQuantileTTL(**self.gap), self.explicit_keys)
        return _construct({}, "decoder_kv_blocks_ttl", lambda: FixedTTL(self.decoder_kv_blocks_ttl))

    def make_give_back(self) -> GiveBack | None:
        """The give-back rules D runs (None: pinned, as vLLM), with P's 5 s expiry margin."""
        if self.retained_under_pressure != "give_back":
            return None
        names = {name: key for key, (name, _) in _GIVE_BACK_KEYS.items()}
        return _construct(names, "bidikv_retained_under_pressure", lambda: GiveBack(**self.give_back), self.explicit_keys)

    def agent_config_overrides(self) -> dict[str, Any]:
        """Keyword arguments forced onto vLLM's ``nixl_agent_config(...)`` call."""
        overrides: dict[str, Any] = {"enable_prog_thread": self.nixl_progress_thread}
        if not self.num_threads_explicit:
            overrides["num_threads"] = self.num_threads
        return overrides


def _default(name: str) -> Any:
    return _field_default(ConnectorSettings, name)


def _idle_sleep(extra: Mapping[str, Any]) -> float:
    value = _seconds(extra, "bidikv_idle_step_sleep_s", _default("idle_step_sleep_s"))
    if value > 30.0:
        raise ConfigError("bidikv_idle_step_sleep_s", f"must be at most 30 s (it delays releasing read blocks), "
                                                      f"got {value!r}")
    return value


def _port(extra: Mapping[str, Any], key: str) -> int:
    value = extra.get(key, _default("heartbeat_port"))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(key, f"must be an integer port in 0..65535 (0: off), got {value!r}")
    return value


def _host(extra: Mapping[str, Any], key: str) -> str:
    value = extra.get(key, _default("heartbeat_host"))
    # an address to bind, not a URL: a scheme, path or blank would only fail later, inside the engine
    if not isinstance(value, str) or not value or len(value) > 253 or any(c in value for c in " /\t\n@?#"):
        raise ConfigError(key, f"must be a host name or IP address to listen on, got {value!r}")
    return value


def _load_cost_model(profile: str) -> Any:
    try:
        from calibration.profile import LatencyProfile
    except ImportError as e:  # pragma: no cover - calibration ships with the project
        raise ConfigError("bidikv_cost_profile", f"the calibration package is not importable ({e})") from None
    try:
        return LatencyProfile.load(profile)
    except ValueError as e:
        raise ConfigError("bidikv_cost_profile", str(e)) from None


__all__ = ["ConfigError", "ConnectorSettings", "DEFAULT_NUM_THREADS", "KNOWN_BIDIKV_KEYS", "RECOMPUTE_POLICIES",
           "RETENTION_POLICIES"]
