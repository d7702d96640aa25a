"""vLLM's multi-turn benchmark client loop (sim/clients/bench.py): the rule alone, under any timing
hypothesis picks, then inside the simulator.

The timing-free driver below plays the part of the network: every idle client asks for its next
request at once, and hypothesis chooses which request in flight completes next (and whether it fails).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings, strategies as st

from calibration.profile import LatencyProfile
from sim.clients.bench import VllmClientConfig, client_limits, make_clients, start
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.engine.runner import run_config
from sim.workload import load_workload
from sim.workload.model import Conversation, Turn
from tests.workload.test_vllm_multi_turn import EXAMPLE


def _conversations(lengths):
    return [Conversation(f"c{i}", 0.0, tuple(Turn(100 + 10 * k, 5) for k in range(n))) for i, n in enumerate(lengths)]


@dataclasses.dataclass
class Event:
    step: int
    client: int
    kind: str  # "send", "done", "exit"
    conversation: str = ""
    index: int = -1


def drive(conversations, config, num_clients, choose, fails=lambda step: False):
    """Run the clients with no clock: ``choose(n)`` picks which of n requests in flight completes next."""
    clients = make_clients(config, num_clients, conversations, seed=0)
    events, in_flight, step = [], [], 0

    def ask(client):
        request = client.next_request()
        if request is None:
            events.append(Event(step, client.client_id, "exit"))
        else:
            events.append(Event(step, client.client_id, "send", request[0].conversation_id, request[1]))
            in_flight.append((client, request))

    for client in clients:
        ask(client)
    while in_flight:
        step += 1
        client, (conv, index) = in_flight.pop(choose(len(in_flight)))
        ok = not fails(step)
        events.append(Event(step, client.client_id, "done" if ok else "failed", conv.conversation_id, index))
        client.done(ok=ok)
        ask(client)
    return events, clients


def test_one_client_follows_vllms_loop_by_hand():
    # Read off benchmark_serving_multi_turn.py's client_main for 1 client, 2 active conversations,
    # A (2 requests), B (1), C (2), D (1): take A, B -> deque [A, B]; pop B (newest first), B done;
    # refill C -> [A, C]; pop C; C back on the left -> [C, A]; pop A -> [A, C]; pop C, C done; refill
    # D -> [A, D]; pop D, D done; refill meets the end of the queue -> the client stops with A unfinished.
    convs = [Conversation(name, 0.0, tuple(Turn(10, 2) for _ in range(n))) for name, n in
             (("A", 2), ("B", 1), ("C", 2), ("D", 1))]
    events, clients = drive(convs, VllmClientConfig(max_active_conversations=2), 1, lambda n: 0)
    sent = [(e.conversation, e.index) for e in events if e.kind == "send"]
    assert sent == [("B", 0), ("C", 0), ("A", 0), ("C", 1), ("D", 0)]
    assert clients[0].exit_reason == "no conversation left to take"


def test_one_active_conversation_per_client_is_the_plain_pool():
    # 3 clients, 1 active each, no early stop: every conversation runs to its end, one at a time per client
    convs = _conversations([3, 1, 4, 2, 2, 5])
    events, _ = drive(convs, VllmClientConfig(early_stop=False), 3, lambda n: n - 1)
    sent = [(e.conversation, e.index) for e in events if e.kind == "send"]
    assert sorted(sent) == sorted((c.conversation_id, k) for c in convs for k in range(len(c.turns)))


@st.composite
def scenarios(draw):
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=12))
    num_clients = draw(st.integers(1, len(lengths)))
    per_client = draw(st.integers(1, max(1, len(lengths) // num_clients)))
    config = VllmClientConfig(max_active_conversations=per_client * num_clients, early_stop=draw(st.booleans()),
                              max_num_requests=draw(st.sampled_from([0, 0, num_clients * draw(st.integers(1, 8))])),
                              max_turns=draw(st.sampled_from([0, 0, 1, 2, 3, 5])))
    picks = draw(st.lists(st.integers(0, 10**6), min_size=200, max_size=200))
    failures = draw(st.sets(st.integers(1, 60), max_size=3))
    return lengths, num_clients, per_client, config, picks, failures


def _run_scenario(scenario):
    lengths, num_clients, per_client, config, picks, failures = scenario
    convs = _conversations(lengths)
    it = iter(picks * 10)
    events, clients = drive(convs, config, num_clients, lambda n: next(it) % n, lambda step: step in failures)
    return convs, events, clients


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_client_loop_properties(scenario):
    lengths, num_clients, per_client, config, _, failures = scenario
    convs, events, clients = _run_scenario(scenario)
    by_id = {c.conversation_id: c for c in convs}
    sends = [e for e in events if e.kind == "send"]

    # each conversation's requests go out in order 0, 1, 2, ... from a single client, one at a time
    owner, next_index, busy = {}, {}, set()
    for e in events:
        if e.kind == "send":
            assert owner.setdefault(e.conversation, e.client) == e.client
            assert e.index == next_index.get(e.conversation, 0)
            assert e.conversation not in busy
            next_index[e.conversation] = e.index + 1
            busy.add(e.conversation)
        elif e.kind in ("done", "failed"):
            busy.discard(e.conversation)
    # a failed request drops its conversation: it never comes back
    for e in events:
        if e.kind == "failed":
            assert not [s for s in sends if s.conversation == e.conversation and s.step > e.step]

    # --max-turns counts messages: a conversation never sends beyond ceil(max_turns / 2) requests
    for conv_id, count in next_index.items():
        assert count <= len(by_id[conv_id].turns)
        if config.max_turns:
            assert count <= math.ceil(config.max_turns / 2)

    for client in clients:
        mine = [e for e in events if e.client == client.client_id]
        # never more than K // N conversations started and unfinished per client
        open_ = set()
        for e in mine:
            if e.kind == "send":
                open_.add(e.conversation)
                assert len(open_) <= per_client
            elif e.kind in ("done", "failed"):
                conv = by_id[e.conversation]
                limit = len(conv.turns) if not config.max_turns else min(len(conv.turns), math.ceil(config.max_turns / 2))
                if e.kind == "failed" or e.index + 1 == limit:
                    open_.discard(e.conversation)
        # round robin: between two consecutive requests of one conversation no other goes twice
        order = [e.conversation for e in mine if e.kind == "send"]
        last_seen = {}
        for position, conv_id in enumerate(order):
            if conv_id in last_seen:
                between = order[last_seen[conv_id] + 1:position]
                assert len(between) == len(set(between)), (conv_id, order)
            last_seen[conv_id] = position
        # --max-num-requests is split over the clients
        if config.max_num_requests:
            assert sum(e.kind == "send" for e in mine) <= config.max_num_requests // num_clients
        assert sum(e.kind == "exit" for e in mine) == 1

    first_exit = min(e.step for e in events if e.kind == "exit")
    late_sends = [e for e in sends if e.step > first_exit]
    if config.early_stop:
        # early stop: once a client stops, nobody starts another request (those in flight finish)
        assert late_sends == []
    elif not failures:
        # without it, a client stops only at its request limit or on meeting the end of the queue (a
        # conversation it took but had not served yet is abandoned then, as in vLLM)
        assert {c.exit_reason for c in clients} <= {"request limit", "no conversation left to take"}


def test_a_client_stops_when_it_meets_the_end_of_the_queue_with_conversations_active():
    # 1 client, 3 active: after the first conversation finishes the client refills, meets the end of
    # the queue, and stops though 2 conversations are unfinished (vLLM's `if ... or task_queue_empty: break`)
    convs = _conversations([1, 4, 4])
    events, clients = drive(convs, VllmClientConfig(max_active_conversations=3, early_stop=False), 1, lambda n: 0)
    sent = [(e.conversation, e.index) for e in events if e.kind == "send"]
    assert sent == [("c2", 0), ("c1", 0), ("c0", 0)]
    assert clients[0].exit_reason == "no conversation left to take"
    # a conversation taken but not served yet is abandoned too: c0 never sends a request
    events, _ = drive(_conversations([1, 1]), VllmClientConfig(max_active_conversations=2, early_stop=False), 1,
                      lambda n: 0)
    assert [(e.conversation, e.index) for e in events if e.kind == "send"] == [("c1", 0)]


@pytest.mark.parametrize("config, clients, conversations, message", [
    (VllmClientConfig(max_active_conversations=1), 2, 4, "--max-active-conversations 1 must be >= --num-clients 2"),
    (VllmClientConfig(max_active_conversations=9), 2, 4, "--max-active-conversations 9 must be <= the number"),
    (VllmClientConfig(), 5, 4, "--num-clients 5 needs at least as many conversations"),
    (VllmClientConfig(max_num_requests=1), 2, 4, "--max-num-requests 1 must be at least one per client"),
])
def test_vllms_checks_name_the_flag(config, clients, conversations, message):
    with pytest.raises(ValueError, match=message):
        client_limits(config, clients, conversations)


def test_defaults_are_vllms():
    limits = client_limits(VllmClientConfig(), 0, 24)
    assert (limits.num_clients, limits.active_per_client, limits.early_stop) == (1, 1, True)
    assert limits.requests_per_client is None and limits.max_messages is None and limits.request_rate == 0
    assert client_limits(VllmClientConfig(max_active_conversations=6), 2, 24).active_per_client == 3


def test_request_rate_sleeps_exponential_minus_the_request_time():
    convs = _conversations([3])
    client = make_clients(VllmClientConfig(request_rate=2.0), 1, convs, seed=4)[0]
    pauses = [client.pause_s(0.1) for _ in range(20_000)]
    assert sum(pauses) / len(pauses) == pytest.approx(0.5 - 0.1, rel=0.03)  # mean 1/rate - duration
    assert client.pause_s(0.7) == 0.0  # a request longer than 1/rate: no sleep
    assert make_clients(VllmClientConfig(), 1, convs, seed=4)[0].pause_s(0.1) == 0.0


# -- inside the simulator -------------------------------------------------------------------------

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")


def _simulate(seed=2, num_clients=2, **client_flags):
    config = SimConfig(seed=seed, num_clients=num_clients)
    config.workload = {"kind": "vllm_multi_turn", "path": str(EXAMPLE), **client_flags}
    config.validate()
    return load_workload(config.workload, seed), run_config(config, profile=PROFILE)


def test_simulated_clients_send_back_to_back_and_at_most_one_request_each():
    convs, result = _simulate(max_active_conversations=6)
    records = sorted(result.records, key=lambda r: (r.arrival_s, r.conversation, r.turn))
    assert records and not any(r.rejected for r in records)
    completions = sorted(r.completion_s for r in records)
    for r in records[2:]:
        # no think time: every request after the first two (one per client) starts when another ended
        assert r.arrival_s in completions
    events = sorted([(r.arrival_s, 1) for r in records] + [(r.completion_s, -1) for r in records])
    running = 0
    for _, delta in events:  # at a shared instant the ending request leaves before the next one starts
        running += delta
        assert running <= 2


def test_early_stop_in_the_simulator_ends_the_run_when_the_first_client_stops():
    # 2 clients, 1 active each: client 0 takes c0 then c2 (one request each) and stops when it meets the
    # end of the queue; client 1 is inside c1 (6 requests) by then
    convs = _conversations([1, 6, 1])
    results = {}
    for early_stop in (True, False):
        config = VllmClientConfig(early_stop=early_stop)
        cluster = Cluster(SimConfig(seed=1), PROFILE)
        results[early_stop] = cluster.run(convs, clients=lambda c, cv: start(c, cv, config, 2, 1))
    stopped = {(r.conversation, r.turn) for r in results[True].records}
    full = {(r.conversation, r.turn) for r in results[False].records}
    assert full == {(c.conversation_id, k) for c in convs for k in range(len(c.turns))}
    first_stop = max(r.completion_s for r in results[True].records if r.conversation in ("c0", "c2"))
    # with early stop client 1 finishes the request it had in flight and sends no other
    assert {("c0", 0), ("c2", 0), ("c1", 0)} <= stopped < full
    assert all(r.arrival_s < first_stop for r in results[True].records)
    assert not any(r.rejected for r in results[True].records)  # unsent turns are absent, not "rejected"


def test_one_client_in_the_simulator_sends_in_the_rules_order():
    convs, result = _simulate(num_clients=1, max_active_conversations=3, early_stop=False)
    events, _ = drive(convs, VllmClientConfig(max_active_conversations=3, early_stop=False), 1, lambda n: 0)
    expected = [(e.conversation, e.index) for e in events if e.kind == "send"]
    simulated = [(r.conversation, r.turn) for r in sorted(result.records, key=lambda r: r.arrival_s)]
    assert simulated == expected


def test_same_config_and_seed_same_records_and_oracle_refused():
    _, a = _simulate(max_active_conversations=4)
    _, b = _simulate(max_active_conversations=4)
    assert [dataclasses.astuple(r) for r in a.records] == [dataclasses.astuple(r) for r in b.records]
    config = SimConfig(num_clients=2)
    config.workload = {"kind": "vllm_multi_turn", "path": str(EXAMPLE)}
    config.policy.retention = "oracle"
    with pytest.raises(ValueError, match="policy.retention: oracle"):
        run_config(config, profile=PROFILE)


def test_cluster_without_the_hook_is_unchanged_by_it():
    # the hook's default path: a plain pool of 2 clients still records every turn
    config = SimConfig(seed=1, num_clients=2)
    convs = _conversations([2, 3, 1])
    result = Cluster(config, PROFILE).run(convs)
    assert sorted((r.conversation, r.turn) for r in result.records) == sorted(
        (c.conversation_id, k) for c in convs for k in range(len(c.turns)))


def test_simulated_run_matches_vllms_published_example_output(tmp_path):
    # vLLM's README (https://github.com/vllm-project/vllm/blob/1711f0da91cefaccba52d3af38e2918798234c82/benchmarks/multi_turn/README.md)
    # prints the statistics of `--input-file generate_multi_turn.json --num-clients 2 --max-active-conversations 6`
    # with the config as it was then (commit d175c56dec96594180fcd52992620d3d7934a48e: the conversation
    # prefix was lognormal mean 6, sigma 4, max 1500): 166 requests; input_num_turns (messages sent)
    # mean 7.43; input_num_tokens mean 2006, min 522, max 3899; output_num_tokens mean 100.01.
    import json
    import statistics

    data = json.loads(EXAMPLE.read_text())
    data["prompt_input"]["prefix_num_tokens"] = {"distribution": "lognormal", "mean": 6, "sigma": 4, "max": 1500}
    path = tmp_path / "generate_multi_turn_d175c56.json"
    path.write_text(json.dumps(data))
    runs = []
    for seed in range(5):
        config = SimConfig(seed=seed, num_clients=2)
        # the script's input_num_tokens counts message contents only (get_messages_token_count), not what the
        # chat template adds: compared without the template's tokens
        config.workload = {"kind": "vllm_multi_turn", "path": str(path), "max_active_conversations": 6,
                           "chat_template": "none"}
        runs.append(run_config(config.validate(), profile=PROFILE).records)
    mean = statistics.fmean
    assert mean(len(r) for r in runs) == pytest.approx(166, rel=0.1)  # early stop: timing moves it a little
    assert mean(mean(2 * x.turn + 1 for x in r) for r in runs) == pytest.approx(7.43, abs=0.4)
    assert mean(mean(x.prompt_tokens for x in r) for r in runs) == pytest.approx(2006, rel=0.1)
    # vLLM's first message also holds ~20 tokens of header and instruction the token counts leave out
    assert all(500 <= min(x.prompt_tokens for x in r) <= 522 for r in runs)
    assert mean(max(x.prompt_tokens for x in r) for r in runs) == pytest.approx(3899, rel=0.05)
    assert mean(mean(x.output_tokens for x in r) for r in runs) == pytest.approx(100.01, abs=1.5)
