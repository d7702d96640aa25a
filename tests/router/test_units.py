"""The router's small pieces on their own: request views, the notify hub, config/CLI, tenants, metrics."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from impl.policy import ItemsPrompt, continues
from impl.router.cli import config_from_args, register
from impl.router.config import RouterConfig, build_config, host_port_urls
from impl.router.metrics import RouterMetrics
from impl.router.notify import Delivery, Notification, NotifyError, NotifyHub, parse_notification
from impl.router.request import RequestError, parse_json_body, parse_turn
from impl.router.tenants import DEFAULT_TENANT, Tenants

# -- request parsing ----------------------------------------------------------------------------------


def test_chat_view_held_sequence_continues_into_the_next_turn():
    msgs = [{"role": "user", "content": "a"}]
    t1 = parse_turn("chat", {"messages": msgs}, None, 256)
    held_len, digest = t1.held_sequence("answer", None)
    nxt = parse_turn("chat", {"messages": msgs + [{"role": "assistant", "content": "answer"}, {"role": "user", "content": "b"}]}, None, 256)
    assert continues(nxt.view, held_len, digest)
    stripped = parse_turn("chat", {"messages": msgs + [{"role": "assistant", "content": "answe"}, {"role": "user", "content": "b"}]}, None, 256)
    assert not continues(stripped.view, held_len, digest)


def test_token_view_needs_output_ids():
    t = parse_turn("completion", {"prompt": [1, 2, 3]}, None, 256)
    assert t.prompt_kind == "tokens" and t.held_sequence("x", None) is None
    held_len, digest = t.held_sequence("x", [9])
    assert continues(ItemsPrompt((1, 2, 3, 9, 4)), held_len, digest)


@pytest.mark.parametrize("body,field", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "conversation_id": 5}, "conversation_id"),
    ({"messages": [{"role": "user", "content": "x"}], "conversation_id": "x" * 300}, "conversation_id"),
    ({"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {}}, "kv_transfer_params"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0]"),
])
def test_chat_validation_names_the_field(body, field):
    with pytest.raises(RequestError) as e:
        parse_turn("chat", body, None, 256)
    assert e.value.field == field and e.value.status == 400


@pytest.mark.parametrize("body,field", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, 2**40]}, "prompt[1]"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
])
def test_completion_validation_names_the_field(body, field):
    with pytest.raises(RequestError) as e:
        parse_turn("completion", body, None, 256)
    assert e.value.field == field


def test_body_and_header_ids_must_agree():
    with pytest.raises(RequestError):
        parse_turn("chat", {"messages": [{"role": "user", "content": "x"}], "conversation_id": "a"}, "b", 256)
    t = parse_turn("chat", {"messages": [{"role": "user", "content": "x"}]}, "hdr", 256)
    assert t.conversation_id == "hdr" and "conversation_id" not in t.body


@pytest.mark.parametrize("raw", [b"", b"[1]", b"\xff\xfe", b"{", b"[" * 100_000, b'{"a": ' + b"1" * 5000 + b"}"])
def test_bad_json_bodies(raw):
    with pytest.raises(RequestError) as e:
        parse_json_body(raw)
    assert e.value.field == "body"


def test_batched_and_multi_choice_requests_are_not_reused():
    assert parse_turn("completion", {"prompt": ["a", "b"]}, "c", 256).view is None
    assert parse_turn("completion", {"prompt": "a", "n": 2}, "c", 256).unsupported
    assert parse_turn("chat", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "c", 256).view is None


# -- notify hub ------------------------------------------------------------------------------------------


async def test_hub_delivery_rules():
    hub = NotifyHub()
    token = hub.open("t1")
    n = Notification({"remote_block_ids": [[1]]}, 10.0, 0.0)
    assert hub.deliver("t1", "wrong", n) is Delivery.BAD_TOKEN
    assert hub.deliver("nope", token, n) is Delivery.UNKNOWN_TURN
    waiter = asyncio.ensure_future(hub.wait("t1", 1.0))
    await asyncio.sleep(0)
    assert hub.deliver("t1", token, n) is Delivery.ACCEPTED
    assert await waiter is n
    assert hub.deliver("t1", token, n) is Delivery.DUPLICATE
    hub.close("t1")
    assert hub.deliver("t1", token, n) is Delivery.UNKNOWN_TURN and len(hub) == 0


async def test_hub_wait_times_out_and_close_wakes_waiters():
    hub = NotifyHub()
    hub.open("t")
    assert await hub.wait("t", 0.05) is None
    waiter = asyncio.ensure_future(hub.wait("t", 5.0))
    await asyncio.sleep(0)
    hub.close("t")
    assert await asyncio.wait_for(waiter, 1.0) is None


@pytest.mark.parametrize("body,field", [
    ([], "body"), ({"token": "x", "kv_transfer_params": {"a": 1}}, "turn"), ({"turn": "t", "kv_transfer_params": {"a": 1}}, "token"),
    ({"turn": "t", "token": "x", "kv_transfer_params": []}, "kv_transfer_params"),
    ({"turn": "t", "token": "x", "kv_transfer_params": {"a": 1}, "expires_in_s": -1}, "expires_in_s"),
    ({"turn": "t", "token": "x", "kv_transfer_params": {"a": 1}, "expires_in_s": True}, "expires_in_s"),
    ({"turn": "t", "token": "x", "retained": "no"}, "retained"),
    ({"turn": "t", "token": "x", "retained": False, "kv_transfer_params": {"a": 1}}, "kv_transfer_params"),
    ({"turn": "t", "token": "x", "retained": True}, "kv_transfer_params"),  # retained needs its params
])
def test_notification_validation(body, field):
    with pytest.raises(NotifyError) as e:
        parse_notification(body)
    assert e.value.field == field


# -- config and CLI ----------------------------------------------------------------------------------


def parse_cli(argv: list[str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["router", *argv]))


def test_cli_defaults_come_from_the_dataclass_and_vllm_flags_work(tmp_path):
    cfg = parse_cli(["--prefill", "http://p:1/v1/", "--decoder-hosts", "d", "--decoder-ports", "2", "3"])
    assert cfg.prefill == ("http://p:1",) and cfg.decode == ("http://d:2", "http://d:3")
    assert cfg.max_conversations == RouterConfig().max_conversations and cfg.notify is True
    toml = tmp_path / "r.toml"
    toml.write_text('[router]\nprefill = ["http://a:1"]\ndecode = ["http://b:2"]\nplacement = "kv_aware"\nmax_conversations = 7\n')
    cfg = parse_cli(["--config", str(toml), "--max-conversations", "9", "--no-notify", "--health-interval-s", "0.5"])
    assert cfg.placement == "kv_aware" and cfg.max_conversations == 9 and cfg.notify is False
    assert cfg.health_interval_s == 0.5 and cfg.prefill == ("http://a:1",)


def test_config_errors_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match="placement"):
        build_config(overrides={"placement": "random"})
    with pytest.raises(ValueError, match="max_conversations"):
        build_config(overrides={"max_conversations": 0})
    with pytest.raises(ValueError, match="http://"):
        build_config(overrides={"prefill": ["p:1"]})
    bad = tmp_path / "bad.toml"
    bad.write_text("prefil = []\n")
    with pytest.raises(ValueError, match="prefil"):
        parse_cli(["--config", str(bad)])
    with pytest.raises(ValueError, match="host"):
        host_port_urls(["a", "b"], [1, 2, 3], "prefill")
    with pytest.raises(ValueError, match="prefill instance"):
        RouterConfig(decode=("http://d:1",)).require_upstreams()


# -- tenants and metrics ----------------------------------------------------------------------------------


def test_tenants_from_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nacme key-1\nacme key-2\n\nglobex key-3\n")
    t = Tenants.load(str(f), "K", {"K": "initech=key-4"})
    assert t.tenant_for("Bearer key-2") == "acme" and t.tenant_for("bearer key-4") == "initech"
    assert t.tenant_for("Bearer nope") is None and t.tenant_for(None) is None and t.tenant_for("Basic key-1") is None
    assert Tenants.load(None, "K", {}).tenant_for(None) == DEFAULT_TENANT
    with pytest.raises(ValueError, match="two tenants"):
        Tenants.load(None, "K", {"K": "a=x,b=x"})


def test_metrics_render_prometheus_text():
    m = RouterMetrics()
    m.requests.inc("/v1/completions", "200")
    m.reuse_misses.inc('we"ird\nreason')
    m.ttft.observe(0.003)
    text = m.registry.render()
    assert 'bidikv_router_requests_total{route="/v1/completions",status="200"} 1' in text
    assert 'reason="we\\"ird\\nreason"' in text
    assert 'bidikv_router_ttft_seconds_bucket{le="0.0025"} 0' in text
    assert 'bidikv_router_ttft_seconds_bucket{le="0.005"} 1' in text
    assert "# TYPE bidikv_router_ttft_seconds histogram" in text


# -- the body shared by P's and D's requests ----------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

from impl.router.proxy import _PER_UPSTREAM_KEYS, _SharedBody  # noqa: E402

_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                            max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["model", "messages", "temperature", 'a"b', *sorted(_PER_UPSTREAM_KEYS)]),
                            _json_values, max_size=8),
       extra=st.dictionaries(st.sampled_from(sorted(_PER_UPSTREAM_KEYS)), _json_values, max_size=3))
def test_shared_body_encodes_the_same_object_as_the_whole_body(body, extra):
    import json

    shared = _SharedBody(body)
    assert json.loads(shared.encode({**shared.own, **extra})) == {**body, **extra}
