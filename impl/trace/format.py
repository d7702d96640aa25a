"""``bidikv-router-trace`` version 1: one JSON object per line, what the router saw of every turn.

The first line of every file is a header::

    {"format": "bidikv-router-trace", "version": 1, "started_at": <unix s>, "salt_id": "<8 hex>",
     "sample_rate": <0..1>, "router": "<replica name>"}

then one line per finished or failed turn::

    {"t": <arrival, unix s>, "conversation": "<16 hex>", "tenant": "<16 hex>", "turn": <index>,
     "match": "id"|"prompt_cache_key"|"history"|"none", "miss": <reason>|null, "status": <HTTP status>,
     "prompt_tokens": <int|null>, "cached_tokens": <int|null>, "output_tokens": <int|null>,
     "offered": <int>, "verified": <int|null>, "pulled": <int|null>,
     "ttft_s": <float|null>, "tpot_s": <float|null>, "finish_s": <seconds after t|null>,
     "prefill": "<instance>"|null, "decode": "<instance>"|null,
     "path": "pull_to_p"|"prefill_on_d"|"recompute_on_p"|null}

What it never holds: text, token ids, API keys, conversation ids as sent. ``tenant`` and ``conversation``
are keyed hashes (HMAC-SHA256 with a salt the operator holds, truncated to 64 bits): equal within one
salt, unlinkable without it; ``salt_id`` (a hash of the salt) tells whether two files can be joined.
``turn`` is the turn's index in its conversation as the router counted it (a conversation first seen
mid-way starts at the number of answers its history holds). Counts the router could not see are null:
``prompt_tokens`` and ``cached_tokens`` from P's usage, ``output_tokens`` from D's usage or its events,
``verified``/``pulled`` from our connector's report on P.

A reader rejects a line it cannot use with the line number and the field; unknown fields are ignored
(a later minor addition), a higher ``version`` is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

FORMAT = "bidikv-router-trace"
VERSION = 1
MATCHES = ("id", "prompt_cache_key", "history", "none")
PATHS = ("pull_to_p", "prefill_on_d", "recompute_on_p")  # impl.policy.prefill_on_d.TurnPath's values


@dataclass(frozen=True, slots=True)
class TraceHeader:
    started_at: float
    salt_id: str
    sample_rate: float
    router: str = ""

    def line(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, **asdict(self)}, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class TraceTurn:
    t: float
    conversation: str
    tenant: str
    turn: int
    match: str
    miss: str | None
    status: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    offered: int = 0
    verified: int | None = None
    pulled: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    finish_s: float | None = None
    prefill: str | None = None
    decode: str | None = None
    # pull_to_p | prefill_on_d | recompute_on_p (impl.policy.prefill_on_d.TurnPath); null: a router before it
    path: str | None = None
    tier: str | None = None  # with a host tier: hbm | host | host_miss | none (impl.router.host_tier)

    def line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


_TURN_FIELDS = {f.name: f for f in fields(TraceTurn)}
_INTS = ("turn", "status", "prompt_tokens", "cached_tokens", "output_tokens", "offered", "verified", "pulled")
_FLOATS = ("t", "ttft_s", "tpot_s", "finish_s")
_REQUIRED = ("t", "conversation", "tenant", "turn", "match", "status")


def keyed_hash(salt: bytes, *parts: str) -> str:
    """64 bits of HMAC-SHA256(salt, parts): the same input and salt give the same name, nothing else does."""
    message = "\x00".join(parts).encode("utf-8", "surrogatepass")
    return hmac.new(salt, message, hashlib.sha256).hexdigest()[:16]


def salt_id(salt: bytes) -> str:
    return hashlib.sha256(b"bidikv-trace-salt\x00" + salt).hexdigest()[:8]


class TraceError(ValueError):
    """A trace line the reader cannot use: ``where`` names the file and line, the message the field."""


def parse_header(obj: Any, where: str) -> TraceHeader:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise TraceError(f"{where}: not a {FORMAT} header (the first line of every trace file)")
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise TraceError(f"{where}: field 'version' must be a positive integer, got {version!r}")
    if version > VERSION:
        raise TraceError(f"{where}: version {version} is newer than this reader's ({VERSION}): upgrade bidikv")
    started, rate = obj.get("started_at"), obj.get("sample_rate")
    if not _finite(started):
        raise TraceError(f"{where}: field 'started_at' must be a number, got {started!r}")
    if not _finite(rate) or not 0 < rate <= 1:
        raise TraceError(f"{where}: field 'sample_rate' must be in (0, 1], got {rate!r}")
    return TraceHeader(float(started), str(obj.get("salt_id", "")), float(rate), str(obj.get("router", "")))


def parse_turn(obj: Any, where: str) -> TraceTurn:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a turn must be a JSON object")
    for name in _REQUIRED:
        if obj.get(name) is None:
            raise TraceError(f"{where}: missing field '{name}'")
    values = {}
    for name in _TURN_FIELDS:
        if name not in obj:
            continue
        value = obj[name]
        if value is None:
            values[name] = None
        elif name in _INTS:
            if type(value) is not int or value < 0:
                raise TraceError(f"{where}: field '{name}' must be an integer >= 0, got {value!r}")
            values[name] = value
        elif name in _FLOATS:
            if not _finite(value) or value < 0:
                raise TraceError(f"{where}: field '{name}' must be a finite number >= 0, got {value!r}")
            values[name] = float(value)
        else:
            if not isinstance(value, str):
                raise TraceError(f"{where}: field '{name}' must be a string, got {value!r}")
            values[name] = value
    if values["match"] not in MATCHES:
        raise TraceError(f"{where}: field 'match' must be one of {', '.join(MATCHES)}, got {values['match']!r}")
    if values.get("path") is not None and values["path"] not in PATHS:
        raise TraceError(f"{where}: field 'path' must be one of {', '.join(PATHS)}, got {values['path']!r}")
    return TraceTurn(**values)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
