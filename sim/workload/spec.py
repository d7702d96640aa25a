"""Build a generator's config dataclass from a TOML-ish table, one rule for all generators.

The dataclass is the single source of defaults: a table only overrides fields, each checked against
the field's annotation, and a key the dataclass does not have is an error that names it (a typo must
not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping

from sim.workload.distributions import Distribution, parse_distribution

ConfigT = typing.TypeVar("ConfigT")
DistributionParser = Callable[[object, str], Distribution]


def config_from_spec(config_type: type[ConfigT], spec: Mapping[str, object], where: str,
                     parse: DistributionParser = parse_distribution, base: ConfigT | None = None,
                     also_allowed: typing.Iterable[str] = ()) -> ConfigT:
    """``config_type(**overrides)`` from ``spec``; ``where`` prefixes errors (e.g. ``"workload"``).

    ``base``: an instance whose values replace the defaults (a named preset); ``also_allowed``: keys
    another config of the same table reads, named in the unknown-key error."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: expected a table, got {spec!r}")
    hints = typing.get_type_hints(config_type)
    names = [f.name for f in dataclasses.fields(config_type)]  # type: ignore[arg-type]
    overrides: dict[str, object] = {}
    for key, value in spec.items():
        if key not in names:
            raise ValueError(f"{where}: unknown key {key!r} (allowed: {', '.join(sorted({*names, *also_allowed}))})")
        overrides[key] = _convert(value, hints[key], f"{where}.{key}", parse)
    try:
        return dataclasses.replace(base, **overrides) if base is not None else config_type(**overrides)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _convert(value: object, hint: object, name: str, parse: DistributionParser) -> object:
    if hint == Distribution:
        return parse(value, name)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        return value
    if hint is float or hint == (float | None):
        if value is None and hint != float:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{name}: no config conversion for annotation {hint!r}")  # a programming error


def check_generator_fields(num_conversations: int, arrival_rate_per_s: float | None,
                           history_rewrite_prob: float) -> None:
    """Checks every generator config shares (errors name the field)."""
    if num_conversations < 1:
        raise ValueError(f"num_conversations must be >= 1, got {num_conversations!r}")
    if arrival_rate_per_s is not None and not 0.0 < arrival_rate_per_s < math.inf:
        raise ValueError(f"arrival_rate_per_s must be a positive finite rate or None, got {arrival_rate_per_s!r}")
    if not 0.0 <= history_rewrite_prob <= 1.0:
        raise ValueError(f"history_rewrite_prob must be in [0, 1], got {history_rewrite_prob!r}")
