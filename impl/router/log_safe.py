"""What a client sends never reaches the router's log raw.

Conversation ids, ``prompt_cache_key``, session ids, model names and URL paths are the client's text.
Written verbatim, a CR or LF starts a line of the client's choosing (a forged ``WARNING``), an ESC
sequence rewrites what a terminal shows, and a bidirectional override reorders it. So:

* :func:`shown` renders one client value for a log line: control, format and line/paragraph separator
  characters (and the backslash, so an escape the client typed cannot pass for one of ours) become
  ``\\xNN`` / ``\\uNNNN``, and the value is cut to :data:`MAX_SHOWN` characters;
* :class:`EscapeFilter`, installed on the router's loggers, applies the same escaping to every
  formatted message as a backstop, so a value some log call passes unescaped still arrives as one line.
  Tracebacks (``exc_info``) are left alone: they are the router's own text.
"""

from __future__ import annotations

import logging
import re

MAX_SHOWN = 128
# C0/C1 controls, DEL, soft hyphen, Arabic letter mark, zero-width and bidi marks, line/paragraph
# separators, bidi embeddings/overrides/isolates, invisible operators, BOM, interlinear annotation
_CONTROLS = "\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb"
_UNSAFE_IN_LINE = re.compile(f"[{_CONTROLS}]")
_UNSAFE_IN_VALUE = re.compile(f"[\\\\{_CONTROLS}]")  # and the backslash: a value's escapes are all ours


def _escape(match: re.Match) -> str:
    c = ord(match.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape(text: str) -> str:
    """``text`` with every character that could break or disguise a log line escaped."""
    return _UNSAFE_IN_LINE.sub(_escape, text)


def escape_value(text: str) -> str:
    """:func:`escape`, and backslashes too, so that an escape a client typed cannot pass for one of ours."""
    return _UNSAFE_IN_VALUE.sub(_escape, text)


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """A client-supplied value as a log line shows it: escaped and at most ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > limit
    text = escape_value(text[:limit] if cut else text)
    return f"{text}...(+{len(value) - limit if isinstance(value, str) else 0} chars)" if cut else text


class EscapeFilter(logging.Filter):
    """Escapes the formatted message of every record (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: logging reports it as it always does
            return True
        safe = escape(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


_FILTER = EscapeFilter()
ROUTER_LOGGERS = ("bidikv.router", "bidikv.router.turns")


def install() -> None:
    """Put :class:`EscapeFilter` on the router's loggers (idempotent)."""
    for name in ROUTER_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


install()
