"""What a client sends never reaches the log raw: control characters sent through every client field
(conversation id, session id, prompt_cache_key, model, cache_salt, the heartbeat path) arrive escaped,
one line per record; and the turn line says why a turn missed."""

from __future__ import annotations

import logging
from urllib.parse import quote

from tests.router.harness import Deployment
from tests.router.test_give_back_renewal import give_back_deployment, two_turns
from tests.router.test_heartbeat import user

FORGED = "x\r\nWARNING bidikv.router: forged\x1b[2J\x1b]0;title\x07\u202eevil\u2028end"


def _raw_control(text: str) -> bool:
    return any(c in text for c in ("\r", "\n", "\x1b", "\x07", "\u202e", "\u2028"))


async def test_control_characters_in_every_client_field_reach_the_log_escaped(caplog):
    caplog.set_level(logging.DEBUG)
    async with Deployment(chunks=2) as dep:
        for field in ("conversation_id", "session_id", "prompt_cache_key"):
            for turn in range(2):  # the second turn logs the key it was looked up under as well
                r = await dep.chat([user(f"{field} q{turn}")], **{field: FORGED})
                assert r.status == 200, (field, r.body)
                await dep.settle()
        await dep.chat([user("m")], model=FORGED)
        await dep.chat([user("s")], cache_salt=FORGED)
        await dep.post("/v1/conversations/" + quote(FORGED, safe="") + "/heartbeat", {})
        await dep.post("/v1/completions", None, raw=b'{"prompt": "' + FORGED.encode("unicode_escape") + b'", "model": 1}')
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("bidikv")]
    turns = [m for m in lines if m.startswith("turn ")]
    assert len(turns) >= 8
    assert not [m for m in lines if _raw_control(m)]
    escaped = [m for m in turns if "\\x0d\\x0aWARNING" in m]
    assert len(escaped) >= 6, turns  # key= and next= of every id / key turn show it, escaped


async def test_the_turn_line_says_why_a_turn_missed(caplog):
    caplog.set_level(logging.INFO, logger="bidikv.router.turns")
    async with give_back_deployment("given_back") as dep:
        await two_turns(dep, "gb-why")
    turns = [r.getMessage() for r in caplog.records if r.name == "bidikv.router.turns"]
    assert len(turns) == 2
    assert "miss=unknown" in turns[0]  # the first turn: never stored
    assert "offered=0 miss=given_back" in turns[1]
