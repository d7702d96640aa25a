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
