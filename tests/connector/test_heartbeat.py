"""D's heartbeat listener on a real vLLM scheduler: heartbeats over the real socket, applied by the
scheduler thread; what D then enforces (the deadline in the worker's metadata) and publishes (the
expiry on the basis of ``remote_blocks_expiry_time``)."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings, strategies as st

import vllm  # noqa: F401  (a missing vLLM is a failure, not a skip)

from impl.connector.config import ConfigError, ConnectorSettings
from impl.connector.heartbeat import HEARTBEAT_PATH, HeartbeatListener, parse_heartbeat
from tests.connector.harness import connector_scheduler, make_scheduler, make_vllm_config
from tests.connector.test_scheduler import NOTIFY, decode_node, finish_on_decode, release

LEASE = {"bidikv_retention": "lease", "bidikv_lease_s": 30, "bidikv_heartbeat_interval_s": 10,
         "bidikv_lease_max_hold_s": 100}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body, timeout: float = 5.0) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=raw, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Heartbeat(threading.Thread):
    """One heartbeat posted from another thread, as the router would: it blocks until D answers."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.result = url, body, None
        self.start()

    def run(self) -> None:
        self.result = post(self.url, self.body)


def wait_queued(cs, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cs.heartbeats.pending():
        assert time.monotonic() < end, "the heartbeat never reached the scheduler's queue"
        time.sleep(0.002)


def lease_node(model_dir, **extra):
    scheduler = decode_node(model_dir, **LEASE, bidikv_heartbeat_host="127.0.0.1",
                            bidikv_heartbeat_port=free_port(), **extra)
    cs = connector_scheduler(scheduler)
    return scheduler, cs


@pytest.fixture
def shutdown():
    nodes = []
    yield nodes.append
    for scheduler in nodes:
        connector_scheduler(scheduler).shutdown()


def test_renewal_over_the_socket_extends_what_d_enforces_and_publishes(model_dir, shutdown):
    scheduler, cs = lease_node(model_dir)
    shutdown(scheduler)
    req, params = finish_on_decode(scheduler, 60)
    assert params["remote_blocks_expiry_time"] == pytest.approx(1030.0)
    assert cs.notifier.heartbeat_urls == [cs.heartbeats.url]  # the router learns where to heartbeat
    assert cs.heartbeats.url.endswith(f":{cs.heartbeats.port}{HEARTBEAT_PATH}")
    scheduler.schedule()  # the finish-time deadline went out

    beat = Heartbeat(cs.heartbeats.url, {"request_id": req.request_id, "engine_id": cs.engine_id})
    wait_queued(cs)
    assert beat.result is None  # only the scheduler's thread answers, at its next step
    cs._clock.t = 1010.0
    so = scheduler.schedule()
    beat.join(5)
    status, answer = beat.result
    assert status == 200 and answer["status"] == "held" and answer["renewed"] is True
    assert answer["expiry_time"] == pytest.approx(1040.0)  # same basis as remote_blocks_expiry_time
    assert answer["expires_in_s"] == pytest.approx(30.0) and answer["heartbeat_interval_s"] == 10
    assert answer["retention"] == "lease"
    # what D enforces: the worker gets the renewed deadline with this very step
    assert so.kv_connector_metadata.reqs_to_send[req.request_id] == pytest.approx(1040.0)
    assert cs._retained[req.request_id][1] == pytest.approx(1040.0)


def test_an_idle_sleeping_scheduler_answers_within_a_slice_and_sends_the_deadline_next_step(model_dir, shutdown):
    """Order, not timing: the step is idle-waiting, the heartbeat arrives, the step ends -- before its
    30 s pause (the longest the config allows) could have: a deadline, not a window."""
    scheduler, cs = lease_node(model_dir, bidikv_idle_step_sleep_s=30.0)
    shutdown(scheduler)
    req, _ = finish_on_decode(scheduler, 61)
    busy, idle = queue.Queue(), queue.Queue()  # engine inboxes, as inside an engine core: the idle wait polls it
    busy.put("new input")  # a step with input waiting never idles
    waiting = threading.Event()

    def sleep(seconds: float) -> None:  # the real sleep, and a signal that the idle wait has begun
        waiting.set()
        time.sleep(seconds)

    cs._sleep = sleep
    cs._engine_inbox = busy
    scheduler.schedule()
    assert not waiting.is_set()
    cs._engine_inbox = idle
    cs._clock.t = 1012.0
    step: dict = {}
    stepping = threading.Thread(target=lambda: step.setdefault("out", scheduler.schedule()), daemon=True)
    stepping.start()  # nothing to run: it waits, until the heartbeat arrives
    assert waiting.wait(20), "the idle step never started waiting"
    assert stepping.is_alive() and "out" not in step  # still waiting: nothing but a heartbeat can end it now
    beat = Heartbeat(cs.heartbeats.url, {"request_id": req.request_id})
    stepping.join(20)
    assert not stepping.is_alive(), "the idle step did not end on the heartbeat"
    so = step["out"]
    assert req.request_id not in so.kv_connector_metadata.reqs_to_send  # this step's metadata was built
    beat.join(60)
    assert beat.result[1]["expiry_time"] == pytest.approx(1042.0)
    cs._engine_inbox = busy
    so = scheduler.schedule()
    assert so.kv_connector_metadata.reqs_to_send[req.request_id] == pytest.approx(1042.0)


def test_a_renewal_after_expiry_does_nothing(model_dir, shutdown):
    scheduler, cs = lease_node(model_dir)
    shutdown(scheduler)
    req, _ = finish_on_decode(scheduler, 62)
    scheduler.schedule()
    beat = Heartbeat(cs.heartbeats.url, {"request_id": req.request_id})
    wait_queued(cs)
    cs._clock.t = 1030.5  # past the lease; the worker has not reaped it yet
    so = scheduler.schedule()
    beat.join(5)
    assert beat.result == (200, {"status": "not_held", "reason": "expired"})
    assert req.request_id not in so.kv_connector_metadata.reqs_to_send
    assert cs._retained[req.request_id][1] == pytest.approx(1030.0)


def test_requests_d_does_not_hold_are_answered_without_a_step(model_dir, shutdown):
    scheduler, cs = lease_node(model_dir)
    shutdown(scheduler)
    req, _ = finish_on_decode(scheduler, 63)
    # no schedule() below: an engine that holds nothing does not step, so these must not wait for one
    assert post(cs.heartbeats.url, {"request_id": "never-seen"}) == (200, {"status": "not_held", "reason": "unknown"})
    assert post(cs.heartbeats.url, {"request_id": req.request_id, "engine_id": "another-engine"}) == \
        (200, {"status": "not_held", "reason": "other_engine"})
    release(scheduler, req.request_id)  # P's next turn read the blocks
    assert post(cs.heartbeats.url, {"request_id": req.request_id}) == (200, {"status": "not_held", "reason": "unknown"})


def test_other_policies_hold_but_do_not_renew(model_dir, shutdown):
    scheduler = decode_node(model_dir, bidikv_heartbeat_host="127.0.0.1", bidikv_heartbeat_port=free_port())
    shutdown(scheduler)
    cs = connector_scheduler(scheduler)
    req, params = finish_on_decode(scheduler, 64)
    scheduler.schedule()
    beat = Heartbeat(cs.heartbeats.url, {"request_id": req.request_id})
    wait_queued(cs)
    cs._clock.t = 1005.0
    so = scheduler.schedule()
    beat.join(5)
    status, answer = beat.result
    assert status == 200 and answer["status"] == "held" and answer["renewed"] is False
    assert answer["retention"] == "ttl" and answer["expiry_time"] == pytest.approx(params["remote_blocks_expiry_time"])
    assert answer["expires_in_s"] == pytest.approx(15.0) and "heartbeat_interval_s" not in answer
    assert req.request_id not in so.kv_connector_metadata.reqs_to_send


def test_malformed_heartbeats_are_rejected_naming_the_field(model_dir, shutdown):
    scheduler, cs = lease_node(model_dir)
    shutdown(scheduler)
    url = cs.heartbeats.url
    assert post(url, b"not json")[0] == 400
    status, body = post(url, {"request_id": 7})
    assert status == 400 and body["error"].startswith("request_id:")
    status, body = post(url, {"request_id": "r", "engine_id": ["x"]})
    assert status == 400 and body["error"].startswith("engine_id:")
    assert post(url.replace(HEARTBEAT_PATH, "/elsewhere"), {"request_id": "r"})[0] == 404
    assert post(url, b"x" * 5000)[0] == 400


def test_no_listener_without_the_key_or_on_a_producer(model_dir):
    assert connector_scheduler(decode_node(model_dir, **LEASE)).heartbeats is None
    port = free_port()
    producer = make_scheduler(make_vllm_config(model_dir, "kv_producer", {
        "bidirectional_kv_xfer": True, "bidikv_heartbeat_port": port}))
    assert connector_scheduler(producer).heartbeats is None
    with socket.socket() as s:  # P did not take the port D of the same extra config needs
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("key, value", [
    ("bidikv_heartbeat_port", -1), ("bidikv_heartbeat_port", 65536), ("bidikv_heartbeat_port", "8000"),
    ("bidikv_heartbeat_port", True), ("bidikv_heartbeat_port", 80.0),
    ("bidikv_heartbeat_host", ""), ("bidikv_heartbeat_host", "http://d:9000"), ("bidikv_heartbeat_host", 5),
])
def test_bad_heartbeat_keys_are_rejected_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"\['{key}'\]"):
        ConnectorSettings.from_extra_config({key: value})


def test_defaults_and_good_values():
    s = ConnectorSettings.from_extra_config({})
    assert (s.heartbeat_port, s.heartbeat_host) == (0, "0.0.0.0")
    s = ConnectorSettings.from_extra_config({"bidikv_heartbeat_port": 9100, "bidikv_heartbeat_host": "10.0.0.7"})
    assert (s.heartbeat_port, s.heartbeat_host) == (9100, "10.0.0.7")


def test_a_taken_port_stops_the_scheduler_naming_the_key(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=r"\['bidikv_heartbeat_port'\].*cannot listen"):
            decode_node(model_dir, **LEASE, bidikv_heartbeat_host="127.0.0.1", bidikv_heartbeat_port=port)


# -- the listener alone -----------------------------------------------------------------------------

def test_a_scheduler_that_does_not_drain_in_time_gets_busy_not_a_hang():
    listener = HeartbeatListener("127.0.0.1", 0, "e", lambda rid: True, answer_timeout_s=0.2)
    try:
        # nothing drains: the answer is 503 after the listener's own 0.2 s, never the client's 60 s timeout
        assert post(listener.url, {"request_id": "r"}, timeout=60) == (503, {"status": "busy"})
        # applied late all the same once the scheduler gets to it (the router kept its old expiry)
        assert listener.drain(lambda rid: {"status": "held"}) == 1
    finally:
        listener.close()


def test_pending_heartbeats_are_bounded():
    listener = HeartbeatListener("127.0.0.1", 0, "e", lambda rid: True, answer_timeout_s=3.0, max_pending=1)
    try:
        first = Heartbeat(listener.url, {"request_id": "a"})
        end = time.monotonic() + 5
        while not listener.pending():
            assert time.monotonic() < end
            time.sleep(0.002)
        assert post(listener.url, {"request_id": "b"}) == (503, {"status": "busy"})
        listener.drain(lambda rid: {"status": "held", "rid": rid})
        first.join(5)
        assert first.result == (200, {"status": "held", "rid": "a"})
    finally:
        listener.close()


def test_the_advertised_url_names_a_reachable_host():
    listener = HeartbeatListener("0.0.0.0", 0, "e", lambda rid: False, advertised_host="d-node-3")
    try:
        assert listener.url == f"http://d-node-3:{listener.port}{HEARTBEAT_PATH}"
    finally:
        listener.close()


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                              lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
                              max_leaves=8).map(lambda v: json.dumps(v).encode()),
                 st.fixed_dictionaries({"request_id": st.text(max_size=600)},
                                       optional={"engine_id": st.none() | st.text(max_size=600) | st.integers()}
                                       ).map(lambda v: json.dumps(v).encode())))
def test_any_body_is_a_heartbeat_or_a_400_naming_the_field(raw):
    try:
        request_id, engine_id = parse_heartbeat(raw)
    except ValueError as e:
        assert str(e).split(":")[0] in ("body", "request_id", "engine_id")
        return
    body = json.loads(raw)
    assert request_id == body["request_id"] and 0 < len(request_id) <= 512
    assert engine_id is None or (isinstance(engine_id, str) and engine_id == body["engine_id"])
