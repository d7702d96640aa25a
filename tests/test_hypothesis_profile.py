"""CI runs hypothesis derandomised under the profile tests/conftest.py loads, so a failure reproduces."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings


@pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci", reason="another profile chosen by hand")
def test_ci_profile_is_loaded_and_derandomised():
    current = settings()
    assert settings._current_profile == "ci"
    assert current.derandomize is True and current.database is None and current.deadline is None
    assert current.max_examples >= 200


def test_the_random_profile_is_ci_with_random_examples():
    # tests/test_random_examples.py runs under it: new examples each run, the same budget and no database
    ci, random = settings.get_profile("ci"), settings.get_profile("random")
    assert random.derandomize is False and random.database is None and random.deadline is None
    assert random.max_examples == ci.max_examples and random.suppress_health_check == ci.suppress_health_check
