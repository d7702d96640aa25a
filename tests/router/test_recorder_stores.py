"""What the router refuses to store after a turn D finished (each of these once survived
every router test as a one-line mutant of impl/router/recorder.py).

The fakes below are scripted D instances (tests.router.fakes) answering in ways a real vLLM D can but
not on demand: a reasoning delta, params missing a field, params echoing the request's notify field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.router.fakes import FakeVllmUpstream
from tests.router.harness import Deployment


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def offered_params(dep: Deployment, turn: int) -> dict:
    return dep.p.prefill_requests()[turn]["kv_transfer_params"]


@dataclass
class ReasoningDecode(FakeVllmUpstream):
    """Fake D whose chat deltas carry ``reasoning_content`` (a reasoning parser's output)."""

    def _chunk(self, chat: bool, text: str, index: int, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        chunk = super()._chunk(chat, text, index, finish, **extra)
        if chat:
            chunk["choices"][0]["delta"]["reasoning_content"] = "thinking..."
        return chunk


@dataclass
class BrokenParamsDecode(FakeVllmUpstream):
    """Fake D whose params lack its engine id (P could not find the blocks)."""

    def _d_params(self, body: dict[str, Any]) -> dict[str, Any]:
        params = super()._d_params(body)
        params["remote_engine_id"] = None
        return params


@dataclass
class EchoingDecode(FakeVllmUpstream):
    """Fake D that returns the request's own kv_transfer_params keys along with its own, notify field included."""

    def _d_params(self, body: dict[str, Any]) -> dict[str, Any]:
        params = super()._d_params(body)
        return {**(body.get("kv_transfer_params") or {}), **params}


def deployment(fake: type) -> Deployment:
    dep = Deployment()
    dep.decodes = [fake("d0", role="decode", style="final_chunk")]
    return dep


async def stored(dep: Deployment, cid: str):
    got = dep.router.store.get("default", cid)
    if hasattr(got, "__await__"):
        got = await got
    return getattr(got, "entry", got)


async def test_a_turn_whose_answer_cannot_be_resent_exactly_is_not_stored():
    async with deployment(ReasoningDecode) as dep:
        r1 = await dep.chat([user("q1")], conversation_id="c")
        assert r1.status == 200 and r1.done
        await dep.settle()
        assert await stored(dep, "c") is None
        assert dep.router.metrics.turns_not_stored.get("unreconstructable") == 1
        await dep.chat([user("q1"), {"role": "assistant", "content": r1.answer}, user("q2")], conversation_id="c")
        assert not offered_params(dep, 1).get("remote_block_ids")


async def test_params_p_cannot_use_are_not_stored():
    async with deployment(BrokenParamsDecode) as dep:
        r1 = await dep.chat([user("q1")], conversation_id="c")
        assert r1.status == 200 and r1.done
        await dep.settle()
        assert await stored(dep, "c") is None
        assert dep.router.metrics.turns_not_stored.get("invalid_params") == 1


async def test_the_notify_secret_of_a_finished_turn_never_reaches_p():
    async with deployment(EchoingDecode) as dep:
        r1 = await dep.chat([user("q1")], conversation_id="c")
        assert r1.status == 200 and r1.done
        assert "bidikv_notify" in dep.d.decode_requests()[0]["kv_transfer_params"]  # D was given one
        await dep.settle()
        await dep.chat([user("q1"), {"role": "assistant", "content": r1.answer}, user("q2")], conversation_id="c")
        sent = offered_params(dep, 1)
        assert sent.get("remote_block_ids") and "bidikv_notify" not in sent
