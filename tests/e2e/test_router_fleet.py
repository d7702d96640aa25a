"""Two router replicas sharing one real Redis (``--store redis://``) in front of the shared P and D.

A 3-turn chat whose turns alternate between the replicas pulls D's blocks on turns 2 and 3 -- each turn
finds the previous one although another process stored it, on vLLM 0.32's path (D's connector notifies
the replica that ran the turn) -- and answers exactly as the plain reference server.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.e2e.client import chat
from tests.e2e.conftest import E2E, counters_at, unique_system
from tests.e2e.deployment import delta, router_process, wait_healthy
from tests.e2e.test_bidirectional import LONG, assert_pulled_from_d, reference_text, user
from tests.redis_server import unique_prefix


@pytest.fixture(scope="module")
def replicas(e2e: E2E, redis_server):
    prefix = unique_prefix()
    routers = []
    for i in range(2):
        router = router_process(e2e.prefill, e2e.decode, e2e.deployment.spec, e2e.log_dir, name=f"router-fleet{i}")
        # a loaded machine can stall Redis past the default 0.5 s: this test is about reuse, not timeouts
        router.cmd += ["--store", redis_server.url, "--store-prefix", prefix, "--store-timeout-s", "10"]
        routers.append(router)
    try:
        for router in routers:
            router.start()
        wait_healthy(routers, 60.0)
        yield [r.url for r in routers]
    finally:
        for router in routers:
            router.stop()


def settled_delta(e2e: E2E, router: str, before: dict) -> dict:
    """Counters after a turn minus ``before`` once vLLM has published the turn's reads and D's notification
    of the turn has reached the router (deadline polling: D posts it after the client has its answer)."""
    deadline = time.monotonic() + 10.0
    while True:
        after = counters_at(e2e.prefill, e2e.decode, router)
        d = {k: delta(after[k], before[k]) for k in after}
        if ((all(d[n]["external_tokens"] == 0 or d[n]["xfers"] >= 1 for n in ("p", "d")) and d["router"]["stored_notify"] >= 1)
                or time.monotonic() > deadline):
            return d
        time.sleep(0.25)


def test_three_turns_alternating_replicas_pull_on_turns_2_and_3(e2e: E2E, replicas: list[str]):
    cid = f"fleet-{uuid.uuid4().hex}"
    messages = [unique_system("fleet"), user("Tell me how a sailing ship tacks against the wind, in detail. " * 3)]
    questions = ["And how does the crew handle the sails? " * 3, "What happens in a storm? " * 3]
    for turn in (1, 2, 3):
        router = replicas[(turn - 1) % 2]  # 1 -> replica 0, 2 -> replica 1, 3 -> replica 0
        before = counters_at(e2e.prefill, e2e.decode, router)
        got = chat(router, messages, max_tokens=LONG, conversation_id=cid)
        d = settled_delta(e2e, router, before)
        print(f"\nturn {turn} via replica {(turn - 1) % 2}: P {d['p']}; router {d['router']}")
        assert got.text == reference_text(e2e, messages, LONG), f"turn {turn}: text differs from the reference"
        if turn > 1:
            assert_pulled_from_d(d, turn)  # the other replica's stored entry was found and P read D's blocks
        assert d["router"]["stored_notify"] == 1, f"turn {turn}: D's notification did not reach its replica: {d}"
        if turn < 3:
            messages = messages + [{"role": "assistant", "content": got.text}, user(questions[turn - 1])]
