"""give_back on D, with a real vLLM scheduler and block pool (NIXL faked at the transfer boundary, as in
test_scheduler.py): what D publishes, how a renewal answers, and that under pressure it shortens the
deadlines it hands the worker to the expiry it last published -- never sooner -- while pinned D, vLLM's
behaviour, keeps the whole TTL and the waiting request waits."""

from __future__ import annotations

import pytest

import vllm  # noqa: F401  (a missing vLLM is a failure, not a skip)

from vllm.v1.request import RequestStatus  # noqa: E402

from impl.connector.config import ConfigError  # noqa: E402
from impl.connector.stats import GIVE_BACK_KEYS, SUPERSEDED_KEYS
from impl.policy.give_back import RENEW_BEFORE_READ_KEY
from tests.connector.harness import (
    FakeClock,
    FakeNixlTransfers,
    FakeNotifier,
    connector_scheduler,
    empty_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    tokens,
)
from tests.connector.test_heartbeat import free_port
from tests.connector.test_scheduler import NOTIFY, run

TTL_S = 300.0
WINDOW_S = 15.0
POOL_BLOCKS = 13  # 12 usable (vLLM keeps a null block): four retained turns of 3 blocks fill it


def decode(model_dir, mode: str, **extra):
    config = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 16, "decoder_kv_blocks_ttl": TTL_S,
              "bidikv_retained_under_pressure": mode, "bidikv_heartbeat_port": free_port(),
              "bidikv_heartbeat_host": "127.0.0.1", **extra}
    if mode == "give_back":
        config.setdefault("bidikv_give_back_publish_window_s", WINDOW_S)
        config.setdefault("bidikv_give_back_headroom", 0.0)
    scheduler = make_scheduler(make_vllm_config(model_dir, "kv_consumer", config), num_blocks=POOL_BLOCKS)
    cs = connector_scheduler(scheduler)
    cs._clock = FakeClock()
    cs.notifier = FakeNotifier()
    cs._sleep = lambda _s: None
    return scheduler, cs


def finish(scheduler, seed: int):
    """A turn whose prompt P computed (P->D), decoded and retained on D: 64 + 2 tokens, 3 blocks."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
              "remote_engine_id": "prefill-engine", "remote_request_id": f"p-{seed}", "remote_host": "127.0.0.1",
              "remote_port": 5600, "remote_num_tokens": 64, "tp_size": 1, "bidikv_notify": dict(NOTIFY)}
    req = make_request(tokens(64, seed=seed), params, max_tokens=3)
    scheduler.add_request(req)
    return req, run(scheduler, req)


def test_d_publishes_a_short_expiry_asks_to_be_renewed_and_the_router_keeps_the_entry_for_the_ttl(model_dir):
    scheduler, cs = decode(model_dir, "give_back")
    try:
        req, params = finish(scheduler, 1)
        assert params["remote_blocks_expiry_time"] == pytest.approx(1000.0 + WINDOW_S)
        assert params[RENEW_BEFORE_READ_KEY] is True
        [(_, _, expires_in)] = cs.notifier.submitted
        assert expires_in == pytest.approx(TTL_S)  # the router keeps the entry until the retention's expiry
        so = scheduler.schedule()  # the worker's deadline is the TTL while D has room
        assert so.kv_connector_metadata.reqs_to_send[req.request_id] == pytest.approx(1000.0 + TTL_S)
        cs._clock.t = 1100.0
        answer = cs._answer_heartbeat(req.request_id)
        assert answer["status"] == "held" and answer["renewed"] is True
        assert answer["expiry_time"] == pytest.approx(1100.0 + WINDOW_S)
        assert answer["expires_in_s"] == pytest.approx(1000.0 + TTL_S - 1100.0)
    finally:
        cs.shutdown()


def _bidikv_counts(outputs) -> dict[str, float]:
    """The connector's bidikv_* counts in vLLM's scheduler stats of one update_from_output, summed."""
    counts: dict[str, float] = {}
    for out in outputs.values():
        stats = out.scheduler_stats.kv_connector_stats if out.scheduler_stats else None
        for key, values in (stats or {}).items():
            if key.startswith("bidikv_"):
                counts[key] = counts.get(key, 0) + sum(values)
    return counts


def _fill_then_wait(model_dir, mode: str):
    scheduler, cs = decode(model_dir, mode)
    held = [finish(scheduler, seed)[0] for seed in range(10, 14)]  # 4 x 3 blocks: the pool is full
    cs._clock.t = 1020.0  # every turn finished at 1000 and was published until 1015
    cs._answer_heartbeat(held[-1].request_id)  # the router asked for the newest just now: published 1035
    waiting = make_request(tokens(64, seed=99), {"do_remote_prefill": True, "do_remote_decode": False,
                                                 "remote_block_ids": [[1, 2]], "remote_engine_id": "prefill-engine",
                                                 "remote_request_id": "p-99", "remote_host": "127.0.0.1",
                                                 "remote_port": 5600, "remote_num_tokens": 64, "tp_size": 1},
                           max_tokens=3)
    scheduler.add_request(waiting)
    return scheduler, cs, held, waiting


def test_pinned_d_keeps_the_ttl_and_the_new_request_waits(model_dir):
    scheduler, cs, held, waiting = _fill_then_wait(model_dir, "pinned")
    try:
        for _ in range(3):
            so = scheduler.schedule()
            assert waiting.request_id not in so.num_scheduled_tokens and waiting.status == RequestStatus.WAITING
            deadlines = so.kv_connector_metadata.reqs_to_send
            assert all(deadlines.get(r.request_id, 1000.0 + TTL_S) == pytest.approx(1000.0 + TTL_S) for r in held)
            scheduler.update_from_output(so, empty_output())
    finally:
        cs.shutdown()


def test_give_back_under_pressure_shortens_deadlines_to_the_last_published_expiry_and_never_below(model_dir):
    scheduler, cs, held, waiting = _fill_then_wait(model_dir, "give_back")
    try:
        so = scheduler.schedule()
        assert waiting.status == RequestStatus.WAITING  # nothing is freed on the spot
        deadlines = so.kv_connector_metadata.reqs_to_send
        # one entry covers the waiting request's 3 blocks: the soonest intended expiry (the oldest turn), whose
        # only published expiry (its finish + window, 1015) has passed: due at once
        assert deadlines[held[0].request_id] == pytest.approx(1020.0)
        # the rest keep the TTL (the newest's first deadline goes out with this step, as vLLM sends it)
        assert all(deadlines.get(r.request_id, 1000.0 + TTL_S) == pytest.approx(1000.0 + TTL_S) for r in held[1:])
        assert cs.give_back.is_lapsing(held[0].request_id)
        # a lapsing entry is not renewed any more: the router learns it may read only until what it has
        answer = cs._answer_heartbeat(held[0].request_id)
        assert answer == {"status": "not_held", "reason": "given_back"}
        # the worker frees it at that deadline (it reports finished_sending); the waiting request then runs
        counts = _bidikv_counts(scheduler.update_from_output(
            so, empty_output(FakeNixlTransfers().peer_read(held[0].request_id).output())))
        so = scheduler.schedule()
        assert waiting.request_id in so.num_scheduled_tokens or waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert held[0].request_id not in cs.give_back
        # what vLLM's /metrics export (impl/connector/stats.py), from vLLM's own per-step scheduler stats: one
        # turn of 3 blocks given back, freed at once (the fake clock did not move)
        for key, value in _bidikv_counts(scheduler.update_from_output(so, empty_output())).items():
            counts[key] = counts.get(key, 0) + value
        assert {k: counts.get(k) for k in GIVE_BACK_KEYS} == {
            "bidikv_given_back": 1, "bidikv_given_back_blocks": 3, "bidikv_given_back_freed": 1,
            "bidikv_give_back_seconds": 0.0}
        assert {k: counts.get(k) for k in SUPERSEDED_KEYS} == {  # no turn ran on D after the given-back one
            "bidikv_superseded_released": 0, "bidikv_superseded_seconds": 0}
        # and once freed, a late renewal is still told why (the router's miss says given_back), also by the
        # listener's own answer for requests D does not hold (it never waits for the scheduler thread then)
        assert cs._answer_heartbeat(held[0].request_id) == {"status": "not_held", "reason": "given_back"}
        raw = ('{"request_id": "%s", "engine_id": "%s"}' % (held[0].request_id, cs.engine_id)).encode()
        assert cs.heartbeats.handle(raw) == (200, {"status": "not_held", "reason": "given_back"})
    finally:
        cs.shutdown()


def test_an_entry_renewed_lately_is_given_back_only_at_the_expiry_it_was_renewed_to(model_dir):
    scheduler, cs, held, waiting = _fill_then_wait(model_dir, "give_back")
    try:
        cs.give_back.withhold_for(10**6, 1021.0)
        assert cs.give_back.free_at(held[-1].request_id) == pytest.approx(1020.0 + WINDOW_S)
        assert cs.give_back.free_at(held[0].request_id) == pytest.approx(1021.0)
        # and while P may still read it, the router is told the expiry it already has, no later one
        answer = cs._answer_heartbeat(held[-1].request_id)
        assert answer["status"] == "held" and answer["renewed"] is False
        assert answer["expiry_time"] == pytest.approx(1020.0 + WINDOW_S)
    finally:
        cs.shutdown()


def test_give_back_needs_the_heartbeat_listener_and_its_keys_need_give_back(model_dir):
    with pytest.raises(ConfigError, match="bidikv_retained_under_pressure.*needs bidikv_heartbeat_port"):
        make_scheduler(make_vllm_config(model_dir, "kv_consumer", {
            "bidirectional_kv_xfer": True, "bidikv_retained_under_pressure": "give_back"}))
    with pytest.raises(ConfigError, match="bidikv_give_back_headroom.*only applies with"):
        make_scheduler(make_vllm_config(model_dir, "kv_consumer", {"bidikv_give_back_headroom": 0.1}))
    with pytest.raises(ConfigError, match="bidikv_give_back_publish_window_s.*must exceed the expiry margin"):
        make_scheduler(make_vllm_config(model_dir, "kv_consumer", {
            "bidikv_retained_under_pressure": "give_back", "bidikv_give_back_publish_window_s": 3,
            "bidikv_heartbeat_port": free_port()}))
