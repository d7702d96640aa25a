"""Client lease-renewal behaviours (sim/clients/renewal.py) against what each one promises."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from calibration.profile import LatencyProfile
from impl.cli import main
from sim.engine.cluster import Cluster
from sim.clients.renewal import ClientRenewal
from sim.engine.config import ClientConfig, SimConfig
from sim.workload import load_workload

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")
# a steady stream (not 24 conversations at once), so P's queue stays far below the lease's slack
SYNTHETIC = {"kind": "synthetic", "num_conversations": 30, "arrival_rate_per_s": 0.05}
# tool calls long enough that many outlast a 30 s lease (the default agent's tools answer in seconds)
AGENTIC = {"kind": "agentic", "num_conversations": 6, "arrival_rate_per_s": 0.02, "steps_per_session": "6..12",
           "tool_latency_s": {"kind": "lognormal", "p50": 40, "p90": 150}, "answer_prob": 0.2}


def _run(workload, seed=1, clients=None, **policy):
    cfg = SimConfig(seed=seed)
    cfg.workload = dict(workload)
    for k, v in policy.items():
        setattr(cfg.policy, k, v)
    for k, v in (clients or {}).items():
        setattr(cfg.clients, k, v)
    cfg.validate()
    convs = load_workload(cfg.workload, cfg.seed)
    return convs, Cluster(cfg, PROFILE).run(convs)


def _gaps(result):
    """Per later turn: (record, seconds since the previous turn of its conversation completed)."""
    by = {(r.conversation, r.turn): r for r in result.records}
    return [(r, r.arrival_s - by[(r.conversation, r.turn - 1)].completion_s) for r in result.records if r.turn > 0]


LEASE = {"retention": "lease", "lease_s": 30.0, "heartbeat_interval_s": 10.0}


@pytest.mark.parametrize("workload", [SYNTHETIC, AGENTIC], ids=["synthetic", "agentic"])
def test_until_next_turn_lease_never_loses_to_the_oracles_reuse(workload):
    _, oracle = _run(workload, retention="oracle", recompute_policy="break_even")
    _, lease = _run(workload, clients={"client_renewal": "until_next_turn"}, kv_recompute_threshold=0,
                    lease_max_hold_s=float("inf"), **LEASE)
    by_turn = {(r.conversation, r.turn): r for r in lease.records}
    reused = [r for r in oracle.records if r.reused_tokens > 0]
    assert reused, "the oracle reused nothing: the comparison would be empty"
    for r in oracle.records:
        assert by_turn[(r.conversation, r.turn)].reused_tokens >= r.reused_tokens, (r.conversation, r.turn)
    # heartbeats did the work: turns after gaps longer than the lease were reused
    assert any(g > 30.0 and r.reused_tokens > 0 for r, g in _gaps(lease))
    assert lease.summary["heartbeats"] > 0


def test_never_is_a_fixed_ttl_of_lease_s_turn_for_turn():
    _, never = _run(SYNTHETIC, clients={"client_renewal": "never"}, **LEASE)
    _, ttl = _run(SYNTHETIC, retention="ttl", decoder_kv_blocks_ttl=30.0)
    assert never.summary["heartbeats"] == 0
    assert [dataclasses.astuple(r) for r in never.records] == [dataclasses.astuple(r) for r in ttl.records]
    gaps = _gaps(ttl)
    # not vacuous: some gaps fit in the 30 s (reused), some do not (recomputed)
    assert any(r.reused_tokens > 0 for r, _ in gaps) and any(g > 30.0 for _, g in gaps)
    # and a client that does renew is not a fixed TTL on the same workload
    _, open_ = _run(SYNTHETIC, clients={"client_renewal": "while_open"}, **LEASE)
    assert open_.summary["tokens_reused"] > ttl.summary["tokens_reused"]


def test_while_open_with_zero_linger_reuses_no_gap_longer_than_lease_s():
    zero = {"client_renewal": "while_open", "client_linger_p50_s": 0.0, "client_linger_p90_s": 0.0}
    _, result = _run(SYNTHETIC, clients=zero, **LEASE)
    gaps = _gaps(result)
    assert result.summary["heartbeats"] == 0
    assert sum(1 for _, g in gaps if g > 30.0) > 20
    assert all(r.reused_tokens == 0 for r, g in gaps if g > 30.0)
    assert any(r.reused_tokens > 0 for r, g in gaps if g < 20.0)
    # a session that stays open longer than every gap of this run renews through all of them
    longest = max(g for _, g in gaps)
    long_open = {"client_renewal": "while_open", "client_linger_p50_s": longest + 60, "client_linger_p90_s": longest + 60}
    _, kept = _run(SYNTHETIC, clients=long_open, **{**LEASE, "lease_max_hold_s": longest + 60})
    assert all(r.reused_tokens > 0 for r, g in _gaps(kept) if g > 30.0)


def test_tool_calls_renews_while_a_tool_runs_and_not_after_an_answer():
    convs, result = _run(AGENTIC, clients={"client_renewal": "tool_calls"}, **LEASE)
    turns = {(c.conversation_id, i): t for c in convs for i, t in enumerate(c.turns)}
    after_tool = [(r, g) for r, g in _gaps(result) if turns[(r.conversation, r.turn - 1)].tool_call and g > 30.0]
    after_answer = [(r, g) for r, g in _gaps(result) if not turns[(r.conversation, r.turn - 1)].tool_call and g > 30.0]
    assert len(after_tool) > 5 and len(after_answer) > 2
    assert result.summary["dropped_under_pressure"] == 0
    assert all(r.reused_tokens > 0 for r, _ in after_tool)
    assert all(r.reused_tokens == 0 for r, _ in after_answer)


def test_a_chat_trace_has_no_tool_calls_so_tool_calls_is_never():
    _, tool = _run(SYNTHETIC, clients={"client_renewal": "tool_calls"}, **LEASE)
    _, never = _run(SYNTHETIC, clients={"client_renewal": "never"}, **LEASE)
    assert [dataclasses.astuple(r) for r in tool.records] == [dataclasses.astuple(r) for r in never.records]


def test_client_behaviour_changes_nothing_without_a_lease_and_lingers_are_per_turn_streams():
    # a TTL reads no heartbeat: the behaviour (and its linger stream) must not touch any other stream
    _, a = _run(SYNTHETIC, clients={"client_renewal": "while_open"}, decoder_kv_blocks_ttl=60.0)
    _, b = _run(SYNTHETIC, clients={"client_renewal": "until_next_turn"}, decoder_kv_blocks_ttl=60.0)
    assert [dataclasses.astuple(r) for r in a.records] == [dataclasses.astuple(r) for r in b.records]
    # same seed, same lease run, byte for byte
    _, c = _run(SYNTHETIC, clients={"client_renewal": "while_open"}, **LEASE)
    _, d = _run(SYNTHETIC, clients={"client_renewal": "while_open"}, **LEASE)
    assert [repr(dataclasses.astuple(r)) for r in c.records] == [repr(dataclasses.astuple(r)) for r in d.records]
    convs = load_workload(SYNTHETIC, 1)
    one, other = ClientRenewal(ClientConfig(), 1), ClientRenewal(ClientConfig(), 1)
    assert one.linger_s(convs[3], 2) == other.linger_s(convs[3], 2)  # whatever was drawn before
    assert one.linger_s(convs[3], 2) != one.linger_s(convs[3], 3) != one.linger_s(convs[4], 3)


def test_linger_follows_the_stated_median_and_p90():
    renewal = ClientRenewal(ClientConfig(client_linger_p50_s=100.0, client_linger_p90_s=400.0), 0)
    conv = load_workload(SYNTHETIC, 0)[0]
    draws = sorted(renewal.linger_s(dataclasses.replace(conv, conversation_id=f"x{i}"), 0) for i in range(4000))
    assert statistics.median(draws) == pytest.approx(100.0, rel=0.08)
    assert draws[int(0.9 * len(draws))] == pytest.approx(400.0, rel=0.1)


@pytest.mark.parametrize("p50, p90, message", [(100.0, 50.0, "client_linger_p90_s"), (0.0, 50.0, "client_linger_p50_s"),
                                               (-1.0, 10.0, "client_linger_p50_s")])
def test_bad_linger_names_the_field(p50, p90, message):
    cfg = SimConfig()
    cfg.clients.client_linger_p50_s, cfg.clients.client_linger_p90_s = p50, p90
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_cli_flag_reaches_the_clients(capsys):
    base = ["simulate", "--json", "--conversations", "4", "--retention", "lease"]
    assert main([*base, "--client-renewal", "never"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["on"]["heartbeats"] == 0
    assert main([*base, "--client-renewal", "until_next_turn"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["on"]["heartbeats"] > 0
