"""Zipf and Poisson, as vLLM's multi-turn benchmark draws them (numpy's zipf and poisson): frequencies
checked against the closed-form mass functions (scipy's, not ours) with a chi-square test."""

from __future__ import annotations

import collections
import math
import random

import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats
from scipy.special import zeta

from sim.workload.distributions import Poisson, Zipf, parse_distribution

DRAWS = 20_000
# a false alarm once in 10^4 runs per check; the seeds are fixed, so a pass is reproducible
ALPHA = 1e-4


def _chi_square_p(counts: collections.Counter, pmf, support_end: int) -> float:
    """p-value of ``counts`` against ``pmf`` on 0..support_end-1 plus one tail bin (>= support_end)."""
    total = sum(counts.values())
    observed = [counts.get(k, 0) for k in range(support_end)] + [sum(v for k, v in counts.items() if k >= support_end)]
    probabilities = [pmf(k) for k in range(support_end)]
    expected = [p * total for p in probabilities] + [(1 - sum(probabilities)) * total]
    keep = [(o, e) for o, e in zip(observed, expected) if e >= 5]  # merge-free: drop sparse bins, renormalise
    o_kept, e_kept = [o for o, _ in keep], [e for _, e in keep]
    scale = sum(o_kept) / sum(e_kept)
    return stats.chisquare(o_kept, [e * scale for e in e_kept]).pvalue


@pytest.mark.parametrize("alpha", [1.2, 2.0, 3.5])
def test_zipf_matches_its_mass_function(alpha):
    rng = random.Random(f"zipf:{alpha}")
    counts = collections.Counter(Zipf(alpha).sample(rng) for _ in range(DRAWS))
    assert min(counts) >= 1
    # P(1) = 1 / zeta(alpha): about 0.18 at alpha 1.2, 0.61 at 2
    assert counts[1] / DRAWS == pytest.approx(1 / zeta(alpha), abs=5 * math.sqrt(0.25 / DRAWS))
    assert _chi_square_p(counts, lambda k: stats.zipf.pmf(k, alpha), 30) > ALPHA


def test_zipf_max_clips_the_tail_onto_max():
    alpha, cap = 1.2, 100
    rng = random.Random(5)
    draws = [Zipf(alpha, cap).sample(rng) for _ in range(DRAWS)]
    assert max(draws) == cap
    tail = stats.zipf.sf(cap - 1, alpha)  # P(X >= 100), all of it lands on 100
    assert draws.count(cap) / DRAWS == pytest.approx(tail, abs=5 * math.sqrt(tail * (1 - tail) / DRAWS))


@pytest.mark.parametrize("mean", [0.0, 0.7, 4.0, 9.99, 10.0, 37.5, 4000.0])
def test_poisson_matches_its_mass_function_on_both_samplers(mean):
    rng = random.Random(f"poisson:{mean}")
    draws = [Poisson(mean).sample(rng) for _ in range(DRAWS)]
    assert min(draws) >= 0
    if mean == 0:
        assert set(draws) == {0}
        return
    # mean and variance are both the parameter; the sample mean's standard error is sqrt(mean / n)
    assert sum(draws) / DRAWS == pytest.approx(mean, abs=5 * math.sqrt(mean / DRAWS))
    low = int(stats.poisson.ppf(1e-3, mean))
    counts = collections.Counter(d - low for d in draws if d >= low)
    assert _chi_square_p(counts, lambda k: stats.poisson.pmf(k + low, mean) / stats.poisson.sf(low - 1, mean),
                         int(stats.poisson.ppf(0.999, mean)) - low) > ALPHA


def test_poisson_max_clips():
    rng = random.Random(9)
    draws = [Poisson(10.0, 12).sample(rng) for _ in range(DRAWS)]
    tail = stats.poisson.sf(11, 10.0)
    assert max(draws) == 12
    assert draws.count(12) / DRAWS == pytest.approx(tail, abs=5 * math.sqrt(tail * (1 - tail) / DRAWS))


@settings(max_examples=50)
@given(alpha=st.floats(1.01, 6.0), mean=st.floats(0.0, 1e5), seed=st.integers(0, 2**32))
def test_draws_are_counts_and_reproducible(alpha, mean, seed):
    for dist in (Zipf(alpha, 10_000), Poisson(mean)):
        first = [dist.sample(random.Random(seed)) for _ in range(3)]
        assert first == [dist.sample(random.Random(seed)) for _ in range(3)]
        assert all(isinstance(x, int) and x >= 0 for x in first)


@pytest.mark.parametrize("spec, message", [
    ({"kind": "zipf", "alpha": 1.0}, "zipf alpha must be > 1"),
    ({"kind": "zipf", "alpha": 2, "max": -1}, "zipf max must be >= 0"),
    ({"kind": "zipf"}, "missing key 'alpha'"),
    ({"kind": "poisson", "mean": -1}, "poisson mean must be >= 0"),
    ({"kind": "poisson", "mean": 3, "alpha": 3}, "unknown key 'alpha'"),
])
def test_bad_tables_name_the_field(spec, message):
    with pytest.raises(ValueError, match=f"workload.user_tokens: .*{message}"):
        parse_distribution(spec, "workload.user_tokens")


def test_tables_build_them():
    assert parse_distribution({"kind": "zipf", "alpha": 1.5, "max": 50}, "f") == Zipf(1.5, 50)
    assert parse_distribution({"kind": "poisson", "mean": 12}, "f") == Poisson(12)
