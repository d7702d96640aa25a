"""Scalar distributions for workload parameters (token counts, gaps, arrival times).

Each is a small frozen dataclass sampled with a ``random.Random`` the caller passes in, so a generator
owns its streams and a run is reproducible from its seeds (stdlib ``random`` is deterministic across
platforms and fast enough for tens of thousands of draws). Every value here is a count of tokens or
a number of seconds, so parameters and samples are non-negative; parameters are checked on
construction, and :func:`parse_distribution` turns a config value into one, naming the config field
in every error.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from statistics import NormalDist

# vLLM's multi-turn benchmark (benchmarks/multi_turn/bench_dataset.py) builds a lognormal from an
# "average" with median = 0.85 x average unless told otherwise; we keep its default.
VLLM_MEDIAN_RATIO = 0.85


def _number(name: str, value: object, *, minimum: float | None = 0.0, strictly_above: bool = False) -> float:
    """``value`` as a finite float, or ValueError saying which parameter is wrong and why."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if math.isnan(number):
        raise ValueError(f"{name} must be a number, got NaN")
    if math.isinf(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if minimum is not None:
        if strictly_above and number <= minimum:
            raise ValueError(f"{name} must be > {minimum:g}, got {value!r}")
        if number < minimum:
            raise ValueError(f"{name} must be >= {minimum:g} (it is a count or a duration), got {value!r}")
    return number


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (it is a count), got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Constant:
    value: float

    def __post_init__(self) -> None:
        _number("constant value", self.value)

    def sample(self, rng: random.Random) -> float:
        return self.value


@dataclass(frozen=True, slots=True)
class Uniform:
    """Continuous uniform on [low, high] (seconds, rates)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        low = _number("uniform low", self.low)
        if _number("uniform high", self.high) < low:
            raise ValueError(f"uniform high ({self.high!r}) must be >= low ({self.low!r})")

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)


@dataclass(frozen=True, slots=True)
class UniformInt:
    """Integers in [low, high], both included: how vLLM's benchmark draws token counts and turns."""

    low: int
    high: int

    def __post_init__(self) -> None:
        low = _integer("uniform_int low", self.low)
        if _integer("uniform_int high", self.high) < low:
            raise ValueError(f"uniform_int high ({self.high!r}) must be >= low ({self.low!r})")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class Exponential:
    """Memoryless waits: Poisson inter-arrival times."""

    mean: float

    def __post_init__(self) -> None:
        _number("exponential mean", self.mean, strictly_above=True)

    def sample(self, rng: random.Random) -> float:
        return rng.expovariate(1.0 / self.mean)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """exp(N(mu, sigma^2)), optionally clipped at ``max_value`` as vLLM's benchmark does.

    Stored in the normal's own parameters; the constructors below say where they come from. Note
    that clipping pulls the mean below the nominal one: vLLM's "mean 4,000, max 10,000" clips 2.9 %
    of draws and has a mean of 3,920.
    """

    mu: float
    sigma: float
    max_value: float | None = None

    def __post_init__(self) -> None:
        _number("lognormal mu", self.mu, minimum=None)
        _number("lognormal sigma", self.sigma)
        if self.max_value is not None:
            _number("lognormal max", self.max_value)

    @classmethod
    def from_mean(cls, mean: float, max_value: float | None = None,
                  median_ratio: float = VLLM_MEDIAN_RATIO) -> LogNormal:
        """vLLM's ``{"distribution": "lognormal", "average": A, "max": M}``: median = ratio x mean.

        mean = exp(mu + sigma^2/2) and median = exp(mu), so sigma^2 = 2 ln(mean/median) and
        mu = ln(median). (vLLM also rescales each batch to hit the average exactly; per-sample draws
        cannot, so here the mean is right in expectation.)
        """
        _number("lognormal mean", mean, strictly_above=True)
        ratio = _number("lognormal median_ratio", median_ratio, strictly_above=True)
        if ratio > 1.0:
            raise ValueError(f"lognormal median_ratio must be in (0, 1], got {median_ratio!r}")
        return cls(mu=math.log(ratio * mean), sigma=math.sqrt(2.0 * math.log(1.0 / ratio)), max_value=max_value)

    @classmethod
    def from_mean_sigma(cls, mean: float, sigma: float, max_value: float | None = None) -> LogNormal:
        """A given mean of the distribution itself (not of the normal) and a given log-scale sigma."""
        _number("lognormal mean", mean, strictly_above=True)
        _number("lognormal sigma", sigma)
        return cls(mu=math.log(mean) - sigma * sigma / 2.0, sigma=sigma, max_value=max_value)

    @classmethod
    def from_quantiles(cls, p50: float, p90: float, max_value: float | None = None) -> LogNormal:
        """Matches a median and a 90th percentile: mu = ln p50, sigma = ln(p90/p50) / z_0.9."""
        median = _number("lognormal p50", p50, strictly_above=True)
        if _number("lognormal p90", p90, strictly_above=True) < median:
            raise ValueError(f"lognormal p90 ({p90!r}) must be >= p50 ({p50!r})")
        z90 = NormalDist().inv_cdf(0.9)
        return cls(mu=math.log(median), sigma=math.log(p90 / median) / z90, max_value=max_value)

    def sample(self, rng: random.Random) -> float:
        value = rng.lognormvariate(self.mu, self.sigma)
        return value if self.max_value is None else min(value, self.max_value)


@dataclass(frozen=True, slots=True)
class Zipf:
    """P(k) = k^-alpha / zeta(alpha) for k = 1, 2, ...; optionally clipped at ``max_value``.

    vLLM's multi-turn benchmark draws ``{"distribution": "zipf", "alpha": a, "max": m}`` with numpy's
    ``random.zipf`` (alpha > 1). Sampled here by Devroye's rejection method (Non-Uniform Random Variate
    Generation, 1986, X.6.1: http://luc.devroye.org/rnbookindex.html): propose floor(U^(-1/(alpha-1)))
    and accept with the ratio of the target to that proposal's mass.
    """

    alpha: float
    max_value: int | None = None

    def __post_init__(self) -> None:
        _number("zipf alpha", self.alpha, minimum=1.0, strictly_above=True)
        if self.max_value is not None:
            _integer("zipf max", self.max_value)

    def sample(self, rng: random.Random) -> int:
        exponent = self.alpha - 1.0
        b = 2.0 ** exponent
        while True:
            u = 1.0 - rng.random()  # (0, 1]: U^(-1/exponent) stays finite
            v = rng.random()
            proposal = u ** (-1.0 / exponent)
            if proposal >= 2.0 ** 62:  # beyond any count that matters; the clip below would take it anyway
                continue
            k = math.floor(proposal)
            t = (1.0 + 1.0 / k) ** exponent
            if v * k * (t - 1.0) / (b - 1.0) <= t / b:
                return k if self.max_value is None else min(k, self.max_value)


@dataclass(frozen=True, slots=True)
class Poisson:
    """Counts with mean and variance ``mean``; optionally clipped at ``max_value``.

    vLLM's multi-turn benchmark calls the mean ``alpha`` (numpy's ``random.poisson(lam)``). Below a
    mean of 10, Knuth's product of uniforms (TAOCP vol. 2, 3.4.1); from 10 on, Hoermann's transformed
    rejection PTRS ("The transformed rejection method for generating Poisson random variables",
    Insurance: Mathematics and Economics 12, 1993), whose cost does not grow with the mean.
    """

    mean: float
    max_value: int | None = None

    def __post_init__(self) -> None:
        _number("poisson mean", self.mean)
        if self.max_value is not None:
            _integer("poisson max", self.max_value)

    def sample(self, rng: random.Random) -> int:
        k = self._knuth(rng) if self.mean < 10.0 else self._ptrs(rng)
        return k if self.max_value is None else min(k, self.max_value)

    def _knuth(self, rng: random.Random) -> int:
        limit, product, k = math.exp(-self.mean), rng.random(), 0
        while product > limit:
            product *= rng.random()
            k += 1
        return k

    def _ptrs(self, rng: random.Random) -> int:
        lam = self.mean
        b = 0.931 + 2.53 * math.sqrt(lam)
        a = -0.059 + 0.02483 * b
        log_inv_alpha = math.log(1.1239 + 1.1328 / (b - 3.4))
        v_r = 0.9277 - 3.6224 / (b - 2.0)
        while True:
            u = rng.random() - 0.5
            v = rng.random()
            us = 0.5 - abs(u)
            k = math.floor((2.0 * a / us + b) * u + lam + 0.43) if us > 0 else -1
            if us >= 0.07 and v <= v_r:
                return k
            if k < 0 or (us < 0.013 and v > us):
                continue
            if (math.log(v) + log_inv_alpha - math.log(a / (us * us) + b)
                    <= -lam + k * math.log(lam) - math.lgamma(k + 1)):
                return k


@dataclass(frozen=True, slots=True)
class Empirical:
    """Resamples observed values with replacement (e.g. Mooncake's parent->child gaps)."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if isinstance(self.samples, (str, bytes)) or not isinstance(self.samples, Sequence):
            raise ValueError(f"empirical samples must be a list of numbers, got {self.samples!r}")
        if not self.samples:
            raise ValueError("empirical samples must not be empty")
        for index, value in enumerate(self.samples):
            _number(f"empirical samples[{index}]", value)
        object.__setattr__(self, "samples", tuple(self.samples))  # frozen, hashable, safe to share

    def sample(self, rng: random.Random) -> float:
        return rng.choice(self.samples)


Distribution = Constant | Uniform | UniformInt | Exponential | LogNormal | Zipf | Poisson | Empirical
DISTRIBUTION_TYPES = (Constant, Uniform, UniformInt, Exponential, LogNormal, Zipf, Poisson, Empirical)


def sample_count(distribution: Distribution, rng: random.Random, minimum: int = 0) -> int:
    """A token count drawn from ``distribution``: rounded to an integer, at least ``minimum``."""
    return max(minimum, int(round(distribution.sample(rng))))


def count_sampler(distribution: Distribution, minimum: int = 0) -> Callable[[random.Random], int]:
    """``lambda rng: sample_count(distribution, rng, minimum)``, for a generator drawing a count per turn.

    A UniformInt draws what ``rng.randint`` draws without its three Python layers: CPython's
    ``randint(low, high)`` is ``randrange(low, high + 1)``, which is ``low + rng._randbelow(width)``
    (tests/workload/test_distributions.py holds the two to the same draws)."""
    if type(distribution) is UniformInt and distribution.low >= minimum:
        low, width = distribution.low, distribution.high - distribution.low + 1
        return lambda rng: low + rng._randbelow(width)
    return lambda rng: sample_count(distribution, rng, minimum)


def value_sampler(distribution: Distribution) -> Callable[[random.Random], float]:
    """``distribution.sample``, for a generator drawing a value per turn: an Exponential draws what
    ``rng.expovariate(1 / mean)`` draws (CPython's formula, held to it by the same test) without the call."""
    if type(distribution) is Exponential:
        lambd = 1.0 / distribution.mean
        log = math.log
        return lambda rng: -log(1.0 - rng.random()) / lambd
    return distribution.sample


# kind -> (required keys, optional keys) for the table form of parse_distribution
_TABLE_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "constant": (frozenset({"value"}), frozenset()),
    "uniform": (frozenset({"low", "high"}), frozenset()),
    "uniform_int": (frozenset({"low", "high"}), frozenset()),
    "exponential": (frozenset({"mean"}), frozenset()),
    "lognormal": (frozenset(), frozenset({"mu", "sigma", "mean", "median_ratio", "p50", "p90", "max"})),
    "empirical": (frozenset({"samples"}), frozenset()),
    "zipf": (frozenset({"alpha"}), frozenset({"max"})),
    "poisson": (frozenset({"mean"}), frozenset({"max"})),
}


def parse_distribution(spec: object, field: str) -> Distribution:
    """Turn a config value into a distribution; ValueError names ``field`` and the reason.

    Accepted forms:

    * a number, or a string holding one: a constant (``500``);
    * ``"low..high"``: uniform over integers if both ends are integers, else over reals;
    * a table with ``kind`` and the kind's keys: ``constant`` (value), ``uniform`` / ``uniform_int``
      (low, high), ``exponential`` (mean), ``empirical`` (samples), ``zipf`` (alpha [, max]),
      ``poisson`` (mean [, max]), ``lognormal`` given by one of
      ``mu`` + ``sigma`` (the normal's parameters), ``mean`` + ``sigma`` (mean of the distribution),
      ``mean`` [+ ``median_ratio``, default 0.85] (vLLM's "average" form), ``p50`` + ``p90``;
      each lognormal form takes an optional ``max`` that clips samples;
    * an already built distribution, returned as is (for configs built in code).
    """
    try:
        return _parse(spec, field)
    except ValueError as err:
        message = str(err)
        raise ValueError(message if message.startswith(f"{field}:") else f"{field}: {message}") from None


def _parse(spec: object, field: str) -> Distribution:
    if isinstance(spec, DISTRIBUTION_TYPES):
        return spec
    if isinstance(spec, bool):
        raise ValueError(f"expected a number, a 'low..high' string or a table with 'kind', got {spec!r}")
    if isinstance(spec, (int, float)):
        return Constant(spec)
    if isinstance(spec, str):
        return _parse_string(spec)
    if isinstance(spec, Mapping):
        return _parse_table(spec, field)
    raise ValueError(f"expected a number, a 'low..high' string or a table with 'kind', got {spec!r}")


def _parse_string(text: str) -> Distribution:
    def to_number(part: str) -> int | float:
        try:
            return int(part)
        except ValueError:
            try:
                return float(part)
            except ValueError:
                raise ValueError(f"cannot read {part.strip()!r} in {text!r} as a number") from None

    if ".." in text:
        low_text, high_text = text.split("..", 1)
        low, high = to_number(low_text), to_number(high_text)
        if isinstance(low, int) and isinstance(high, int):
            return UniformInt(low, high)
        return Uniform(low, high)
    return Constant(to_number(text))


def split_kind(spec: Mapping[str, object], kind_key: str, kinds: Mapping[str, tuple[Set[str], Set[str]]],
               where: Callable[[str], str]) -> tuple[str, dict[str, object]]:
    """A distribution table's kind (under ``kind_key``) and its other keys, checked against ``kinds``
    (kind -> required keys, optional keys): none unknown, none required missing; ``where(kind)``
    ends the key errors (e.g. "for kind 'uniform'")."""
    if kind_key not in spec:
        raise ValueError(f"missing key {kind_key!r} (one of: {', '.join(sorted(kinds))})")
    kind = spec[kind_key]
    if kind not in kinds:
        raise ValueError(f"unknown distribution kind {kind!r} (one of: {', '.join(sorted(kinds))})")
    required, optional = kinds[kind]  # type: ignore[index]
    params = {key: value for key, value in spec.items() if key != kind_key}
    for key in params:
        if key not in required | optional:
            raise ValueError(f"unknown key {key!r} {where(kind)} (allowed: {', '.join(sorted(required | optional))})")
    for key in sorted(required):
        if key not in params:
            raise ValueError(f"missing key {key!r} {where(kind)}")
    return kind, params  # type: ignore[return-value]


def _parse_table(spec: Mapping[str, object], field: str) -> Distribution:
    kind, params = split_kind(spec, "kind", _TABLE_KEYS, lambda kind: f"for kind {kind!r}")
    if kind == "constant":
        return Constant(params["value"])
    if kind == "uniform":
        return Uniform(params["low"], params["high"])
    if kind == "uniform_int":
        return UniformInt(params["low"], params["high"])
    if kind == "exponential":
        return Exponential(params["mean"])
    if kind == "empirical":
        return Empirical(params["samples"])
    if kind == "zipf":
        return Zipf(params["alpha"], params.get("max"))  # type: ignore[arg-type]
    if kind == "poisson":
        return Poisson(params["mean"], params.get("max"))  # type: ignore[arg-type]
    return _parse_lognormal(params)


def _parse_lognormal(params: Mapping[str, object]) -> LogNormal:
    """One of four parameterisations; mixing two of them is ambiguous and rejected."""
    max_value = params.get("max")
    given = set(params) - {"max"}

    def only(*allowed: str) -> None:
        extra = given - set(allowed)
        if extra:
            raise ValueError(f"lognormal given by {' + '.join(allowed)} cannot also take "
                             f"{', '.join(repr(key) for key in sorted(extra))}")

    def need(key: str, form: str) -> object:
        if key not in params:
            raise ValueError(f"missing key {key!r}: lognormal given by {form}")
        return params[key]

    if "mu" in given:
        only("mu", "sigma")
        return LogNormal(params["mu"], need("sigma", "mu + sigma"), max_value)  # type: ignore[arg-type]
    if "p50" in given or "p90" in given:
        only("p50", "p90")
        return LogNormal.from_quantiles(need("p50", "p50 + p90"), need("p90", "p50 + p90"),  # type: ignore[arg-type]
                                        max_value)  # type: ignore[arg-type]
    if "mean" in given:
        if "sigma" in given:
            only("mean", "sigma")
            return LogNormal.from_mean_sigma(params["mean"], params["sigma"], max_value)  # type: ignore[arg-type]
        only("mean", "median_ratio")
        return LogNormal.from_mean(params["mean"], max_value,  # type: ignore[arg-type]
                                   params.get("median_ratio", VLLM_MEDIAN_RATIO))  # type: ignore[arg-type]
    raise ValueError("lognormal needs one of: mu + sigma, mean [+ sigma | + median_ratio], p50 + p90")
