"""Scheduler level: a real vLLM scheduler running our connector's scheduler side; NIXL faked at the
transfer boundary (tests.connector.harness.FakeNixlTransfers)."""

from __future__ import annotations

import math

import pytest

import vllm  # noqa: F401  (part of the test setup: a missing vLLM is a failure, not a skip)

from vllm.v1.request import RequestStatus  # noqa: E402

from impl.connector.config import ConfigError  # noqa: E402
from impl.connector.scheduler import BidikvPullScheduler
from impl.policy import BreakEvenThreshold, FixedTTL, GapQuantileTTL, HeartbeatLease
from impl.policy.return_time import RETENTION_KEY
from tests.connector.harness import (
    BLOCK_SIZE,
    FakeClock,
    FakeNixlTransfers,
    FakeNotifier,
    connector_scheduler,
    decode_params,
    empty_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_output,
    prefill_params,
    recv_meta,
    tokens,
    with_check,
)

THRESHOLD = 48
NOTIFY = {"v": 1, "url": "http://127.0.0.1:9/internal/kv_params", "turn": "turn-1", "token": "secret"}


def prefill_node(model_dir, **extra):
    config = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": THRESHOLD, **extra}
    return make_scheduler(make_vllm_config(model_dir, "kv_producer", config))


def decode_node(model_dir, **extra):
    config = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": THRESHOLD, "decoder_kv_blocks_ttl": 20,
              **extra}
    scheduler = make_scheduler(make_vllm_config(model_dir, "kv_consumer", config))
    cs = connector_scheduler(scheduler)
    cs._clock = FakeClock()
    cs.notifier = FakeNotifier()
    cs.idle_sleep_calls = []  # records the idle-step sleeps instead of sleeping
    cs._sleep = cs.idle_sleep_calls.append
    return scheduler


def run(scheduler, request, fake: FakeNixlTransfers | None = None, max_steps: int = 20,
        stats: dict[str, float] | None = None):
    """Step until ``request`` finished (completing its reads at once); returns the params it finished with.

    ``stats``: summed here, per key, the connector's ``bidikv_*`` counts from vLLM's per-step scheduler
    stats (what P's /metrics export, impl/connector/stats.py)."""
    fake = fake or FakeNixlTransfers()
    finished_params = None
    for _ in range(max_steps):
        so = scheduler.schedule()
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            fake.read_done(request.request_id)
        kv = fake.output()
        if request.request_id in so.num_scheduled_tokens:
            out = model_output([request], kv=kv)
        else:
            out = empty_output(kv)
        for outputs in scheduler.update_from_output(so, out).values():
            step_stats = outputs.scheduler_stats.kv_connector_stats if outputs.scheduler_stats else None
            if stats is not None:
                for key, values in (step_stats or {}).items():
                    if key.startswith("bidikv_"):
                        stats[key] = stats.get(key, 0) + sum(values)
            for o in outputs.outputs:
                if o.request_id == request.request_id and o.finish_reason is not None:
                    finished_params = o.kv_transfer_params
        if request.is_finished():
            return finished_params
    raise AssertionError(f"{request.request_id} did not finish: {request.status}")


def release(scheduler, *req_ids):
    """The peer read (or the lease expired on) our held blocks: the worker reports finished_sending."""
    so = scheduler.schedule()
    scheduler.update_from_output(so, empty_output(FakeNixlTransfers().peer_read(*req_ids).output()))


def seed_prefill_cache(scheduler, prompt):
    """Turn 1 on P: prefill ``prompt`` locally (fresh params), D reads it, P's prefix cache keeps it."""
    first = make_request(prompt, {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": None,
                                  "remote_engine_id": None, "remote_host": None, "remote_port": None})
    scheduler.add_request(first)
    run(scheduler, first)
    release(scheduler, first.request_id)


# -- D->P (P reads what D kept) ----------------------------------------------------------------------

@pytest.mark.parametrize("reusable, pulls", [(THRESHOLD - 1, False), (THRESHOLD, True), (THRESHOLD + 1, True)])
def test_d_to_p_threshold_boundary_after_local_hit(model_dir, reusable, pulls):
    scheduler = prefill_node(model_dir)
    turn1 = tokens(100, seed=1)
    seed_prefill_cache(scheduler, turn1)
    local_hit = (len(turn1) // BLOCK_SIZE) * BLOCK_SIZE  # 96: P's own cache, whole blocks
    prompt = turn1 + tokens(60, seed=2)
    remote = local_hit + reusable  # count = min(remote, prompt) - local_hit = reusable
    req = make_request(prompt, with_check(scheduler, decode_params(num_blocks=-(-remote // BLOCK_SIZE),
                                                                   remote_num_tokens=remote), prompt[:remote]))
    scheduler.add_request(req)
    so = scheduler.schedule()
    cs = connector_scheduler(scheduler)
    if pulls:
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert req.num_computed_tokens == local_hit + reusable
        assert recv_meta(scheduler, so, req).awaiting_kvs
        assert cs.decisions[("d_to_p", "at_or_above_threshold")] == 1
    else:
        assert req.status == RequestStatus.RUNNING
        assert so.num_scheduled_tokens[req.request_id] == len(prompt) - local_hit  # recomputes the rest
        meta = so.kv_connector_metadata.reqs_to_recv[req.request_id]
        assert meta.local_block_ids == () and not meta.awaiting_kvs  # only tells D to free its blocks
        assert cs.decisions[("d_to_p", "below_threshold")] == 1


def test_declined_d_to_p_read_is_recomputed_not_stuck(model_dir):
    """D's blocks expired: P declines the read (kv_load_failure_policy "recompute") and must compute
    the prompt itself. Upstream asks the connector again and waits forever for a read never queued."""
    scheduler = prefill_node(model_dir)
    prompt = tokens(150, seed=40)
    req = make_request(prompt, with_check(scheduler, decode_params(num_blocks=5, remote_num_tokens=150), prompt))
    scheduler.add_request(req)
    so = scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    recv_meta(scheduler, so, req)
    fake = FakeNixlTransfers()
    so = scheduler.schedule()
    scheduler.update_from_output(so, empty_output(fake.read_failed(req.request_id).output()))
    computed = 0
    for _ in range(6):
        so = scheduler.schedule()
        computed += so.num_scheduled_tokens.get(req.request_id, 0)
        out = model_output([req]) if req.request_id in so.num_scheduled_tokens else empty_output()
        scheduler.update_from_output(so, out)
        if req.is_finished():
            break
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, req.status
    assert computed == 150  # recomputed locally, no second read
    assert connector_scheduler(scheduler).decisions[("d_to_p", "at_or_above_threshold")] == 1


def test_d_to_p_threshold_zero_pulls_anything(model_dir):
    scheduler = prefill_node(model_dir, kv_recompute_threshold=0)
    prompt = tokens(40, seed=3)
    req = make_request(prompt, with_check(scheduler, decode_params(num_blocks=1, remote_num_tokens=1), prompt[:1]))
    scheduler.add_request(req)
    scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == 1


def test_d_to_p_needs_bidirectional(model_dir):
    """Upstream counts D's tokens even without bidirectional_kv_xfer and then never loads them."""
    scheduler = make_scheduler(make_vllm_config(model_dir, "kv_producer", {"kv_recompute_threshold": 0}))
    req = make_request(tokens(100, seed=4), decode_params(num_blocks=3, remote_num_tokens=96))
    scheduler.add_request(req)
    so = scheduler.schedule()
    assert req.status == RequestStatus.RUNNING and so.num_scheduled_tokens[req.request_id] == 100


def test_no_d_to_p_read_through_a_host_staging_buffer(model_dir):
    """GPU + kv_buffer_device "cpu": upstream would park the request for a read it never queues."""
    scheduler = prefill_node(model_dir)
    connector_scheduler(scheduler).use_host_buffer = True
    req = make_request(tokens(100, seed=41), decode_params(num_blocks=3, remote_num_tokens=96))
    scheduler.add_request(req)
    so = scheduler.schedule()
    assert req.status == RequestStatus.RUNNING and so.num_scheduled_tokens[req.request_id] == 100


def test_short_prompt_reads_the_blocks_covering_it_not_the_last_ones(model_dir):
    """P's prompt (150 tokens) is shorter than what D holds (320 tokens in 10 blocks 100..109)."""
    scheduler = prefill_node(model_dir)
    turn1 = tokens(70, seed=5)
    seed_prefill_cache(scheduler, turn1)  # P's local hit: 64 tokens, 2 blocks
    prompt = turn1 + tokens(80, seed=6)
    held = prompt + tokens(170, seed=60)  # D holds more than the prompt: the prompt is a prefix of it
    req = make_request(prompt, with_check(scheduler, decode_params(num_blocks=10, remote_num_tokens=320,
                                                                   first_block=100), held))
    scheduler.add_request(req)
    so = scheduler.schedule()
    meta = recv_meta(scheduler, so, req)
    local = meta.local_block_ids[0]
    remote = meta.remote.block_ids[0]
    # verified: D's first 4 blocks (128 tokens); the prompt's last 22 tokens lie inside D's block 104,
    # which holds later tokens too, so no checkpoint covers them: P recomputes them.
    # P fills positions 64..128 -> its blocks 2, 3 -> D's blocks 102, 103 (vLLM pairs the tail)
    assert len(local) == 2
    assert remote == [100, 101, 102, 103]
    assert remote[-len(local):] == [102, 103]  # upstream would have paired [108, 109]
    assert connector_scheduler(scheduler).trimmed_reads == 1


def test_prompt_longer_than_peer_keeps_every_block(model_dir):
    scheduler = prefill_node(model_dir)
    prompt = tokens(200, seed=7)
    req = make_request(prompt, with_check(scheduler, decode_params(num_blocks=4, remote_num_tokens=128,
                                                                   first_block=100), prompt[:128]))
    scheduler.add_request(req)
    so = scheduler.schedule()
    meta = recv_meta(scheduler, so, req)
    assert meta.remote.block_ids[0] == [100, 101, 102, 103]
    assert len(meta.local_block_ids[0]) == 4
    assert connector_scheduler(scheduler).trimmed_reads == 0


# -- P->D (D reads what P computed; vLLM #55801) -----------------------------------------------------

@pytest.mark.parametrize("prompt_len, pulls", [(THRESHOLD - 1, False), (THRESHOLD, True)])
def test_p_to_d_threshold_boundary(model_dir, prompt_len, pulls):
    scheduler = decode_node(model_dir)
    req = make_request(tokens(prompt_len, seed=8), prefill_params(num_blocks=2), max_tokens=3)
    scheduler.add_request(req)
    so = scheduler.schedule()
    meta = recv_meta(scheduler, so, req)
    if pulls:
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert meta.awaiting_kvs and len(meta.local_block_ids[0]) == 2
    else:
        assert req.status == RequestStatus.RUNNING
        assert so.num_scheduled_tokens[req.request_id] == prompt_len  # D prefills it itself
        assert meta.local_block_ids == () and not meta.awaiting_kvs  # and tells P to free its blocks


def test_p_to_d_counts_only_beyond_ds_own_cache(model_dir):
    """D's prefix cache holds 96 of the 140 prompt tokens: the remaining 44 are below the threshold."""
    scheduler = decode_node(model_dir)
    base = tokens(100, seed=9)
    first = make_request(base, {"do_remote_prefill": False, "do_remote_decode": False}, max_tokens=1)
    scheduler.add_request(first)
    run(scheduler, first)
    release(scheduler, first.request_id)
    req = make_request(base + tokens(40, seed=10), prefill_params(num_blocks=5), max_tokens=2)
    scheduler.add_request(req)
    so = scheduler.schedule()
    assert req.status == RequestStatus.RUNNING
    assert so.num_scheduled_tokens[req.request_id] == 140 - 96
    assert connector_scheduler(scheduler).decisions[("p_to_d", "below_threshold")] == 1


def test_p_to_d_threshold_can_be_turned_off(model_dir):
    scheduler = decode_node(model_dir, bidikv_apply_threshold_p_to_d=False)
    req = make_request(tokens(THRESHOLD - 1, seed=11), prefill_params(num_blocks=2), max_tokens=2)
    scheduler.add_request(req)
    scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # upstream behaviour


def test_p_to_d_declined_read_still_completes(model_dir):
    scheduler = decode_node(model_dir)
    req = make_request(tokens(20, seed=12), prefill_params(num_blocks=1), max_tokens=3)
    scheduler.add_request(req)
    params = run(scheduler, req)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert params["remote_block_ids"]  # D still retains the finished turn for P's next turn


def test_break_even_policy_prices_the_pull(model_dir):
    scheduler = prefill_node(model_dir, bidikv_recompute_policy="break_even", bidikv_cost_profile="qwen3-32b@p5en-tp8")
    cs = connector_scheduler(scheduler)
    assert isinstance(cs.recompute_policy, BreakEvenThreshold)
    crossover = cs.recompute_policy.break_even_tokens(BLOCK_SIZE, 0)
    assert crossover is not None and crossover < 4000
    short_prompt = tokens(crossover - 1, seed=13)
    short = make_request(short_prompt, with_check(scheduler, decode_params(num_blocks=-(-crossover // 32),
                                                                           remote_num_tokens=crossover - 1),
                                                  short_prompt))
    scheduler.add_request(short)
    scheduler.schedule()
    assert short.status == RequestStatus.RUNNING
    long_prompt = tokens(crossover + 40, seed=14)
    long = make_request(long_prompt, with_check(scheduler, decode_params(num_blocks=-(-(crossover + 40) // 32),
                                                                         remote_num_tokens=crossover + 40,
                                                                         request_id="decode-req-2"), long_prompt))
    scheduler.add_request(long)
    scheduler.schedule()
    assert long.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert cs.decisions[("d_to_p", "recompute_cheaper")] == 1 and cs.decisions[("d_to_p", "pull_cheaper")] == 1


# -- retention on D, the expiry it publishes, the notification --------------------------------------

def finish_on_decode(scheduler, prompt_seed: int, notify: dict | None = NOTIFY, max_tokens: int = 3):
    params = prefill_params(num_blocks=2)
    if notify is not None:
        params["bidikv_notify"] = dict(notify)
    req = make_request(tokens(64, seed=prompt_seed), params, max_tokens=max_tokens)
    scheduler.add_request(req)
    return req, run(scheduler, req)


def test_ttl_expiry_is_published_and_enforced(model_dir):
    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    assert isinstance(cs.retention_policy, FixedTTL) and cs.retention_policy.seconds == 20
    req, params = finish_on_decode(scheduler, 20)
    assert params["remote_blocks_expiry_time"] == pytest.approx(1000.0 + 20)
    assert params["do_remote_decode"] is True and params["remote_num_tokens"] == 64 + 3 - 1
    so = scheduler.schedule()  # the deadline reaches the worker with the next metadata
    assert so.kv_connector_metadata.reqs_to_send[req.request_id] == pytest.approx(1020.0)


@pytest.mark.parametrize("asked, expiry, counted", [
    (5.0, 1005.0, "applied"),  # the router's learnt hold for this turn, shorter than D's TTL
    (0, 1000.0, "applied"),  # "will not return": gone at the worker's next expiry scan
    (60.0, 1020.0, "applied"),  # longer than D's TTL: D's TTL is the cap
    ("soon", 1020.0, "malformed"),  # not a number: D's own retention applies
    (-3.0, 1020.0, "malformed"),
    (math.inf, 1020.0, "malformed"),
])
def test_the_router_can_ask_for_a_shorter_hold_per_turn(model_dir, asked, expiry, counted):
    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    params = prefill_params(num_blocks=2)
    params["bidikv_notify"] = dict(NOTIFY)
    params[RETENTION_KEY] = asked
    req = make_request(tokens(64, seed=26), params, max_tokens=3)
    scheduler.add_request(req)
    out = run(scheduler, req)
    assert out["remote_blocks_expiry_time"] == pytest.approx(expiry)
    [(_, _, expires_in)] = cs.notifier.submitted  # the router's entry lapses with D's blocks
    assert expires_in == pytest.approx(expiry - 1000.0)
    assert scheduler.schedule().kv_connector_metadata.reqs_to_send[req.request_id] == pytest.approx(expiry)
    assert cs.retention_asked == {counted: 1}


def test_notification_carries_what_d_returned(model_dir):
    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    req, params = finish_on_decode(scheduler, 21)
    [(target, kv_params, expires_in)] = cs.notifier.submitted
    assert (target.url, target.turn, target.token) == (NOTIFY["url"], "turn-1", "secret")
    assert kv_params == params and expires_in == pytest.approx(20.0)


def test_no_notification_without_the_field_or_when_malformed(model_dir):
    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    finish_on_decode(scheduler, 22, notify=None)
    finish_on_decode(scheduler, 23, notify={**NOTIFY, "v": 2})
    finish_on_decode(scheduler, 24, notify={**NOTIFY, "url": "file:///etc/passwd"})
    assert cs.notifier.submitted == []


def test_no_retention_without_bidirectional_and_the_router_is_told_at_once(model_dir):
    """D keeps nothing with bidirectional OFF; it says so ("retained": false), or the router would hold the
    conversation's next turn for up to notify_wait_s waiting for params (measured: +0.5-1.8 s on OFF turns)."""
    scheduler = make_scheduler(make_vllm_config(model_dir, "kv_consumer", {"kv_recompute_threshold": 0}))
    cs = connector_scheduler(scheduler)
    cs.notifier = FakeNotifier()
    _, params = finish_on_decode(scheduler, 25)
    [(target, kv_params, expires_in)] = cs.notifier.submitted
    assert params is None and kv_params is None and expires_in is None
    assert (target.turn, target.token) == ("turn-1", "secret")


def test_lease_expiry_and_renewal(model_dir):
    scheduler = decode_node(model_dir, bidikv_retention="lease", bidikv_lease_s=30, bidikv_heartbeat_interval_s=10,
                            bidikv_lease_max_hold_s=100)
    cs = connector_scheduler(scheduler)
    assert isinstance(cs.retention_policy, HeartbeatLease)
    req, params = finish_on_decode(scheduler, 26)
    assert params["remote_blocks_expiry_time"] == pytest.approx(1030.0)
    assert cs.renew(req.request_id, now=1010.0) == pytest.approx(1040.0)
    so = scheduler.schedule()
    assert so.kv_connector_metadata.reqs_to_send[req.request_id] == pytest.approx(1040.0)
    assert cs.renew(req.request_id, now=2000.0) == pytest.approx(1040.0)  # a lapsed lease stays lapsed
    assert cs.renew("unknown", now=1010.0) is None


def test_gap_quantile_learns_from_reads_before_expiry(model_dir):
    scheduler = decode_node(model_dir, bidikv_retention="gap_quantile", bidikv_gap_min_samples=1,
                            bidikv_gap_floor_s=1, bidikv_gap_margin_s=5, bidikv_gap_quantile=1.0)
    cs = connector_scheduler(scheduler)
    assert isinstance(cs.retention_policy, GapQuantileTTL)
    req, params = finish_on_decode(scheduler, 27)
    assert params["remote_blocks_expiry_time"] == pytest.approx(1000.0 + 20)  # initial_s = decoder_kv_blocks_ttl
    cs._clock.t = 1007.0
    release(scheduler, req.request_id)  # P's next turn read it 7 s after it finished
    _, params = finish_on_decode(scheduler, 28)
    assert params["remote_blocks_expiry_time"] == pytest.approx(1007.0 + 7 + 5)


def test_gap_quantile_ignores_releases_at_expiry(model_dir):
    scheduler = decode_node(model_dir, bidikv_retention="gap_quantile", bidikv_gap_min_samples=1,
                            bidikv_gap_floor_s=1)
    cs = connector_scheduler(scheduler)
    req, _ = finish_on_decode(scheduler, 29)
    cs._clock.t = 1020.5  # the worker reaped the lease: not an inter-turn gap
    release(scheduler, req.request_id)
    _, params = finish_on_decode(scheduler, 30)
    assert params["remote_blocks_expiry_time"] == pytest.approx(1020.5 + 20)


@pytest.mark.parametrize("retention, cls", [("ttl", FixedTTL), ("lease", HeartbeatLease),
                                            ("gap_quantile", GapQuantileTTL)])
def test_retention_policy_selection(model_dir, retention, cls):
    scheduler = decode_node(model_dir, bidikv_retention=retention)
    cs = connector_scheduler(scheduler)
    assert isinstance(cs, BidikvPullScheduler) and isinstance(cs.retention_policy, cls)


# -- the idle-step throttle ---------------------------------------------------------------------------

def test_idle_steps_sleep_only_while_nothing_is_in_flight(model_dir):
    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    req = make_request(tokens(64, seed=31), prefill_params(num_blocks=2), max_tokens=2)
    scheduler.add_request(req)
    so = scheduler.schedule()  # the read is queued (or, on vLLM 0.33, deferred one step): no sleep
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(so, empty_output())
    so = scheduler.schedule()  # read still in flight, nothing scheduled: no sleep either
    scheduler.update_from_output(so, empty_output())
    scheduler.schedule()
    assert cs.idle_sleep_calls == []
    run(scheduler, req)
    cs.idle_sleep_calls.clear()
    scheduler.schedule()  # only the retained blocks keep the engine stepping: sleep
    assert cs.idle_sleep_calls == [0.01]


def test_idle_wait_ends_when_the_engine_has_input(model_dir):
    import queue

    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    finish_on_decode(scheduler, 33)
    inbox = queue.Queue()
    cs._engine_inbox = inbox
    cs.idle_sleep_calls.clear()
    cs._sleep = lambda s: (cs.idle_sleep_calls.append(s), inbox.put("new request"))
    scheduler.schedule()
    assert cs.idle_sleep_calls == [0.005]  # one slice, then the engine's new input ends the wait
    scheduler.schedule()
    assert cs.idle_sleep_calls == [0.005]  # input pending: no wait at all


def test_the_engine_inbox_is_found_from_the_constructing_engine():
    import queue

    from impl.connector.scheduler import _find_engine_inbox

    class EngineCoreLike:  # vLLM's EngineCoreProc creates input_queue, then builds the scheduler
        def __init__(self):
            self.input_queue = queue.Queue()
            self.found = _find_engine_inbox()

    engine = EngineCoreLike()
    assert engine.found is engine.input_queue
    assert _find_engine_inbox() is None


def test_idle_sleep_can_be_disabled(model_dir):
    scheduler = decode_node(model_dir, bidikv_idle_step_sleep_s=0)
    cs = connector_scheduler(scheduler)
    finish_on_decode(scheduler, 32)
    scheduler.schedule()
    assert cs.idle_sleep_calls == []


# -- configuration -----------------------------------------------------------------------------------

def test_bad_extra_config_stops_the_scheduler_naming_the_key(model_dir):
    with pytest.raises(ConfigError, match=r"\['bidikv_retention'\].*'ttl', 'lease', 'gap_quantile'"):
        make_scheduler(make_vllm_config(model_dir, "kv_consumer", {"bidikv_retention": "forever"}))


def test_bad_extra_config_stops_the_engine_core_before_workers_exist(model_dir):
    """vLLM asks the connector class for its KV layout before it builds workers or the KV cache."""
    from impl.connector import NixlConnector

    with pytest.raises(ConfigError, match=r"\['bidikv_idle_step_sleep_s'\]"):
        NixlConnector.get_required_kvcache_layout(
            make_vllm_config(model_dir, "kv_producer", {"bidikv_idle_step_sleep_s": "soon"}))
    good = make_vllm_config(model_dir, "kv_producer", {"bidirectional_kv_xfer": True})
    assert NixlConnector.get_required_kvcache_layout(good) in ("LBHNC", None)


# -- token-exact reuse (impl.policy.prefix_check) -----------------------------------------------------

def _first_read(scheduler, req):
    """(tokens P reads from the peer, P's report) for ``req`` on a P scheduler."""
    scheduler.add_request(req)
    so = scheduler.schedule()
    pulled = req.num_computed_tokens if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS else 0
    return pulled, connector_scheduler(scheduler)._reports.get(req.request_id)


def test_what_d_publishes_verifies_on_p_to_the_token(model_dir):
    """D's finished turn (prompt + its output, vLLM's real block hashes) against P's next prompt."""
    d = decode_node(model_dir)
    prompt = tokens(64, seed=70)
    req, params = finish_on_decode(d, 70)
    held = list(req.all_token_ids)[:params["remote_num_tokens"]]
    assert held[:64] == prompt  # finish_on_decode's prompt is tokens(64, seed=70)
    check = params["bidikv_prefix_check"]
    assert check["n"] == params["remote_num_tokens"] == 66
    p = prefill_node(model_dir, kv_recompute_threshold=0)
    next_prompt = held + tokens(40, seed=71)
    pulled, report = _first_read(p, make_request(next_prompt, {**decode_params(3, 66), "bidikv_prefix_check": check}))
    assert pulled == 66  # both full blocks and the 2-token tail
    assert (report.offered, report.verified, report.pulled, report.reason) == (66, 66, 66, "full")


@pytest.mark.parametrize("diverge_at", [0, 5, 31, 32, 40, 63, 64, 70, 95])
def test_p_pulls_only_up_to_the_first_differing_token(model_dir, diverge_at):
    """D's held ids differ from the prompt's at ``diverge_at`` (a re-tokenized or trimmed answer)."""
    scheduler = prefill_node(model_dir, kv_recompute_threshold=0)
    held = tokens(100, seed=72)
    prompt = held[:diverge_at] + [(held[diverge_at] + 1) % 90 + 3] + held[diverge_at + 1:] + tokens(30, seed=73)
    params = with_check(scheduler, decode_params(num_blocks=4, remote_num_tokens=100), held)
    pulled, report = _first_read(scheduler, make_request(prompt, params))
    expected = (diverge_at // BLOCK_SIZE) * BLOCK_SIZE  # whole agreeing blocks (all checkpointed: 4 blocks < dense)
    assert pulled == expected
    assert (report.offered, report.verified, report.reason) == (100, expected, "partial")


def test_unverifiable_params_are_refused_unless_the_operator_trusts_them(model_dir):
    prompt = tokens(100, seed=74)
    strict = prefill_node(model_dir, kv_recompute_threshold=0)
    pulled, report = _first_read(strict, make_request(prompt, decode_params(num_blocks=3, remote_num_tokens=96)))
    assert pulled == 0 and report.reason == "no_check" and report.verified == 0
    trusting = prefill_node(model_dir, kv_recompute_threshold=0, bidikv_require_verified_prefix=False)
    pulled, report = _first_read(trusting, make_request(prompt, decode_params(num_blocks=3, remote_num_tokens=96)))
    assert pulled == 96 and report.reason == "unverified"


def test_a_peer_hashing_differently_is_refused(model_dir):
    scheduler = prefill_node(model_dir, kv_recompute_threshold=0)
    prompt = tokens(100, seed=75)
    params = with_check(scheduler, decode_params(num_blocks=3, remote_num_tokens=96), prompt[:96])
    params["bidikv_prefix_check"] = {**params["bidikv_prefix_check"], "scheme": "0" * 16}  # another model / seed
    pulled, report = _first_read(scheduler, make_request(prompt, params))
    assert pulled == 0 and report.reason == "scheme"


def test_ps_report_reaches_its_returned_params_and_vllms_stats(model_dir):
    scheduler = prefill_node(model_dir, kv_recompute_threshold=0)
    held = tokens(100, seed=76)
    prompt = held[:50] + [1] + held[51:] + tokens(20, seed=77)  # differs at 50: one block verifies
    req = make_request(prompt, with_check(scheduler, decode_params(num_blocks=4, remote_num_tokens=100), held))
    scheduler.add_request(req)
    totals: dict[str, float] = {}
    params = run(scheduler, req, stats=totals)
    assert params["bidikv_reuse"] == {"path": "d_to_p", "offered": 100, "verified": 32, "pulled": 32,
                                      "reason": "partial"}
    # and P publishes what it now holds for D's read (the P->D path verifies it the same way)
    assert params["bidikv_prefix_check"]["n"] == len(prompt)
    assert totals["bidikv_d_to_p_offered"] == 100 and totals["bidikv_d_to_p_verified"] == 32
    assert totals["bidikv_d_to_p_refused_partial"] == 68


def test_d_verifies_ps_prefix_on_the_ordinary_path(model_dir):
    """P->D: P's published prompt check against D's prompt; a different D prompt pulls only what agrees."""
    d = decode_node(model_dir, kv_recompute_threshold=0)
    prompt = tokens(100, seed=78)
    ps_prompt = prompt[:40] + [2] + prompt[41:]
    params = with_check(d, prefill_params(num_blocks=4, remote_num_tokens=100), ps_prompt)
    req = make_request(prompt, params, max_tokens=2)
    d.add_request(req)
    d.schedule()
    assert req.num_computed_tokens == 32  # one agreeing block; D computes the rest itself
    assert connector_scheduler(d)._reports[req.request_id].reason == "partial"


def test_verification_counts_reach_vllms_stats_path(model_dir):
    """What P's /metrics exports (impl/connector/stats.py): vLLM's scheduler stats, step by step."""
    scheduler = prefill_node(model_dir, kv_recompute_threshold=0)
    held = tokens(100, seed=79)
    prompt = held[:70] + [1] + held[71:] + tokens(20, seed=80)  # differs at 70: two blocks verify
    req = make_request(prompt, with_check(scheduler, decode_params(num_blocks=4, remote_num_tokens=100), held))
    scheduler.add_request(req)
    totals: dict[str, float] = {}
    run(scheduler, req, stats=totals)
    assert totals["bidikv_d_to_p_offered"] == 100 and totals["bidikv_d_to_p_verified"] == 64
    assert totals["bidikv_d_to_p_pulled"] == 64 and totals["bidikv_d_to_p_refused_partial"] == 36
