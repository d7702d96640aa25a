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

bidikv's keys are the catalogue's connector settings (:mod:`impl.policy.catalogue`), each
``bidikv_<setting>``, with the catalogue's default and bounds; docs/reference/connector.md lists them.
Policies are chosen by the catalogue's names (``bidikv_retention``: ttl, lease, gap_quantile, ...).

Keys that belong to a policy that is not selected are rejected (a lease length under ``ttl`` is a
misconfiguration, not a no-op), and so is any unknown ``bidikv_*`` key (a typo), and a key that was
renamed (naming the new key).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from impl.policy import RecomputePolicy, RetentionPolicy, catalogue
from impl.policy.catalogue import CONNECTOR, RECOMPUTE, RETENTION, UNDER_PRESSURE, Registry, SettingError

DEFAULT_NUM_THREADS = 1  # vLLM's default is 4; see bidikv_nixl_progress_thread and the README
SETTINGS = catalogue.on(CONNECTOR)
KNOWN_BIDIKV_KEYS = frozenset(s.key() for s in SETTINGS if s.key().startswith(catalogue.CONNECTOR_PREFIX))


def _key(name: str) -> str:
    return catalogue.setting(name).key()


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


def _read(extra: Mapping[str, Any], setting: catalogue.Setting) -> Any:
    """The key's value (its catalogue default when absent), checked against the catalogue's bounds."""
    key = setting.key()
    if setting.kind is bool:
        return _bool(extra, key, setting.default)
    try:
        return setting.check(extra.get(key, setting.default), CONNECTOR)
    except ValueError as e:
        raise ConfigError(key, str(e)) from None


def _construct(registry: Registry, name: str, values: Mapping[str, Any], fallback: str,
               explicit: frozenset[str] = frozenset(), **context: Any) -> Any:
    """Build a catalogue policy, turning its rejection into a ConfigError on the key it is about: the first
    key the message mentions, preferring keys the user set over defaults."""
    try:
        return registry.build(name, values, _key, **context)
    except SettingError as e:
        keys = [_key(n) for n in e.names]
        chosen = next((k for k in keys if k in explicit), keys[0] if keys else fallback)
        raise ConfigError(chosen, str(e)) from None


def _d(name: str) -> Any:
    return catalogue.default(name)


@dataclass(frozen=True)
class ConnectorSettings:
    """Validated settings; ``recompute_policy`` and ``make_retention()`` are impl.policy objects.
    ``values``: every catalogue connector setting by name, as read (defaults filled in)."""

    bidirectional: bool = False  # vLLM's bidirectional_kv_xfer and its default
    kv_recompute_threshold: int = _d("kv_recompute_threshold")
    decoder_kv_blocks_ttl: float = _d("decoder_kv_blocks_ttl")
    num_threads: int = DEFAULT_NUM_THREADS
    num_threads_explicit: bool = False
    recompute: str = _d("recompute_policy")
    cost_profile: str | None = _d("cost_profile")
    apply_threshold_p_to_d: bool = _d("apply_threshold_p_to_d")
    retention: str = _d("retention")
    nixl_progress_thread: bool = _d("nixl_progress_thread")
    nixl_progress_delay_us: int = _d("nixl_progress_delay_us")
    idle_step_sleep_s: float = _d("idle_step_sleep_s")
    keep_cpu_affinity: bool = _d("keep_cpu_affinity")
    notify: bool = _d("notify")
    notify_timeout_s: float = _d("notify_timeout_s")
    heartbeat_port: int = _d("heartbeat_port")
    heartbeat_host: str = _d("heartbeat_host")
    require_verified_prefix: bool = _d("require_verified_prefix")
    retained_under_pressure: str = _d("retained_under_pressure")
    values: Mapping[str, Any] = field(default_factory=lambda: {s.name: s.default for s in SETTINGS}, compare=False)
    recompute_policy: RecomputePolicy = field(
        default_factory=lambda: RECOMPUTE.build("fixed", {}), compare=False)
    explicit_keys: frozenset[str] = frozenset()

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        prefix = catalogue.CONNECTOR_PREFIX
        for key in sorted(k for k in extra if isinstance(k, str) and k.startswith(prefix) and k not in KNOWN_BIDIKV_KEYS):
            why = catalogue.old_name_message(key[len(prefix):], CONNECTOR, lambda n: prefix + n)
            raise ConfigError(key, why or f"unknown key (known bidikv_* keys: {', '.join(sorted(KNOWN_BIDIKV_KEYS))})")

        bidirectional = _bool(extra, "bidirectional_kv_xfer", False)
        num_threads = _int(extra, "num_threads", DEFAULT_NUM_THREADS, 0)
        if "kv_lease_duration" in extra:
            _int(extra, "kv_lease_duration", 30, 1)
        backends = extra.get("backends", ["UCX"])
        if not isinstance(backends, (list, tuple)) or not backends or not all(isinstance(b, str) for b in backends):
            raise ConfigError("backends", f"must be a non-empty list of NIXL backend names, got {backends!r}")
        values = {s.name: _read(extra, s) for s in SETTINGS}
        explicit = frozenset(k for k in extra if isinstance(k, str))

        recompute, profile = values["recompute_policy"], values["cost_profile"]
        profile_key = _key("cost_profile")
        if recompute == "break_even":
            if not profile:
                raise ConfigError(profile_key, f"is required with {_key('recompute_policy')} 'break_even' "
                                  "(a profile name such as 'qwen3-32b@p5en-tp8' or a JSON path)")
            policy: RecomputePolicy = RECOMPUTE.build("break_even", values, cost_model=_load_cost_model(profile))
        else:
            if profile is not None:
                raise ConfigError(profile_key, f"is only used with {_key('recompute_policy')} 'break_even'")
            policy = _construct(RECOMPUTE, recompute, values, _key("kv_recompute_threshold"), explicit)
        _refuse_unselected(extra, values)

        settings = cls(
            bidirectional=bidirectional,
            kv_recompute_threshold=values["kv_recompute_threshold"],
            decoder_kv_blocks_ttl=values["decoder_kv_blocks_ttl"],
            num_threads=num_threads,
            num_threads_explicit="num_threads" in extra,
            recompute=recompute,
            cost_profile=profile,
            apply_threshold_p_to_d=values["apply_threshold_p_to_d"],
            retention=values["retention"],
            nixl_progress_thread=values["nixl_progress_thread"],
            nixl_progress_delay_us=values["nixl_progress_delay_us"],
            idle_step_sleep_s=values["idle_step_sleep_s"],
            keep_cpu_affinity=values["keep_cpu_affinity"],
            notify=values["notify"],
            notify_timeout_s=values["notify_timeout_s"],
            heartbeat_port=values["heartbeat_port"],
            heartbeat_host=_host(values["heartbeat_host"]),
            require_verified_prefix=values["require_verified_prefix"],
            retained_under_pressure=values["retained_under_pressure"],
            values=values,
            recompute_policy=policy,
            explicit_keys=explicit,
        )
        settings.make_retention()  # constructor-level checks (e.g. heartbeat interval < lease) fail now
        settings.make_give_back()
        return settings

    def make_retention(self) -> RetentionPolicy:
        """A fresh retention policy (GapQuantileTTL is stateful: one per scheduler)."""
        fallback = _key("retention") if self.retention != "ttl" else _key("decoder_kv_blocks_ttl")
        return _construct(RETENTION, self.retention, self.values, fallback, self.explicit_keys)

    def make_give_back(self) -> Any:
        """The give-back rules D runs (None: pinned, as vLLM), with P's 5 s expiry margin."""
        return _construct(UNDER_PRESSURE, self.retained_under_pressure, self.values, _key("retained_under_pressure"),
                          self.explicit_keys)

    def agent_config_overrides(self) -> dict[str, Any]:
        """Keyword arguments forced onto vLLM's ``nixl_agent_config(...)`` call."""
        overrides: dict[str, Any] = {"enable_prog_thread": self.nixl_progress_thread}
        if not self.num_threads_explicit:
            overrides["num_threads"] = self.num_threads
        return overrides


def _refuse_unselected(extra: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """A bidikv_ key only a policy that is not selected reads is a misconfiguration, not a no-op."""
    for registry in (RECOMPUTE, RETENTION, UNDER_PRESSURE):
        selected = values[registry.selector]
        read = set(registry.settings(selected)) if selected in registry.names() else set()
        for policy in registry:
            if policy.name == selected or CONNECTOR not in policy.surfaces:
                continue
            stray = sorted(_key(n) for n in registry.settings(policy.name)
                           if n not in read and CONNECTOR in catalogue.setting(n).surfaces
                           and _key(n).startswith(catalogue.CONNECTOR_PREFIX) and _key(n) in extra)
            if stray:
                selector = _key(registry.selector)
                raise ConfigError(stray[0], f"only applies with {selector} '{policy.name}', but {selector} is "
                                            f"'{selected}'")


def _host(value: str) -> str:
    key = _key("heartbeat_host")
    # an address to bind, not a URL: a scheme, path or blank would only fail later, inside the engine
    if not isinstance(value, str) or not value or len(value) > 253 or any(c in value for c in " /\t\n@?#"):
        raise ConfigError(key, f"must be a host name or IP address to listen on, got {value!r}")
    return value


def _load_cost_model(profile: str) -> Any:
    try:
        from calibration.profile import LatencyProfile
    except ImportError as e:  # pragma: no cover - calibration ships with the project
        raise ConfigError(_key("cost_profile"), f"the calibration package is not importable ({e})") from None
    try:
        return LatencyProfile.load(profile)
    except ValueError as e:
        raise ConfigError(_key("cost_profile"), str(e)) from None


__all__ = ["ConfigError", "ConnectorSettings", "DEFAULT_NUM_THREADS", "KNOWN_BIDIKV_KEYS", "SETTINGS"]
