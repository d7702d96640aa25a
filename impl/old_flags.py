"""Command-line flags a ``bidikv`` command no longer takes, refused with the name to use instead.

The names come from :data:`impl.policy.catalogue.RENAMED` and :data:`~impl.policy.catalogue.REMOVED`;
without this argparse would answer "unrecognized arguments", which names neither.
"""

from __future__ import annotations

import argparse
from typing import Any

from impl.policy import catalogue


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Refused(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser.error(self.help_text)

    help_text = ""


def add_refused_flags(parser: argparse.ArgumentParser, surface: str) -> None:
    """A hidden ``--old-name`` (and ``--no-old-name``) per renamed or removed setting of ``surface``."""
    for old in [*catalogue.RENAMED, *(name for where, name in catalogue.REMOVED if where == surface)]:
        message = catalogue.old_name_message(old, surface, _flag)
        if message is None:
            continue
        action = type("Refused", (_Refused,), {"help_text": message})
        parser.add_argument(_flag(old), "--no-" + _flag(old)[2:], action=action, nargs="?", dest=f"refused__{old}",
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)
