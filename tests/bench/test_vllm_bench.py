"""``bidikv bench --vllm-multi-turn-config`` against the router in front of scripted upstreams, and the
same run described by ``bidikv simulate`` (the real-vLLM run is in tests/e2e/test_bench_cpu.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from sim.bench.cli import plan_from_args
from sim.bench.config import BenchConfig
from sim.bench.vllm_clients import run_vllm_bench
from impl.cli import build_parser
from sim.clients.bench import VllmClientConfig, config_from_workload
from sim.commands.simulate import config_from_args
from sim.engine.runner import run_config
from sim.workload import load_workload
from sim.workload.model import Conversation, Turn
from sim.workload.vllm_multi_turn import user_tokens
from tests.router.harness import Deployment
from tests.workload.test_vllm_multi_turn import EXAMPLE

FLAGS = ["--vllm-multi-turn-config", str(EXAMPLE), "--seed", "5", "--num-clients", "2",
         "--max-active-conversations", "4", "--no-early-stop", "--max-turns", "6"]


def test_simulate_and_bench_read_the_same_run_from_the_same_flags():
    sim_args = build_parser().parse_args(["simulate", *FLAGS])
    bench_args = build_parser().parse_args(["bench", "--url", "http://x", "--mode", "on", *FLAGS])
    config = config_from_args(sim_args)
    workload, seed, num_clients = plan_from_args(bench_args)
    assert (workload, seed, num_clients) == (config.workload, config.seed, config.num_clients) == (
        {"kind": "vllm_multi_turn", "path": str(EXAMPLE), "max_active_conversations": 4, "early_stop": False,
         "max_turns": 6}, 5, 2)
    assert load_workload(workload, seed) == load_workload(config.workload, config.seed)
    assert config_from_workload(workload) == VllmClientConfig(max_active_conversations=4, early_stop=False, max_turns=6)


def test_client_flags_need_the_vllm_config():
    with pytest.raises(ValueError, match="--max-active-conversations is one of vLLM's benchmark client flags"):
        config_from_args(build_parser().parse_args(["simulate", "--max-active-conversations", "4"]))
    with pytest.raises(ValueError, match="--num-clients is vLLM's client flag"):
        plan_from_args(build_parser().parse_args(["bench", "--url", "u", "--mode", "on", "--num-clients", "2"]))
    with pytest.raises(ValueError, match="--conversations does not apply to a vLLM config"):
        config_from_args(build_parser().parse_args(["simulate", "--vllm-multi-turn-config", str(EXAMPLE),
                                                    "--conversations", "3"]))


def _small_config(tmp_path, conversations=3):
    data = json.loads(EXAMPLE.read_text())
    data["num_conversations"] = conversations
    data["prompt_input"]["num_turns"] = {"distribution": "uniform", "min": 4, "max": 8}
    data["prompt_input"]["common_prefix_num_tokens"] = {"distribution": "constant", "value": 32}
    data["prompt_input"]["prefix_num_tokens"] = {"distribution": "lognormal", "average": 60, "max": 200}
    data["prompt_input"]["num_tokens"] = {"distribution": "uniform", "min": 10, "max": 20}
    data["prompt_output"]["num_tokens"] = {"distribution": "uniform", "min": 6, "max": 9}
    path = tmp_path / "multi_turn.json"
    path.write_text(json.dumps(data))
    return path


async def test_bench_sends_the_simulators_requests_in_the_simulators_order(tmp_path):
    path = _small_config(tmp_path)
    workload = {"kind": "vllm_multi_turn", "path": str(path), "max_active_conversations": 3, "early_stop": False}
    conversations = load_workload(workload, 11)
    client_config = config_from_workload(workload)
    from sim.engine.config import SimConfig

    sim_config = SimConfig(seed=11, num_clients=1)
    sim_config.workload = workload
    simulated = run_config(sim_config.validate())
    sim_order = [(r.conversation, r.turn) for r in sorted(simulated.records, key=lambda r: r.arrival_s)]

    async with Deployment(style="final_chunk", chunks=4) as dep:  # the fake D answers 4 tokens, whatever max_tokens
        config = BenchConfig(url=dep.url, mode="on", seed=11)
        records = await run_vllm_bench(config, conversations, client_config, num_clients=1)
        decode_bodies = dep.d.decode_requests()
    assert all(r.ok for r in records)
    assert [(r.conversation, r.turn) for r in records] == sim_order  # one client: the same interleaving

    # vLLM's request: max_tokens only (the dataset's answer length), no min_tokens, no ignore_eos
    plan = {(c.conversation_id, k): t for c in conversations for k, t in enumerate(c.turns)}
    assert decode_bodies and all("min_tokens" not in b and "ignore_eos" not in b for b in decode_bodies)
    assert sorted(b["max_tokens"] for b in decode_bodies) == sorted(plan[(r.conversation, r.turn)].output_tokens
                                                                    for r in records)
    # each prompt is the previous prompt, the answer the server gave (4 tokens here) and the planned user
    # message: the simulator's plan less what the answers fell short of max_tokens
    by_conv = {c.conversation_id: c for c in conversations}
    for r in records:
        conv = by_conv[r.conversation]
        shortfall = sum(t.output_tokens - 4 for t in conv.turns[:r.turn])
        assert r.prompt_tokens == plan[(r.conversation, r.turn)].prompt_tokens - shortfall
        assert r.output_tokens == 4
    assert [user_tokens(c)[0] for c in conversations] == [c.turns[0].prompt_tokens for c in conversations]


async def test_the_common_prefix_is_the_same_ids_in_every_conversation(tmp_path):
    path = _small_config(tmp_path, conversations=2)
    workload = {"kind": "vllm_multi_turn", "path": str(path), "max_active_conversations": 2, "early_stop": False}
    conversations = load_workload(workload, 3)
    async with Deployment(style="final_chunk", chunks=2) as dep:
        await run_vllm_bench(BenchConfig(url=dep.url, mode="on", seed=3), conversations,
                             config_from_workload(workload), num_clients=2)
        first_lengths = {c.turns[0].prompt_tokens for c in conversations}
        firsts = [b["prompt"] for b in dep.p.prefill_requests() if len(b["prompt"]) in first_lengths]
    assert len(firsts) == 2 and len(first_lengths) == 2
    assert firsts[0][:32] == firsts[1][:32]  # the shared system prompt
    assert firsts[0][32:] != firsts[1][32:]  # then each conversation's own


def _hand_built(lengths):
    """Conversations of the given request counts: 20-token first prompts, 10-token user messages, 5-token answers."""
    out = []
    for i, n in enumerate(lengths):
        turns, prompt = [], 20
        for _ in range(n):
            turns.append(Turn(prompt, 5))
            prompt += 5 + 10
        out.append(Conversation(f"c{i}", 0.0, tuple(turns)))
    return out


@pytest.mark.parametrize("early_stop", [True, False])
async def test_early_stop_ends_the_bench_when_the_first_client_stops(early_stop):
    # 2 clients, 1 active each: client 0 takes c0 then c2 (one request each) and stops when it meets the end
    # of the queue, while client 1 is inside c1 (6 requests): with early stop c1 is cut short
    conversations = _hand_built([1, 6, 1])
    async with Deployment(style="final_chunk", chunks=2) as dep:
        records = await run_vllm_bench(BenchConfig(url=dep.url, mode="on", seed=2), conversations,
                                       VllmClientConfig(early_stop=early_stop), num_clients=2)
    sent = {(r.conversation, r.turn) for r in records}
    assert {("c0", 0), ("c2", 0), ("c1", 0)} <= sent
    if early_stop:
        assert len(sent) < 8
        last_start_c1 = max(r.start_s for r in records if r.conversation == "c1")
        assert last_start_c1 < max(r.start_s + r.total_s for r in records if r.conversation == "c2")
    else:
        assert len(sent) == 8


def test_bench_cli_runs_a_vllm_config_end_to_end(tmp_path, capsys):
    path = _small_config(tmp_path)
    out = tmp_path / "bench.jsonl"

    async def serve_and_run():
        async with Deployment(style="final_chunk", chunks=3) as dep:
            from impl.cli import main

            return await asyncio.to_thread(main, ["bench", "--url", dep.url, "--mode", "on", "--vllm-multi-turn-config",
                                                  str(path), "--num-clients", "1", "--no-early-stop", "--out", str(out)])

    assert asyncio.run(serve_and_run()) == 0
    lines = out.read_text().splitlines()
    assert lines and all(json.loads(line)["output_tokens"] == 3 for line in lines)
    assert "failed" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--concurrency", "3"), ("--max-rate", "2"), ("--gap-scale", "1"),
                                         ("--max-model-len", "100")])
def test_the_plain_pools_flags_are_refused_with_vllms_client_loop(flag, value):
    args = build_parser().parse_args(["bench", "--url", "u", "--mode", "on", "--vllm-multi-turn-config", str(EXAMPLE),
                                      flag, value])
    with pytest.raises(ValueError, match=f"{flag} does not apply to vLLM's client loop"):
        plan_from_args(args)


@pytest.mark.parametrize("run_ids", [("run-a", "run-b"), ("same", "same")])
async def test_two_runs_with_their_own_run_ids_never_reuse_each_other(tmp_path, run_ids):
    """vLLM's benchmark names its conversations alike in every run; the bench scopes them by run. With one
    run id repeated, the second run's first turns find the first run's entries (refused by the guard here,
    since the fake D's answers differ; offered, on a real deployment, when the histories agree)."""
    path = _small_config(tmp_path, conversations=2)
    workload = {"kind": "vllm_multi_turn", "path": str(path), "max_active_conversations": 2, "early_stop": False}
    conversations = load_workload(workload, 3)
    async with Deployment(style="final_chunk", chunks=4) as dep:
        for run_id in run_ids:
            config = BenchConfig(url=dep.url, mode="on", seed=3, run_id=run_id)
            records = await run_vllm_bench(config, conversations, config_from_workload(workload), num_clients=1)
            assert all(r.ok for r in records)
        misses = dep.router.metrics.reuse_misses
        # every first turn is "unknown" to the store only if no earlier run left an entry under its id
        first_turns_unknown = misses.get("unknown")
        assert first_turns_unknown == (2 if run_ids[0] != run_ids[1] else 1) * len(conversations)
