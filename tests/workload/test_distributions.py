"""Scalar distributions: bounds, determinism, the published shapes, and config validation."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given, settings, strategies as st

from sim.workload.distributions import (
    Constant,
    Empirical,
    Exponential,
    LogNormal,
    Uniform,
    UniformInt,
    count_sampler,
    parse_distribution,
    sample_count,
    value_sampler,
)

seeds = st.integers(0, 2**32)


@given(low=st.integers(0, 10_000), width=st.integers(0, 500), seed=seeds)
def test_uniform_int_stays_in_its_closed_range(low, width, seed):
    rng = random.Random(seed)
    draws = [UniformInt(low, low + width).sample(rng) for _ in range(50)]
    assert all(isinstance(draw, int) and low <= draw <= low + width for draw in draws)


def test_uniform_int_reaches_both_ends():
    rng = random.Random(3)
    assert {UniformInt(120, 122).sample(rng) for _ in range(200)} == {120, 121, 122}


@given(low=st.floats(0, 1e6), width=st.floats(0, 1e6), seed=seeds)
def test_uniform_stays_in_range(low, width, seed):
    rng = random.Random(seed)
    assert all(low <= Uniform(low, low + width).sample(rng) <= low + width for _ in range(20))


@given(mu=st.floats(-5, 12), sigma=st.floats(0, 3), cap=st.floats(0, 1e5), seed=seeds)
def test_lognormal_never_exceeds_its_max(mu, sigma, cap, seed):
    rng = random.Random(seed)
    draws = [LogNormal(mu, sigma, cap).sample(rng) for _ in range(50)]
    assert all(0.0 <= draw <= cap for draw in draws)


@given(samples=st.lists(st.floats(0, 1e4), min_size=1, max_size=20), seed=seeds)
def test_empirical_only_returns_its_samples(samples, seed):
    rng = random.Random(seed)
    distribution = Empirical(samples)
    assert all(distribution.sample(rng) in samples for _ in range(30))


def test_constant_is_constant():
    rng = random.Random(1)
    assert [Constant(500).sample(rng) for _ in range(3)] == [500, 500, 500]


@given(seed=seeds)
def test_same_seed_same_draws(seed):
    distributions = [UniformInt(1, 9), Uniform(0, 1), Exponential(2.0), LogNormal(1.0, 0.5, 9.0), Empirical([1, 2])]

    def draws(rng):
        return [distribution.sample(rng) for distribution in distributions for _ in range(5)]

    assert draws(random.Random(seed)) == draws(random.Random(seed))


def test_lognormal_from_mean_follows_vllm_average_form():
    # vLLM: median = 0.85 x average, mean = average (no clipping here, so the mean is the nominal one)
    rng = random.Random(11)
    draws = [LogNormal.from_mean(4000).sample(rng) for _ in range(40_000)]
    assert statistics.fmean(draws) == pytest.approx(4000, rel=0.03)
    assert statistics.median(draws) == pytest.approx(3400, rel=0.03)


def test_lognormal_from_quantiles_hits_mooncake_quantiles():
    rng = random.Random(12)
    draws = sorted(LogNormal.from_quantiles(p50=126.0, p90=480.0).sample(rng) for _ in range(40_000))
    assert draws[len(draws) // 2] == pytest.approx(126, rel=0.05)
    assert draws[int(len(draws) * 0.9)] == pytest.approx(480, rel=0.05)


def test_lognormal_from_mean_sigma_has_that_mean():
    rng = random.Random(13)
    draws = [LogNormal.from_mean_sigma(50.0, 0.3).sample(rng) for _ in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(50.0, rel=0.02)


def test_exponential_mean():
    rng = random.Random(14)
    assert statistics.fmean(Exponential(7.0).sample(rng) for _ in range(20_000)) == pytest.approx(7.0, rel=0.03)


def test_sample_count_rounds_and_floors():
    rng = random.Random(0)
    assert sample_count(Constant(2.6), rng) == 3
    assert sample_count(Constant(0), rng, minimum=1) == 1


# --- parse_distribution: the config form -----------------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    (500, Constant(500)),
    (2.5, Constant(2.5)),
    ("500", Constant(500)),
    ("120..160", UniformInt(120, 160)),
    ("0.5..2", Uniform(0.5, 2)),
    ({"kind": "constant", "value": 7}, Constant(7)),
    ({"kind": "uniform", "low": 1.5, "high": 3}, Uniform(1.5, 3)),
    ({"kind": "uniform_int", "low": 800, "high": 1200}, UniformInt(800, 1200)),
    ({"kind": "exponential", "mean": 4}, Exponential(4)),
    ({"kind": "empirical", "samples": [1, 2, 3]}, Empirical((1, 2, 3))),
    ({"kind": "lognormal", "mu": 1.0, "sigma": 0.5, "max": 9}, LogNormal(1.0, 0.5, 9)),
])
def test_parse_forms(spec, expected):
    assert parse_distribution(spec, "workload.x") == expected


def test_parse_lognormal_mean_max_is_vllm_average_form():
    parsed = parse_distribution({"kind": "lognormal", "mean": 4000, "max": 10000}, "f")
    # sigma^2 = 2 ln(1/0.85), mu = ln(0.85 * 4000): written out, not taken from the code
    assert parsed.mu == pytest.approx(math.log(3400))
    assert parsed.sigma == pytest.approx(math.sqrt(2 * math.log(1 / 0.85)))
    assert parsed.max_value == 10000


def test_parse_lognormal_quantile_form():
    parsed = parse_distribution({"kind": "lognormal", "p50": 126, "p90": 480}, "f")
    assert parsed.mu == pytest.approx(math.log(126))
    assert parsed.sigma == pytest.approx(math.log(480 / 126) / 1.2815515655446004)


def test_parse_passes_built_distributions_through():
    distribution = UniformInt(1, 2)
    assert parse_distribution(distribution, "f") is distribution


@pytest.mark.parametrize("spec, reason", [
    (-1, ">= 0"),
    (float("nan"), "NaN"),
    (float("inf"), "finite"),
    (True, "expected a number"),
    ([1, 2], "expected a number"),
    ("abc", "cannot read 'abc'"),
    ("5..x", "cannot read 'x'"),
    ("9..3", "must be >= low"),
    ({"low": 1, "high": 2}, "missing key 'kind'"),
    ({"kind": "gauss", "mean": 1}, "unknown distribution kind 'gauss'"),
    ({"kind": "uniform", "low": 1}, "missing key 'high'"),
    ({"kind": "uniform", "low": 1, "hgh": 2}, "unknown key 'hgh'"),
    ({"kind": "uniform", "low": -1, "high": 2}, ">= 0"),
    ({"kind": "uniform_int", "low": 1.5, "high": 2}, "integer"),
    ({"kind": "uniform_int", "low": 5, "high": 2}, "must be >= low"),
    ({"kind": "exponential", "mean": 0}, "> 0"),
    ({"kind": "constant", "value": float("nan")}, "NaN"),
    ({"kind": "constant", "value": "7"}, "must be a number"),
    ({"kind": "empirical", "samples": []}, "must not be empty"),
    ({"kind": "empirical", "samples": [1, -2]}, "samples[1]"),
    ({"kind": "empirical", "samples": "12"}, "list of numbers"),
    ({"kind": "lognormal", "max": 10}, "lognormal needs one of"),
    ({"kind": "lognormal", "mu": 1}, "missing key 'sigma'"),
    ({"kind": "lognormal", "mu": 1, "sigma": -0.5}, "sigma must be >= 0"),
    ({"kind": "lognormal", "mean": -4000}, "mean must be > 0"),
    ({"kind": "lognormal", "mean": 4000, "max": -1}, "max must be >= 0"),
    ({"kind": "lognormal", "mean": 4000, "median_ratio": 1.5}, "median_ratio"),
    ({"kind": "lognormal", "mean": 4000, "p50": 3}, "cannot also take 'mean'"),
    ({"kind": "lognormal", "p50": 126}, "missing key 'p90'"),
    ({"kind": "lognormal", "p50": 480, "p90": 126}, "p90"),
])
def test_parse_errors_name_the_field_and_the_reason(spec, reason):
    with pytest.raises(ValueError) as error:
        parse_distribution(spec, "workload.user_tokens")
    message = str(error.value)
    assert message.startswith("workload.user_tokens: ")
    assert reason in message


@settings(max_examples=50)
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6)))
def test_constant_accepts_exactly_the_finite_non_negative_numbers(value):
    acceptable = math.isfinite(value) and value >= 0
    if acceptable:
        assert parse_distribution(value, "f").sample(random.Random(0)) == value
    else:
        with pytest.raises(ValueError, match="^f: "):
            parse_distribution(value, "f")


@given(low=st.integers(0, 5000), span=st.integers(0, 5000), minimum=st.integers(0, 3), seed=st.integers(0, 2**32))
def test_a_count_sampler_draws_what_sample_count_draws(low, span, minimum, seed):
    """count_sampler's UniformInt shortcut (rng._randbelow) against sample_count (rng.randint): same
    values, same stream left behind; a Python whose randint draws differently fails here."""
    dist = UniformInt(low, low + span)
    ours, theirs = random.Random(seed), random.Random(seed)
    draw = count_sampler(dist, minimum)
    assert [draw(ours) for _ in range(20)] == [sample_count(dist, theirs, minimum) for _ in range(20)]
    assert ours.random() == theirs.random()


@given(mean=st.floats(1e-3, 1e4), seed=st.integers(0, 2**32))
def test_a_value_sampler_draws_what_sample_draws(mean, seed):
    """value_sampler's Exponential formula against rng.expovariate, bit for bit."""
    for dist in (Exponential(mean), LogNormal.from_mean(mean), Constant(mean)):
        ours, theirs = random.Random(seed), random.Random(seed)
        draw = value_sampler(dist)
        assert [draw(ours) for _ in range(20)] == [dist.sample(theirs) for _ in range(20)]
