"""The catalogue: every policy and every setting of bidikv, one entry each, and the registries that
choose a policy by name.

Each :class:`Setting` is born here once -- its one name, type, unit, default, bounds, help, and the
surfaces that carry it -- and every surface is built from or checked against it:

* the simulator's ``PolicyConfig`` fields and ``bidikv simulate`` flags (``--name-with-dashes``),
* the connector's ``kv_connector_extra_config`` keys (``bidikv_<name>``; vLLM's own key where vLLM
  has one: ``kv_recompute_threshold``, ``decoder_kv_blocks_ttl``),
* the router's ``RouterConfig`` fields and ``bidikv router`` flags,
* the tuner's paste-ready recommendation (``sim/tune/report.py``), the deploy recipe's keys
  (``impl/deploy``) and ``docs/reference/settings.md`` (``tools/gen_reference.py``).

``tests/test_catalogue.py`` fails when a surface lacks a setting, carries one the catalogue does not
know, or names one differently (``tests/policy/test_catalogue.py`` tests the catalogue itself). A name
that changed stays in :data:`RENAMED` (and one a surface dropped in :data:`REMOVED`), so the old flag,
TOML key or connector key is refused with a message naming what to use instead.

A policy family (how P decides to pull, how long D retains, what D does under pressure, how the router
places a turn) is a :class:`Registry` of :class:`Policy` entries, chosen by the family's selector
setting (``retention = "lease"``). Nothing else spells out the list of a family's names.

How to add a setting
--------------------
1. One ``Setting(...)`` in :data:`SETTINGS` (``_s(name, kind, default, help, *surfaces, **bounds)``):
   name (snake_case; a time ends in ``_s``), kind, default (a policy constructor's argument:
   ``_arg(Class, "argument")``, so the number is written once, in the policy), help, the surfaces
   (SIM, CONNECTOR, ROUTER), then unit and bounds (``minimum``, ``maximum``, ``exclusive_*``,
   ``infinite_on``).
2. A policy constructor's argument: add ``(setting, argument)`` to its :class:`Policy`'s ``args``; the
   registry then builds the policy with it on every surface and names it in the policy's errors.
3. On each surface you named, take the default and help from here: the simulator's field
   ``name: float = sim_field("name")`` in ``PolicyConfig`` (sim/engine/config.py; flag, TOML key and bounds
   follow), the router's field ``name: float = _d("name")`` in ``RouterConfig`` (impl/router/config.py;
   flag, help and bounds follow); the connector reads and checks every CONNECTOR setting by itself
   (impl/connector/config.py): use ``settings.values["name"]``.
4. ``python tools/gen_reference.py`` (docs/reference) and ``pytest tests/test_catalogue.py
   tests/policy/test_catalogue.py``. Renaming a setting: keep the old name in :data:`RENAMED`.

How to add a policy
-------------------
Its module in impl/policy (the class), one :class:`Policy` entry in its family's registry below
(name, help, the class, the ``(setting, argument)`` pairs it reads, the surfaces that run it), and
catalogue entries for any new settings. Surfaces take the names from the registry and build through
``Registry.build(name, values)``. A new family: a :class:`Registry`, its selector setting
(``family=...``), and an entry in :data:`REGISTRIES`.

Pure data and small helpers: standard library only, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from impl.policy.give_back import GiveBack
from impl.policy.host_tier import HostPullMinimum
from impl.policy.placement import KVAwareCost, LeastLoaded, RoundRobin
from impl.policy.prefill_on_d import PrefillOnD
from impl.policy.recompute import BreakEvenThreshold, FixedThreshold
from impl.policy.retention import FixedTTL, GapQuantileTTL, HeartbeatLease
from impl.policy.return_time import LearntRetentionSettings

SIM = "sim"  # sim.engine.config.PolicyConfig and `bidikv simulate` / `bidikv tune` flags
CONNECTOR = "connector"  # kv_connector_extra_config (impl.connector.config)
ROUTER = "router"  # impl.router.config.RouterConfig and `bidikv router` flags
SURFACES = (SIM, CONNECTOR, ROUTER)
CONNECTOR_PREFIX = "bidikv_"


def _arg(cls: type, name: str) -> Any:
    """A policy dataclass's default for ``name``: the number is written once, in the policy."""
    return {f.name: f for f in dataclasses.fields(cls)}[name].default


@dataclass(frozen=True)
class Setting:
    """One setting: the same name, default and bounds on every surface that carries it."""

    name: str
    kind: type  # bool, int, float or str
    default: Any
    help: str
    surfaces: frozenset[str]
    unit: str = ""  # "s", "tokens", "%", "fraction", "us", "" for none
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False  # minimum < value rather than minimum <= value
    exclusive_maximum: bool = False
    infinite_on: frozenset[str] = frozenset()  # surfaces where inf is accepted (a float setting)
    family: str | None = None  # a selector: the registry whose policy names are its values
    connector_key: str | None = None  # vLLM's own key when vLLM has one; else bidikv_<name>
    optional: bool = False  # None is a value (e.g. "not set: derived", see ``help``)

    def key(self) -> str:
        """The connector's ``kv_connector_extra_config`` key."""
        return self.connector_key or CONNECTOR_PREFIX + self.name

    def flag(self) -> str:
        """The command-line flag (simulator and router)."""
        return "--" + self.name.replace("_", "-")

    def bounds(self, surface: str | None = None) -> str:
        """The accepted values in words (``""`` when any value of the kind is)."""
        if self.kind is bool:
            return "true or false"
        if self.family is not None:
            return "one of " + ", ".join(REGISTRIES[self.family].names(surface))
        lo, hi = self.minimum, self.maximum
        if lo is not None and hi is not None:  # an interval: finite by itself
            return (f"in {'(' if self.exclusive_minimum else '['}{lo:g}, {hi:g}"
                    f"{')' if self.exclusive_maximum else ']'}")
        parts = []
        if lo is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {lo:g}")
        if hi is not None:
            parts.append(f"{'<' if self.exclusive_maximum else '<='} {hi:g}")
        text = " and ".join(parts)
        if self.kind is float:
            if surface is None and self.infinite_on and self.infinite_on != self.surfaces:
                where = ", ".join(x for x in SURFACES if x in self.infinite_on)
                text += f", inf allowed ({where})" if text else f"inf allowed ({where})"
            elif surface in self.infinite_on if surface is not None else bool(self.infinite_on):
                text += ", inf allowed" if text else "inf allowed"
            else:
                text = f"finite and {text}" if text else "finite"
        return text

    def check(self, value: Any, surface: str) -> Any:
        """``value`` as this setting's kind, or ValueError saying why not (without the name: the caller
        prefixes the name its surface knows)."""
        if value is None and self.optional:
            return None
        kind = self.kind
        if kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"must be true or false, got {value!r}")
            return value
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(f"must be a string, got {value!r}")
            if self.family is not None:
                names = REGISTRIES[self.family].names(surface)
                if value not in names:
                    raise ValueError(f"must be one of {', '.join(repr(n) for n in names)}, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number ({self.bounds(surface)}), got {value!r}")
        # a connector key arrives as JSON, where 80.0 is a float typed for an integer (a port, a count): refused;
        # the simulator's TOML and flags take a whole float
        if kind is int and (not (math.isfinite(value) and value == int(value))
                            or (surface == CONNECTOR and not isinstance(value, int))):
            raise ValueError(f"must be an integer ({self.bounds(surface)}), got {value!r}")
        if math.isnan(value) or (math.isinf(value) and surface not in self.infinite_on) or not self._in_bounds(value):
            raise ValueError(f"must be {self.bounds(surface)}, got {value!r}")
        return int(value) if kind is int else float(value)

    def _in_bounds(self, value: float) -> bool:
        lo, hi = self.minimum, self.maximum
        if lo is not None and (value <= lo if self.exclusive_minimum else value < lo):
            return False
        if hi is not None and (value >= hi if self.exclusive_maximum else value > hi):
            return False
        return True


def _s(name: str, kind: type, default: Any, help: str, *surfaces: str, **kw: Any) -> Setting:
    return Setting(name, kind, default, help, frozenset(surfaces), **kw)


SETTINGS: tuple[Setting, ...] = (
    _s("bidirectional", bool, True, "bidirectional KV transfer (D keeps blocks, P pulls them next turn); the "
       "simulator's mode under study (on by default). On a vLLM server it is vLLM's own key "
       "bidirectional_kv_xfer (off by default), which the deploy recipe's --mode on|off sets", SIM),
    # -- pull or recompute (impl.policy.recompute) ---------------------------------------------------
    _s("recompute_policy", str, "fixed", "pull-vs-recompute policy: fixed = pull iff the reusable tokens reach "
       "kv_recompute_threshold; break_even = pull iff the pull is predicted faster than recomputing",
       SIM, CONNECTOR, family="recompute"),
    _s("kv_recompute_threshold", int, _arg(FixedThreshold, "tokens"),
       "tokens: pull iff reusable >= this (0 disables the check; vLLM's key and default)", SIM, CONNECTOR,
       unit="tokens", minimum=0, connector_key="kv_recompute_threshold"),
    _s("cost_profile", str, None, "break_even's latency profile (a name in calibration/profiles or a JSON path); "
       "required with break_even, refused otherwise (the simulator prices with its own --profile)", CONNECTOR,
       optional=True),
    _s("apply_threshold_p_to_d", bool, True, "apply the pull-vs-recompute policy on the ordinary P->D read too "
       "(vLLM applies it only to D->P: vLLM #55801); the simulator always pulls P's KV to D", CONNECTOR),
    _s("require_verified_prefix", bool, True, "P: pull D's kept KV only for the prefix whose token ids are verified "
       "equal to the prompt's (impl.policy.prefix_check); false: a D that publishes no checkpoints is trusted as "
       "vLLM does. A published check is always applied", CONNECTOR),
    # -- retention on D (impl.policy.retention, impl.policy.return_time) ------------------------------
    _s("retention", str, "ttl", "decode-side retention policy", SIM, CONNECTOR, family="retention"),
    _s("decoder_kv_blocks_ttl", float, _arg(FixedTTL, "seconds"), "seconds D keeps a finished turn's blocks "
       "(ttl retention; vLLM's key and default; the router's upper bound on an entry's life; the simulator "
       "accepts inf)", SIM, CONNECTOR, ROUTER, unit="s", minimum=0, infinite_on=frozenset({SIM}),
       connector_key="decoder_kv_blocks_ttl"),
    _s("lease_s", float, _arg(HeartbeatLease, "lease_s"), "lease length in seconds (lease retention)",
       SIM, CONNECTOR, unit="s", minimum=0, exclusive_minimum=True),
    _s("heartbeat_interval_s", float, _arg(HeartbeatLease, "heartbeat_interval_s"),
       "client heartbeat interval in seconds, shorter than lease_s (lease retention)", SIM, CONNECTOR, unit="s",
       minimum=0.1),
    _s("lease_max_hold_s", float, _arg(HeartbeatLease, "max_hold_s"),
       "cap on how long heartbeats can pin blocks after the turn (lease retention)", SIM, CONNECTOR, unit="s",
       minimum=0, exclusive_minimum=True, infinite_on=frozenset({SIM})),
    _s("gap_quantile", float, _arg(GapQuantileTTL, "quantile"),
       "quantile of observed inter-turn gaps used as TTL (gap_quantile retention)", SIM, CONNECTOR,
       unit="fraction", minimum=0, exclusive_minimum=True, maximum=1),
    _s("gap_cap_s", float, _arg(GapQuantileTTL, "cap_s"), "upper bound on the learnt TTL (gap_quantile retention)",
       SIM, CONNECTOR, unit="s", minimum=0, infinite_on=frozenset({SIM})),
    _s("gap_floor_s", float, _arg(GapQuantileTTL, "floor_s"), "lower bound on the learnt TTL (gap_quantile "
       "retention)", CONNECTOR, unit="s", minimum=0),
    _s("gap_initial_s", float, None, "the TTL until gap_min_samples gaps are seen (gap_quantile retention; unset: "
       "decoder_kv_blocks_ttl, or gap_cap_s when that is inf)", CONNECTOR, unit="s", minimum=0, optional=True),
    _s("gap_min_samples", int, _arg(GapQuantileTTL, "min_samples"), "gaps seen before the quantile replaces "
       "gap_initial_s (gap_quantile retention)", CONNECTOR, minimum=1),
    _s("gap_window", int, _arg(GapQuantileTTL, "window"), "most recent gaps the quantile is taken over "
       "(gap_quantile retention)", CONNECTOR, minimum=1),
    _s("gap_margin_s", float, _arg(GapQuantileTTL, "margin_s"), "kept beyond the quantile gap, as P declines reads "
       "this close to expiry (gap_quantile retention)", CONNECTOR, unit="s", minimum=0),
    _s("learnt_retention_fallback_s", float, _arg(LearntRetentionSettings, "fallback_s"),
       "learnt retention: the hold a turn gets before its tenant has made learnt_retention_min_returns returns "
       "(seconds; vLLM's default TTL; capped, as every hold, by D's decoder_kv_blocks_ttl)", SIM, ROUTER, unit="s",
       minimum=0),
    _s("learnt_retention_min_returns", int, _arg(LearntRetentionSettings, "min_returns"),
       "learnt retention: returns a tenant's conversations must have made before its turns get learnt holds",
       SIM, ROUTER, minimum=1),
    _s("learnt_retention_budget_pct", float, 50.0, "learnt retention: decode KV it may keep retained on average, "
       "in percent of all decode KV blocks (the tuner's default budget); > 100 lets only the worth of a hold "
       "limit it", SIM, unit="%", minimum=0, exclusive_minimum=True, infinite_on=frozenset({SIM})),
    _s("learnt_retention_budget_tokens", float, 0.0, "learn each turn's retention on D from the returns the router "
       "sees (impl/policy/return_time.py) and ask D for it with the turn; the value is the KV tokens, summed over "
       "all decode instances, it may keep retained on average (inf: only a hold's worth limits it). 0: off, D's "
       "decoder_kv_blocks_ttl for every turn. D's TTL stays the longest any turn is kept", ROUTER, unit="tokens",
       minimum=0, infinite_on=frozenset({ROUTER})),
    _s("expiry_margin_s", float, _arg(GiveBack, "expiry_margin_s"),
       "P declines reads this close to expiry (vLLM: 5 s); the router does not offer blocks this close to it",
       SIM, ROUTER, unit="s", minimum=0),
    # -- D under memory pressure (impl.policy.give_back) -----------------------------------------------
    _s("retained_under_pressure", str, "pinned", "what D does with retained blocks when its pool runs short",
       SIM, CONNECTOR, family="under_pressure"),
    _s("give_back_publish_window_s", float, _arg(GiveBack, "publish_window_s"),
       "give_back: how far ahead D publishes an expiry (the worst-case time to give memory back; more than "
       "expiry_margin_s)", SIM, CONNECTOR, unit="s", minimum=0, exclusive_minimum=True),
    _s("give_back_headroom", float, _arg(GiveBack, "headroom_fraction"),
       "give_back: share of D's pool kept free or coming free (the watermark)", SIM, CONNECTOR, unit="fraction",
       minimum=0, maximum=1, exclusive_maximum=True),
    _s("decline_frees_d", bool, True, "a P that declines a pull (threshold, verification) frees D's blocks at once, "
       "as vLLM's P does (its scheduler sends D the notification of an empty read); off: D holds them to the TTL",
       SIM),
    # -- caching (vLLM's --enable-prefix-caching on P and D) -------------------------------------------
    _s("prefix_caching", bool, False, "prefix caching on P (the published benchmark ran with it OFF)", SIM),
    _s("decode_prefix_caching", bool, True, "prefix caching on D (vLLM's default): finished blocks stay evictable",
       SIM),
    # -- placement (impl.policy.placement) ----------------------------------------------------------------
    _s("placement", str, "round_robin", "how P and D instances are chosen for a turn", SIM, ROUTER,
       family="placement"),
    # -- prefill on D (impl.policy.prefill_on_d: NVIDIA Dynamo's conditional disaggregation rules,
    #    https://github.com/ai-dynamo/dynamo/pull/11357) --------------------------------------------------
    _s("prefill_on_d", str, _arg(PrefillOnD, "policy"), "send a later turn to the D that holds its conversation, "
       "which computes the new suffix between its decode steps (no P leg, no KV transfer; D's other sequences wait "
       "for it; the router sends a turn whose D fails before answering through P)", SIM, ROUTER, family="prefill_on_d"),
    _s("prefill_on_d_suffix_tokens", int, _arg(PrefillOnD, "suffix_tokens"), "prefill on D (isl_bounding, "
       "isl_or_load): the suffix (prompt less what D holds) must be below this many tokens (Dynamo's "
       "eff_isl_threshold; the router bounds the suffix from the new messages' bytes)", SIM, ROUTER, unit="tokens",
       minimum=1),
    _s("prefill_on_d_suffix_ratio", float, _arg(PrefillOnD, "suffix_ratio"), "prefill on D (isl_bounding, "
       "isl_or_load): the suffix must also be below this share of the prompt (Dynamo's eff_isl_ratio_threshold)",
       SIM, ROUTER, unit="fraction", minimum=0, exclusive_minimum=True, maximum=1),
    _s("prefill_on_d_p_busy_tokens", int, _arg(PrefillOnD, "p_busy_tokens"), "prefill on D (prefill_load): P counts "
       "as busy with this many prefill tokens queued (the router: estimated prompt tokens in flight on the "
       "least-loaded P)", SIM, ROUTER, unit="tokens", minimum=0),
    _s("prefill_on_d_d_pending_tokens", int, _arg(PrefillOnD, "d_pending_tokens"), "prefill on D: most suffix tokens "
       "a D may have been sent and not yet computed (the router: not yet answered with a first token); a turn that "
       "would exceed it goes to P", SIM, ROUTER, unit="tokens",
       minimum=1),
    _s("prefill_on_d_d_busy_fraction", float, _arg(PrefillOnD, "d_busy_fraction"), "prefill on D: no turn goes to a "
       "D whose KV use (running and arriving blocks) is at this share of its pool (1: only a full D)", SIM,
       unit="fraction", minimum=0, exclusive_minimum=True, maximum=1),
    _s("prefill_on_d_lapsed_s", float, _arg(PrefillOnD, "lapsed_s"), "prefill on D: how long after a conversation's "
       "entry expired (or D kept nothing) the router still counts on D's prefix cache holding it (the real router: "
       "after D gave it back, timed from when the router stored the entry, which is never less)", SIM, ROUTER,
       unit="s", minimum=0),
    # -- the connector's machinery -------------------------------------------------------------------------
    # the host tier (impl.policy.host_tier; the simulator's model of vLLM's OffloadingConnector: sim.engine.host_tier).
    # vLLM's own keys (cpu_bytes_to_use, eviction_policy, offload_prompt_only) keep vLLM's names.
    _s("host_tier", bool, False, "host tier: D offloads each finished turn's KV to host DRAM (vLLM's "
       "OffloadingConnector) and P pulls it from there (its P2P tier) when D's HBM no longer holds the turn", SIM),
    _s("cpu_bytes_to_use", float, 0.0, "host tier bytes per decode instance (vLLM's cpu_bytes_to_use); 0 = half the "
       "host DRAM of the profile's instance (hardware preset)", SIM, unit="bytes", minimum=0),
    _s("eviction_policy", str, "lru", "host tier eviction (vLLM's eviction_policy)", SIM, family="host_eviction"),
    _s("offload_prompt_only", bool, True, "host tier: offload prompt blocks only (vLLM's default); false: D's "
       "answers too", SIM),
    _s("min_cached_token_delta", int, _arg(HostPullMinimum, "min_cached_token_delta"), "host tier: pull only when "
       "it holds at least this many tokens beyond P's local hit (llm-d's minCachedTokenDelta); break_even adds the "
       "cost test", SIM, ROUTER, unit="tokens", minimum=0),
    _s("host_tier_capacity_tokens", int, 0, "KV tokens each decode instance's host tier holds (its cpu_bytes_to_use "
       "over the model's KV bytes per token; bidikv deploy prints it): when D no longer holds a turn in HBM, the router "
       "asks P to pull it from D's host tier (remote_kv_source, impl.router.host_tier). 0: off", ROUTER,
       unit="tokens", minimum=0),
    _s("host_tier_p2p_port", int, 5710, "port of the decode instances' P2P tier (their OffloadingConnector's "
       "secondary_tiers[0].port; vLLM's VLLM_P2P_SIDE_CHANNEL_PORT default)", ROUTER, minimum=1, maximum=65535),
    _s("host_pull_fit", str, "gpt-oss-120b-tp1", "host tier: the published testbed whose pull costs the simulator "
       "charges (calibration.host_tier)", SIM, family="host_pull_fit"),
    _s("nixl_progress_thread", bool, True, "NIXL agent progress thread (nixl_agent_config(enable_prog_thread=...)); "
       "it must run for a holder's blocks to be readable while its engine is idle", CONNECTOR),
    _s("nixl_progress_delay_us", int, 1000, "the progress thread's delay between rounds (NIXL's Python API "
       "hardcodes 0 = spin a core); 0 restores spinning", CONNECTOR, unit="us", minimum=0),
    _s("keep_cpu_affinity", bool, True, "undo vLLM's re-pinning of the model thread (0.32 on CPU: the last core of "
       "each NUMA node, i.e. every P and D of a host on one core)", CONNECTOR),
    _s("idle_step_sleep_s", float, 5.0, "longest wait of an engine step that schedules nothing while blocks are only "
       "held for a peer; it ends within 5 ms of a new request (0: off, vLLM's 1 ms stepping; at most 30: it delays "
       "releasing read blocks)", CONNECTOR, unit="s", minimum=0, maximum=30),
    _s("notify", bool, True, "D posts its kv_transfer_params to the router (vLLM 0.32 path): the router asks for "
       "it with each request (impl.router.notify), the connector answers when asked", CONNECTOR, ROUTER),
    _s("notify_timeout_s", float, 1.0, "timeout of one notification POST", CONNECTOR, unit="s", minimum=0,
       exclusive_minimum=True),
    _s("heartbeat_port", int, 0, "D: port of the heartbeat listener the router relays client heartbeats to "
       "(impl/connector/heartbeat.py), plus the engine's data-parallel index; 0: no listener (a lease then acts "
       "as a fixed TTL of lease_s)", CONNECTOR, minimum=0, maximum=65535),
    _s("heartbeat_host", str, "0.0.0.0", "address that listener binds to", CONNECTOR),
)

_BY_NAME = {s.name: s for s in SETTINGS}
assert len(_BY_NAME) == len(SETTINGS), "one entry per setting"

# Names a surface used before: refused with the name to use instead.
RENAMED: dict[str, str] = {
    "gap_ttl_cap_s": "gap_cap_s",  # the simulator's name; the connector's was bidikv_gap_cap_s
    "learnt_fallback_s": "learnt_retention_fallback_s",  # the simulator's; the router's was this one
    "learnt_budget_pct": "learnt_retention_budget_pct",  # the simulator's, now in the learnt_retention_ family
    "decoder_kv_blocks_ttl_s": "decoder_kv_blocks_ttl",  # the router's; vLLM's key has no _s
}
# (surface, name) a surface no longer carries, and why.
REMOVED: dict[tuple[str, str], str] = {
    (SIM, "apply_threshold_p_to_d"): "the simulator always pulls P's KV to D (nothing read this setting); the "
                                     "connector's bidikv_apply_threshold_p_to_d applies the policy on that read",
}


def setting(name: str) -> Setting:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no setting {name!r} in impl.policy.catalogue") from None


def default(name: str) -> Any:
    return _BY_NAME[name].default


def on(surface: str) -> tuple[Setting, ...]:
    """The settings a surface carries, in catalogue order."""
    return tuple(s for s in SETTINGS if surface in s.surfaces)


def sim_field(name: str) -> Any:
    """A dataclass field for the simulator's config: the catalogue's default, help and choices."""
    s = _BY_NAME[name]
    if SIM not in s.surfaces:
        raise KeyError(f"setting {name!r} is not on the simulator's surface")
    meta: dict[str, Any] = {"help": s.help}
    if s.family is not None:
        meta["choices"] = REGISTRIES[s.family].names(SIM)
        meta["help"] = selector_help(name, SIM)
    return field(default=s.default, metadata=meta)


def old_name_message(name: str, surface: str, spell: Callable[[str], str] = str) -> str | None:
    """Why ``name`` is refused on ``surface`` if it was renamed or removed (``spell`` writes a name as the
    surface does: a flag, a key), else None."""
    new = RENAMED.get(name)
    if new is not None and surface in _BY_NAME[new].surfaces:
        return f"{spell(name)} is now {spell(new)}"
    why = REMOVED.get((surface, name))
    if why is not None:
        return f"{spell(name)} was removed: {why}"
    return None


class SettingError(ValueError):
    """A policy rejected its settings; ``names`` are the settings the message mentions, in order."""

    def __init__(self, message: str, names: tuple[str, ...]) -> None:
        super().__init__(message)
        self.names = names


@dataclass(frozen=True)
class Policy:
    """One policy of a family: its name, what it does, the impl.policy class that runs it and the
    settings it reads, ``(setting, constructor argument)``; ``make`` None: nothing to build (the
    family's do-nothing member) or the surface builds it itself (the simulator's learnt retention)."""

    name: str
    help: str
    make: Callable[..., Any] | None = None
    args: tuple[tuple[str, str], ...] = ()
    surfaces: frozenset[str] = frozenset(SURFACES)
    context: tuple[str, ...] = ()  # constructor arguments that are not settings (break_even's cost model)
    longest_hold: str | None = None  # retention: the setting no hold of it exceeds (the router's bound on an entry)


class Registry:
    """The policies of one family, chosen by name through its selector setting."""

    def __init__(self, family: str, selector: str, policies: Iterable[Policy]) -> None:
        self.family, self.selector = family, selector
        self._policies: dict[str, Policy] = {}
        for p in policies:
            self.register(p)

    def register(self, policy: Policy) -> None:
        if policy.name in self._policies:
            raise ValueError(f"{self.family}: policy {policy.name!r} is already registered")
        self._policies[policy.name] = policy

    def names(self, surface: str | None = None) -> tuple[str, ...]:
        return tuple(n for n, p in self._policies.items() if surface is None or surface in p.surfaces)

    def __getitem__(self, name: str) -> Policy:
        try:
            return self._policies[name]
        except KeyError:
            raise ValueError(f"{self.selector} must be one of {', '.join(self.names())}, got {name!r}") from None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._policies.values())

    def settings(self, name: str) -> tuple[str, ...]:
        """The settings policy ``name`` reads."""
        return tuple(setting_name for setting_name, _ in self[name].args)

    def build(self, name: str, values: Mapping[str, Any], spell: Callable[[str], str] = str, **context: Any) -> Any:
        """Policy ``name`` built from ``values`` (setting name -> value; a missing one takes its default),
        plus ``context`` (arguments that are not settings, e.g. break_even's cost model). A rejection is a
        :class:`SettingError` whose message names the settings as ``spell`` writes them."""
        policy = self[name]
        if policy.make is None:
            return None
        full = {s: values[s] if s in values else default(s) for s, _ in policy.args}
        for s in full:
            derive = _DERIVED.get(s)
            if full[s] is None and derive is not None:
                full[s] = derive({**{k: default(k) for k in _DERIVE_READS}, **values, **full})
        try:
            return policy.make(**{arg: full[s] for s, arg in policy.args},
                               **{name: context[name] for name in policy.context})
        except ValueError as e:
            raise _named(str(e), policy.args, spell) from None


def _named(message: str, args: tuple[tuple[str, str], ...], spell: Callable[[str], str]) -> SettingError:
    """A policy's message with its argument names replaced by the settings' (one pass: a spelled name
    that contains another argument's name is not replaced again)."""
    by_arg = {arg: s for s, arg in args}
    if not by_arg:
        return SettingError(message, ())
    pattern = re.compile(r"\b(" + "|".join(re.escape(a) for a in sorted(by_arg, key=len, reverse=True)) + r")\b")
    names = tuple(dict.fromkeys(by_arg[m.group(1)] for m in pattern.finditer(message)))
    return SettingError(pattern.sub(lambda m: spell(by_arg[m.group(1)]), message), names)


def _gap_initial(values: Mapping[str, Any]) -> float:
    ttl = values["decoder_kv_blocks_ttl"]
    return ttl if math.isfinite(ttl) else values["gap_cap_s"]


# settings whose None means "derived from others"
_DERIVED: dict[str, Callable[[Mapping[str, Any]], Any]] = {"gap_initial_s": _gap_initial}
_DERIVE_READS = ("decoder_kv_blocks_ttl", "gap_cap_s")

RECOMPUTE = Registry("recompute", "recompute_policy", (
    Policy("fixed", "pull iff the reusable tokens reach kv_recompute_threshold (vLLM's rule)", FixedThreshold,
           (("kv_recompute_threshold", "tokens"),)),
    Policy("break_even", "pull iff the pull is predicted faster than recomputing the same tokens, priced by a "
           "latency profile", BreakEvenThreshold, (), frozenset({SIM, CONNECTOR}), ("cost_model",)),
))
RETENTION = Registry("retention", "retention", (
    Policy("ttl", "vLLM's decoder_kv_blocks_ttl: finish + TTL, never renewed", FixedTTL,
           (("decoder_kv_blocks_ttl", "seconds"),), frozenset({SIM, CONNECTOR}), longest_hold="decoder_kv_blocks_ttl"),
    Policy("lease", "a lease the client renews with heartbeats through the router", HeartbeatLease,
           (("lease_s", "lease_s"), ("heartbeat_interval_s", "heartbeat_interval_s"),
            ("lease_max_hold_s", "max_hold_s")), frozenset({SIM, CONNECTOR}), longest_hold="lease_max_hold_s"),
    Policy("gap_quantile", "a TTL learnt as a quantile of observed inter-turn gaps", GapQuantileTTL,
           (("gap_quantile", "quantile"), ("gap_cap_s", "cap_s"), ("gap_floor_s", "floor_s"),
            ("gap_initial_s", "initial_s"), ("gap_min_samples", "min_samples"), ("gap_window", "window"),
            ("gap_margin_s", "margin_s")), frozenset({SIM, CONNECTOR}), longest_hold="gap_cap_s"),
    Policy("learnt", "per turn, from the router's view of every conversation's returns (impl.policy.return_time); "
           "deployed as a ttl on D and the router's learnt_retention_budget_tokens", None,
           (("learnt_retention_fallback_s", "fallback_s"), ("learnt_retention_min_returns", "min_returns"),
            ("expiry_margin_s", "margin_s")), frozenset({SIM})),
    Policy("oracle", "clairvoyant bound: keeps exactly what the next turn will read (simulator only)", None, (),
           frozenset({SIM})),
))
UNDER_PRESSURE = Registry("under_pressure", "retained_under_pressure", (
    Policy("pinned", "vLLM: held until read or expired; new work waits, running sequences are preempted", None, (),
           frozenset({SIM, CONNECTOR})),
    Policy("give_back", "bidikv's give-back mode: D publishes short expiries, renews one when the router asks "
           "before a turn, and under pressure stops renewing the ones impl.policy names: each is freed at its last "
           "published expiry, at once if no turn asked lately", GiveBack,
           (("give_back_publish_window_s", "publish_window_s"), ("give_back_headroom", "headroom_fraction"),
            ("expiry_margin_s", "expiry_margin_s")), frozenset({SIM, CONNECTOR})),
    Policy("instant_drop", "frees them the moment they are needed (an upper bound: no D can do it safely, P's reads "
           "are one-sided; simulator only)", None, (), frozenset({SIM})),
))
PLACEMENT = Registry("placement", "placement", (
    Policy("round_robin", "each role's instances in turn", RoundRobin, (), frozenset({SIM, ROUTER})),
    Policy("least_loaded", "the instance with the least queued work", LeastLoaded, (), frozenset({SIM, ROUTER})),
    Policy("kv_aware", "the cheapest instance counting the KV a turn can reuse there", KVAwareCost, (),
           frozenset({SIM, ROUTER})),
))
_PREFILL_ON_D_ARGS = (("prefill_on_d_suffix_tokens", "suffix_tokens"), ("prefill_on_d_suffix_ratio", "suffix_ratio"),
                      ("prefill_on_d_p_busy_tokens", "p_busy_tokens"),
                      ("prefill_on_d_d_pending_tokens", "d_pending_tokens"),
                      ("prefill_on_d_d_busy_fraction", "d_busy_fraction"), ("prefill_on_d_lapsed_s", "lapsed_s"))
PREFILL_ON_D = Registry("prefill_on_d", "prefill_on_d", (
    Policy(name, help, functools.partial(PrefillOnD, policy=name), _PREFILL_ON_D_ARGS, frozenset({SIM, ROUTER}))
    for name, help in (
        ("off", "every later turn goes to P"),
        ("isl_bounding", "to D when the suffix is short (below prefill_on_d_suffix_tokens and "
                         "prefill_on_d_suffix_ratio of the prompt)"),
        ("prefill_load", "to D when P's queue is at prefill_on_d_p_busy_tokens or more"),
        ("isl_or_load", "to D when either holds"))))
# vLLM's CPU cache policies (vllm/v1/kv_offload/cpu/policies/factory.py); the simulator models both itself
HOST_EVICTION = Registry("host_eviction", "eviction_policy", (
    Policy("lru", "least recently stored or read first (vLLM's default)", None, (), frozenset({SIM})),
    Policy("arc", "adaptive replacement: once-stored and read-again lists, the split learnt from evictions",
           None, (), frozenset({SIM})),
))
# the published host-tier pull measurements calibration.host_tier fits (HOST_PULL_FITS there, same names)
HOST_PULL_FIT = Registry("host_pull_fit", "host_pull_fit", (
    Policy("gpt-oss-120b-tp1", "llm-d's gpt-oss-120b sweep, one-pod TP=1 instances: a warm pull's floor ~26 ms",
           None, (), frozenset({SIM})),
    Policy("glm-5.2-wide-ep", "llm-d's GLM-5.2-FP8 sweep, two-pod data-parallel instances: floor ~1.5 s", None, (),
           frozenset({SIM})),
))
REGISTRIES: dict[str, Registry] = {r.family: r for r in (RECOMPUTE, RETENTION, UNDER_PRESSURE, PLACEMENT, PREFILL_ON_D,
                                                         HOST_EVICTION, HOST_PULL_FIT)}


def selector_help(name: str, surface: str) -> str:
    """A selector's help with each of its policies on ``surface`` said in a few words."""
    s = _BY_NAME[name]
    registry = REGISTRIES[s.family]  # type: ignore[index]
    return s.help + ": " + "; ".join(f"{p.name} = {p.help}" for p in registry if surface in p.surfaces)


__all__ = ["CONNECTOR", "PLACEMENT", "PREFILL_ON_D", "RECOMPUTE", "REGISTRIES", "REMOVED", "RENAMED", "RETENTION", "ROUTER",
           "SETTINGS", "SIM", "SURFACES", "UNDER_PRESSURE", "Policy", "Registry",
           "Setting", "SettingError", "default", "old_name_message", "on", "setting", "sim_field", "selector_help"]
