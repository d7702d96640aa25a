"""Workloads: synthetic multi-turn (vLLM multi-turn benchmark parameters), agentic tool loops, and
Mooncake trace replay; all produce :class:`sim.workload.model.Conversation`.

Reading guide:

* :mod:`~sim.workload.model`         -- Conversation and Turn, the only thing the simulator sees
* :mod:`~sim.workload.distributions` -- scalar distributions and the config form that builds them
* :mod:`~sim.workload.synthetic`     -- vLLM's multi-turn benchmark (PR #32553 settings by default)
* :mod:`~sim.workload.agentic`       -- tool loops: short gaps, context grown by tool results
* :mod:`~sim.workload.mooncake`      -- Mooncake FAST'25 trace replay and its gap statistics
* :mod:`~sim.workload.vllm_multi_turn` -- vLLM's ``generate_multi_turn.json`` read as is (its client
                                        loop: :mod:`sim.clients.bench`)
* :mod:`~sim.workload.history`       -- where a resent history departs from what D holds (reasoning a
                                        template drops, drift, re-serialised tool calls, edits) and the
                                        presets built on it
* :func:`load_workload`              -- a config table and a seed to conversations
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from sim.engine.rng import stream
from sim.workload import agentic, history, mooncake, synthetic, vllm_multi_turn
from sim.workload.distributions import Distribution, Empirical, parse_distribution
from sim.workload.model import Conversation, Turn
from sim.workload.spec import config_from_spec

__all__ = ["Conversation", "Turn", "load_workload"]

VLLM_MULTI_TURN = "vllm_multi_turn"  # vLLM's benchmark config file plus its client flags
ROUTER_TRACE = "router_trace"  # what `bidikv router --trace-out` wrote (sim/workload/router_trace.py)
WORKLOAD_KINDS = ("agentic", "mooncake", "synthetic", VLLM_MULTI_TURN, ROUTER_TRACE, *history.PRESETS)
# one line per kind, for --help and the run's description
WORKLOAD_HELP = {
    "synthetic": "synthetic chat in vLLM's multi-turn benchmark shapes",
    "agentic": "agentic tool loops",
    ROUTER_TRACE: "a trace `bidikv router --trace-out` wrote (give --trace FILE_OR_DIR)",
    "mooncake": "Mooncake trace replay (give --trace)",
    VLLM_MULTI_TURN: "vLLM's multi-turn benchmark config and client loop (give --vllm-multi-turn-config)",
    **{name: preset.help for name, preset in history.PRESETS.items()},
}
MOONCAKE_KEYS = ("kind", "path", "min_parent_blocks")
TRACE_GAPS_KIND = "mooncake_gaps"  # a distribution of gaps resampled from a Mooncake trace


def load_workload(spec: Mapping[str, object], seed: int) -> list[Conversation]:
    """The conversations a ``[workload]`` table describes, reproducible from ``seed``.

    ``kind`` picks the generator; the other keys override fields of its config dataclass, where
    ``num_conversations`` is the count for both generators
    (``synthetic``: :class:`~sim.workload.synthetic.SyntheticMultiTurnConfig`, ``agentic``:
    :class:`~sim.workload.agentic.AgenticConfig`), or of
    :class:`~sim.workload.history.HistoryConfig` (how the resent history departs from what D holds);
    a preset (``reasoning_chat``, ``answer_drift``, ``edited_history``, ``reasoning_agent``:
    :data:`~sim.workload.history.PRESETS`) is a generator with its own HistoryConfig values, which
    keys override the same way. For ``mooncake``, give ``path`` and optionally ``min_parent_blocks``.
    For ``vllm_multi_turn``, give ``path`` (a ``generate_multi_turn.json``, read as is:
    :mod:`~sim.workload.vllm_multi_turn`) and optionally vLLM's client flags
    (:class:`sim.clients.bench.VllmClientConfig`), which the run's client loop reads.
    A distribution field may also be ``{kind = "mooncake_gaps", path = ...}``:
    gaps resampled from a trace. Unknown keys are errors that name the key.

    Each subsystem gets its own stream from :func:`sim.engine.rng.stream`, seeded by the string
    ``"<seed>:<name>"`` (``random`` hashes str seeds with SHA-512, so they do not depend on
    PYTHONHASHSEED): ``workload`` (token counts), ``gaps`` (timing), ``trace-jitter`` (arrival jitter
    of a replayed trace), ``gap-trace-jitter`` (gaps resampled from a trace), ``history`` (the
    history's divergences: a workload without them is the same whatever they would have drawn).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not isinstance(spec, Mapping):
        raise ValueError(f"workload: expected a table, got {spec!r}")
    if "kind" not in spec:
        raise ValueError(f"workload: missing key 'kind' (one of: {', '.join(WORKLOAD_KINDS)})")
    kind = spec["kind"]
    options = {key: value for key, value in spec.items() if key != "kind"}
    parse = functools.partial(_parse_distribution_or_trace_gaps, seed=seed)

    if isinstance(kind, str) and (kind in ("synthetic", "agentic") or kind in history.PRESETS):
        preset = history.PRESETS.get(kind)
        generator = preset.generator if preset else kind
        divergence = {key: value for key, value in options.items() if key in history.HISTORY_FIELDS}
        options = {key: value for key, value in options.items() if key not in history.HISTORY_FIELDS}
        if generator == "synthetic":
            config = config_from_spec(synthetic.SyntheticMultiTurnConfig, options, "workload", parse,
                                      also_allowed=history.HISTORY_FIELDS)
            conversations = synthetic.generate(config, stream(seed, "workload"), stream(seed, "gaps"))
        else:
            agentic_config = config_from_spec(agentic.AgenticConfig, options, "workload", parse,
                                              also_allowed=history.HISTORY_FIELDS)
            conversations = agentic.generate(agentic_config, stream(seed, "workload"), stream(seed, "gaps"))
        history_config = config_from_spec(history.HistoryConfig, divergence, "workload", parse,
                                          base=preset.history if preset else None)
        return history.apply(conversations, history_config, stream(seed, "history"))
    if kind == "mooncake":
        for key in spec:
            if key not in MOONCAKE_KEYS:
                raise ValueError(f"workload: unknown key {key!r} for kind 'mooncake' "
                                 f"(allowed: {', '.join(MOONCAKE_KEYS)})")
        path = _trace_path(spec, "workload")
        min_parent_blocks = spec.get("min_parent_blocks", 2)
        if isinstance(min_parent_blocks, bool) or not isinstance(min_parent_blocks, int):
            raise ValueError(f"workload.min_parent_blocks: expected an integer, got {min_parent_blocks!r}")
        return mooncake.load_trace(path, stream(seed, "trace-jitter"), min_parent_blocks=min_parent_blocks)
    if kind == ROUTER_TRACE:
        for key in spec:
            if key not in ("kind", "path"):
                raise ValueError(f"workload: unknown key {key!r} for kind {ROUTER_TRACE!r} (allowed: kind, path)")
        from sim.workload.router_trace import load_router_trace

        return load_router_trace(_trace_path(spec, "workload"))
    if kind == VLLM_MULTI_TURN:
        from sim.clients.bench import CONFIG_KEYS, config_from_workload
        from sim.workload.chat_template import DEFAULT_TEMPLATE, parse_template

        for key in spec:
            if key not in ("kind", "path", "chat_template", *CONFIG_KEYS):
                raise ValueError(f"workload: unknown key {key!r} for kind {VLLM_MULTI_TURN!r} "
                                 f"(allowed: kind, path, chat_template, {', '.join(CONFIG_KEYS)}; the rest is in "
                                 "the JSON file)")
        config_from_workload({k: v for k, v in spec.items() if k != "chat_template"})  # the client flags, checked first
        template = parse_template(spec.get("chat_template", DEFAULT_TEMPLATE), "workload.chat_template")
        parsed = vllm_multi_turn.load_config(_trace_path(spec, "workload"))
        return vllm_multi_turn.generate(parsed, stream(seed, "workload"), template)
    raise ValueError(f"workload.kind: unknown workload kind {kind!r} (one of: {', '.join(WORKLOAD_KINDS)})")


def _trace_path(spec: Mapping[str, object], where: str) -> str:
    if "path" not in spec:
        raise ValueError(f"{where}: missing key 'path' (the trace or config file)")
    path = spec["path"]
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}.path: expected a file path, got {path!r}")
    return path


def _parse_distribution_or_trace_gaps(value: object, field: str, *, seed: int) -> Distribution:
    """parse_distribution, plus the ``mooncake_gaps`` kind (kept here so distributions does no I/O)."""
    if not (isinstance(value, Mapping) and value.get("kind") == TRACE_GAPS_KIND):
        return parse_distribution(value, field)
    for key in value:
        if key not in ("kind", "path"):
            raise ValueError(f"{field}: unknown key {key!r} for kind {TRACE_GAPS_KIND!r} (allowed: kind, path)")
    gaps = mooncake.sample_gaps(_trace_path(value, field), stream(seed, "gap-trace-jitter"))
    if not gaps:
        raise ValueError(f"{field}: the trace has no parent->child gaps to resample")
    return Empirical(tuple(gaps))
