"""D's ``kv_transfer_params`` held compactly until P needs them.

Almost all of a stored conversation is D's ``remote_block_ids``: one Python int object per block
(28 bytes, plus 8 for its slot in the list), ~80 KB for 2,000 blocks (a 32k-token context). vLLM
hands out blocks from a free queue, so a request's ids are one contiguous run more often than not;
those are kept as a ``range`` (48 bytes whatever the length), the others as a machine-int
``array`` (4 bytes an id). :class:`CompactParams` is a read-only mapping: whoever reads the params
(``dict(params)``, ``params.get(...)``) gets exactly the lists D sent, rebuilt at C speed (~10 us for
2,000 ids), and a hit rebuilds them once per turn.

A group that is not a list of ints is kept as it came: the compact form is an optimisation that
must never change what P is offered. (A bool among ids would come back as the int it equals, which
Python, and so vLLM, treats alike.)
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, Iterator, Mapping

BLOCK_IDS = "remote_block_ids"


def _pack_group(group: Any) -> Any:
    """One group of ids as a range or an array, or the group itself if it cannot be packed exactly."""
    if type(group) is not list or not group:
        return group
    first, last = group[0], group[-1]
    if type(first) is int and type(last) is int and last - first == len(group) - 1 \
            and group == list(range(first, last + 1)):
        return range(first, last + 1)
    for code in ("i", "q"):  # 4 bytes an id when they fit (vLLM's block ids do), else 8
        try:
            return array(code, group)  # refuses floats, strings, None, lists: those stay verbatim
        except OverflowError:
            continue
        except TypeError:
            return group
    return group


def _unpack_group(group: Any) -> Any:
    if type(group) is range:
        return list(group)
    if type(group) is array:
        return group.tolist()
    return group


class CompactParams(Mapping[str, Any]):
    """D's params with ``remote_block_ids`` packed; reads give back D's exact lists."""

    __slots__ = ("_fields", "_groups", "_packed")

    def __init__(self, params: Mapping[str, Any]) -> None:
        fields = dict(params)
        blocks = fields.get(BLOCK_IDS)
        self._packed = type(blocks) is list and bool(blocks)
        if self._packed:
            self._groups = tuple(_pack_group(g) for g in blocks)
            fields[BLOCK_IDS] = None  # keeps the key's place: D's key order, byte for byte when re-encoded
        else:
            self._groups = ()
        self._fields = fields

    def __getitem__(self, key: str) -> Any:
        if key == BLOCK_IDS and self._packed:
            return [_unpack_group(g) for g in self._groups]
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"CompactParams({dict(self)!r})"

    def group_bytes(self) -> int:
        """Bytes the packed block ids take (the rest is sized like any dict)."""
        size = sys.getsizeof(self._groups)
        for g in self._groups:
            size += sys.getsizeof(g) if type(g) in (range, array) else 0
        return size

    def fields(self) -> dict[str, Any]:
        """The params, the packed block ids' place holding None (for sizing)."""
        return self._fields

    def unpacked_groups(self) -> list[Any]:
        """Groups that could not be packed, as D sent them (for sizing)."""
        return [g for g in self._groups if type(g) not in (range, array)]
