"""Runs ``async def`` tests (router, bench) in a fresh event loop each, bounded in time, without a plugin.
Hypothesis tests, which are synchronous, drive tests.router.harness.LoopThread instead."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from tests.router.harness import ASYNC_TEST_TIMEOUT_S


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}

        async def bounded():
            await asyncio.wait_for(pyfuncitem.obj(**kwargs), ASYNC_TEST_TIMEOUT_S)

        asyncio.run(bounded())
        return True
    return None
