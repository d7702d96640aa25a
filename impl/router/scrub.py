"""KV locations never reach a client: the fail-closed filter on everything P and D send back.

D's ``kv_transfer_params`` (block ids, engine id, host and port of its KV side channel) and the
router's own ``bidikv_notify`` field are what a client would need to read KV that is not its own.
:mod:`impl.router.capture` takes the params D's final chunk carries; this module guarantees, whatever
the upstream sent, that no spelling of them gets past the router:

* JSON lets a key be written with escapes (``"kv_transfer_param\\u0073"``), so a literal substring
  test misses it; the params can also sit below the top level, and a payload that is not JSON cannot
  be cleaned at all.
* A payload without ``\\u`` and without (in any letter case: Go's encoding/json, for one, matches
  keys without case) a fragment of a sensitive name cannot spell one in any JSON encoding; that is
  nearly every chunk vLLM streams, and it passes unparsed. The test is ``bytes.lower`` and substring
  searches, ~0.9 us for a 200-byte chunk here; a case-insensitive regex took 4 us.
* Anything else is parsed, every sensitive key is removed at any depth, and what goes out is the
  re-encoded result, never the upstream's bytes: JSON with a key twice (``{"x": {"remote_host": ..},
  "x": 1}``) parses to its last value here but to its first in some clients. A payload that cannot be
  parsed is refused: the caller replaces it with an error (SSE) or a 502 (a body). Refusing is the
  only choice that cannot leak: the router cannot tell what a non-JSON reader would make of it.
"""

from __future__ import annotations

import json
from typing import Any

KV_KEY = "kv_transfer_params"


def suspect(data: bytes) -> bool:
    """Whether ``data`` could spell a sensitive key: every one contains one of these fragments, and
    spelt with any escape its text contains ``\\u``."""
    if b"\\" in data and b"\\u" in data:  # the one-byte search is memchr; most chunks have no backslash
        return True
    lowered = data.lower()
    return b"kv_transfer" in lowered or b"remote_" in lowered or b"bidikv" in lowered


def is_sensitive_key(key: str) -> bool:
    """Keys that name or hold KV locations: ``kv_transfer_params`` and its ``remote_*`` /
    ``do_remote_*`` fields, the router's ``bidikv_*`` fields; matched in any letter case so that a
    reader that folds case finds nothing either."""
    k = key.casefold()
    return "kv_transfer" in k or k.startswith(("remote_", "do_remote_", "bidikv"))


def _strip(value: Any) -> tuple[Any, bool]:
    """``value`` without sensitive keys at any depth, and whether any was removed."""
    # iterative: a hostile but parseable payload can nest up to json's own recursion limit
    changed = False
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in [k for k in node if is_sensitive_key(k)]:
                del node[key]
                changed = True
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return value, changed


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def scrub_event(data: bytes) -> tuple[bytes, bytes] | None:
    """One SSE data payload of D's: ``(for_client, for_capture)``, or None if it must not be sent.

    ``for_capture`` keeps a top-level ``kv_transfer_params`` object, re-encoded with the key spelt
    literally, so that capture takes D's params from it however D escaped the name; every other
    sensitive key is gone from both. A payload that cannot spell one comes back as the same bytes object.
    """
    if not suspect(data):
        return data, data
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    params = obj.pop(KV_KEY, None) if isinstance(obj, dict) else None
    _, changed = _strip(obj)
    client = _encode(obj)
    if isinstance(params, dict) and params:
        if not changed and b'"kv_transfer_params"' in data:
            # D's params, spelt plainly, are all there is to hide: capture finds the key, decodes the
            # payload itself and what it sends on is re-encoded from that, never these bytes. Saves
            # encoding the params again (2,000 block ids: ~60 us)
            return client, data
        obj[KV_KEY] = params
        return client, _encode(obj)
    return client, client


def scrub_body(raw: bytes) -> bytes | None:
    """A whole JSON body from P or D: the bytes to send the client, or None if it must not be sent."""
    if not suspect(raw):
        return raw
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    _strip(obj)
    return _encode(obj)
