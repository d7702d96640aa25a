"""Runs ``async def`` tests (router, bench) in a fresh event loop each, bounded in time, without a plugin.
Hypothesis tests, which are synchronous, drive tests.router.harness.LoopThread instead.

Light on purpose: it imports only pytest, hypothesis and the standard library (and tests/redis_server.py,
which starts ``redis-server`` only for a test that asks), so ``pytest tests/policy tests/sim`` runs on
the light install (``pip install -e .`` plus pytest and hypothesis; tests/test_light_install.py).

Hypothesis runs under a fixed profile, loaded here before any test module is imported (so every
``@settings(...)`` inherits it):

* ``ci`` (the default): derandomised (the same examples on every run and every machine, so a bug the
  suite can reach is caught on every run, not on some), no example database, no deadline (2 shared
  cores), and 200 examples where a test does not set its own count;
* ``random``: ``ci`` with random examples, drawn from ``--hypothesis-seed`` (so a failure is
  reproduced by running again with that seed); tests/test_random_examples.py runs the invariant tests
  under it on every CI run, with a fresh seed it prints;
* ``explore``: random seeds and the local database, 1,000 examples: for hunting, not for CI;
* ``mutants``: ``ci`` without shrinking, for tools/mutants.py (same examples, faster verdicts);
* pick one with ``HYPOTHESIS_PROFILE=explore``.

The simulator runs from its sources here, compiled build or not (``BIDIKV_PURE_SIM``, sim/native.py).
"""

from __future__ import annotations

import asyncio
import inspect
import os

import pytest
from hypothesis import HealthCheck, Phase, settings

# The suite tests the simulator's sources, even where a compiled build (tools/build_native.py) sits beside
# them: tests wrap methods of simulator objects, which compiled classes refuse. Set before anything
# imports sim (subprocesses inherit it); tests/sim/test_native_build.py checks the compiled build itself.
os.environ["BIDIKV_PURE_SIM"] = "1"

from tests.async_timeout import ASYNC_TEST_TIMEOUT_S
from tests.redis_server import redis_server  # noqa: F401  (a real redis-server per session, for tests that ask)

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=200,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("random", settings.get_profile("ci"), derandomize=False)
# tools/mutants.py: the CI profile's examples, without shrinking (only "does any example fail" matters)
settings.register_profile("mutants", settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}

        async def bounded():
            await asyncio.wait_for(pyfuncitem.obj(**kwargs), ASYNC_TEST_TIMEOUT_S)

        asyncio.run(bounded())
        return True
    return None
