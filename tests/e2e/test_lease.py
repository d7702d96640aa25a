"""A heartbeat-renewed lease on a real D: client -> router -> D's listener -> the scheduler -> the
NIXL worker's deadline.

A second, module-scoped P + D + router runs D with ``bidikv_retention: "lease"`` (12 s) and its
heartbeat listener; texts are checked against the shared reference server. Two conversations finish
a turn at the same time; one is heartbeated every 3 s, the other not. 20 s later (past the lease, and
past P's 5 s expiry margin) the heartbeated one still pulls D's blocks and matches the reference, the
other recomputes. D's own ``vllm:nixl_num_kv_expired_reqs`` shows the worker released exactly one
conversation's blocks: the renewed deadline reached the worker, which would otherwise have freed
blocks the router still offers.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest

from tests.e2e.client import chat
from tests.e2e.conftest import E2E, counters_at, unique_system
from tests.e2e.deployment import DeploymentSpec, delta, free_listen_port, pull_counters, start_deployment
from tests.e2e.test_bidirectional import LONG, SHORT, assert_no_pull, reference_text, user

LEASE_S = 12.0
HEARTBEAT_EVERY_S = 3.0
TURN_GAP_S = 20.0


@pytest.fixture(scope="module")
def leased(e2e: E2E):
    spec = DeploymentSpec(
        threshold=e2e.threshold, decoder_ttl_s=120.0, reference=False, router=True,
        prefill_args=["--no-enable-prefix-caching"],  # as the shared deployment: D's blocks are the reuse
        decode_extra={"bidikv_retention": "lease", "bidikv_lease_s": LEASE_S,
                      "bidikv_heartbeat_interval_s": HEARTBEAT_EVERY_S, "bidikv_lease_max_hold_s": 120.0,
                      "bidikv_heartbeat_port": free_listen_port()})
    dep = start_deployment(e2e.model_dir, e2e.log_dir / "lease", spec)
    try:
        yield dep
    finally:
        dep.stop()


def heartbeat(router: str, cid: str) -> dict:
    req = urllib.request.Request(f"{router}/v1/conversations/{cid}/heartbeat", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_heartbeats_keep_ds_blocks_past_the_lease(e2e: E2E, leased):
    router = leased.router.url
    kept, lapsed = f"kept-{uuid.uuid4().hex}", f"lapsed-{uuid.uuid4().hex}"
    talks = {kept: [unique_system("kept"), user("Explain how a lock and key work, step by step. " * 3)],
             lapsed: [unique_system("lapsed"), user("Explain how a zipper works, step by step. " * 3)]}
    # a first pair of turns makes both NIXL handshakes before the timed part
    for cid, messages in talks.items():
        first = chat(router, messages, max_tokens=LONG, conversation_id=cid, timeout=180)
        messages += [{"role": "assistant", "content": first.text}, user("Go on, in more detail. " * 5)]
    warm = counters_at(leased.prefill.url, leased.decode.url, leased.router.url)
    # turn 2 of both: the lease starts when these finish
    for cid, messages in talks.items():
        second = chat(router, messages, max_tokens=LONG, conversation_id=cid, timeout=180)
        messages += [{"role": "assistant", "content": second.text}, user("And what can go wrong? " * 5)]
    started = time.monotonic()
    before = counters_at(leased.prefill.url, leased.decode.url, leased.router.url)
    assert before["router"]["hits"] - warm["router"]["hits"] == 2, "turn 2 was not offered D's blocks"

    answers = []
    while time.monotonic() - started < TURN_GAP_S:
        answers.append(heartbeat(router, kept))
        time.sleep(HEARTBEAT_EVERY_S)
    assert all(a["renewed"] for a in answers), answers
    assert answers[-1]["expires_in_s"] > 5.0, answers[-1]
    # D's worker has released the lapsed conversation's blocks (its lease ended 8 s ago), not the others
    d_expired = pull_counters(leased.decode.url)["expired"] - before["d"]["expired"]
    assert d_expired == 1, f"D released {d_expired} leases, expected only the lapsed conversation's"

    results = {}
    for cid in (kept, lapsed):
        step = counters_at(leased.prefill.url, leased.decode.url, leased.router.url)
        got = chat(router, talks[cid], max_tokens=SHORT, conversation_id=cid, timeout=180)
        time.sleep(1.5)  # vLLM publishes a read's NIXL stats a step later
        after = counters_at(leased.prefill.url, leased.decode.url, leased.router.url)
        results[cid] = {"p": delta(after["p"], step["p"]), "hits": after["router"]["hits"] - step["router"]["hits"]}
        assert got.text == reference_text(e2e, talks[cid], SHORT), f"{cid}: text differs from the reference"

    assert results[kept]["hits"] == 1, results
    assert results[kept]["p"]["external_tokens"] >= e2e.threshold and results[kept]["p"]["xfers"] >= 1, results
    assert results[kept]["p"]["failed"] == 0, results
    assert results[lapsed]["hits"] == 0, results
    assert_no_pull({"p": results[lapsed]["p"]}, 3)
