"""How long one ``async def`` test (tests/conftest.py), or one coroutine a synchronous test runs on
tests.router.harness.LoopThread, may take. Its own module, free of aiohttp, so that the conftest every
test loads stays importable on the light install (``pip install -e .`` plus pytest and hypothesis)."""

ASYNC_TEST_TIMEOUT_S = 30.0
