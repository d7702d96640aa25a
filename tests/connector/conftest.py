"""Fixtures of impl.connector's tests. The scheduler/worker tests need vLLM (0.32 here; 0.33 through
tests/connector/test_vllm033.py) and NIXL, both part of the test setup: missing is a failure, not a skip.
The config, notification and compat tests are pure."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The tiny model's directory; the scheduler only reads its config.json."""
    from tests.e2e.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
