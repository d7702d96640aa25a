"""A turn in flight and the record it leaves; the table a run keeps them in; the summary computed from them.

The record is filled in as the turn moves through router, prefill, interconnect and decode; every
duration is measured on the simulator's clock, never predicted.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Sequence as _SequenceABC
from dataclasses import dataclass, fields
from itertools import islice
from operator import attrgetter, itemgetter
from typing import Iterable, Iterator, Sequence

from impl.bench.stats import PROMPT_BUCKETS, bucket_label, percentile


@dataclass(slots=True)
class TurnRecord:
    conversation: str
    turn: int
    tenant: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    prefill_instance: str = ""
    decode_instance: str = ""
    store_hit: bool = False
    miss_reason: str = ""  # store miss reason, or why a hit was not pulled in the end
    decision: str = ""  # pull / recompute / none
    decision_reason: str = ""
    p_local_hit_tokens: int = 0
    reused_tokens: int = 0  # pulled D->P
    recomputed_tokens: int = 0  # computed on P
    d2p_transfer_s: float = 0.0
    p_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    reuse_overhead_s: float = 0.0
    d_local_hit_tokens: int = 0
    p2d_tokens: int = 0
    p2d_transfer_s: float = 0.0
    d_queue_s: float = 0.0
    ttft_s: float = math.nan
    completion_s: float = math.nan
    preempted: int = 0
    rejected: str = ""  # non-empty: why the turn did not complete
    # token-exact reuse (as P's connector reports it, each beyond P's local hit): D's tokens the router
    # offered (min(held, prompt) - local hit), the part of them P verified equal to its prompt's ids,
    # and what it pulled (the recompute policy decides on the verified count)
    offered_tokens: int = 0
    verified_tokens: int = 0
    pulled_tokens: int = 0

    @property
    def prefill_s(self) -> float:
        """The published "prefill duration": D->P pull + compute + reuse overhead on P."""
        return prefill_duration_s(self.d2p_transfer_s, self.prefill_compute_s, self.reuse_overhead_s)

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first, NaN with fewer than two: a simulated turn's first
        token comes alone with the prefill (no stream to fall behind on; a bench turn's is
        calibration.bench_records.BenchRecord.tpot_s)."""
        if self.output_tokens < 2:
            return math.nan
        return (self.completion_s - self.arrival_s - self.ttft_s) / (self.output_tokens - 1)


def prefill_duration_s(d2p_transfer_s: float, prefill_compute_s: float, reuse_overhead_s: float) -> float:
    """TurnRecord.prefill_s of these fields (for a summary reading them from a table's columns)."""
    return d2p_transfer_s + prefill_compute_s + reuse_overhead_s


RECORD_FIELDS = [f.name for f in fields(TurnRecord)]

# -- the table of a run's records ------------------------------------------------------------------
# A finished record as an object is ~270 B plus ~450 B of the floats and ints above 256 it points to,
# kept for the whole run: most of a simulated turn's memory. Packed, its numbers are one struct row
# (a float 8 B, an int 4 B: token counts, turn indexes and preemptions fit; a record with a larger int
# stays held) and its other fields (strings, mostly shared, and the bool) one pointer each: 192 B.
_FLOATS = tuple(f.name for f in fields(TurnRecord) if f.type == "float")
_INTS = tuple(f.name for f in fields(TurnRecord) if f.type == "int")
_OBJECTS = tuple(f.name for f in fields(TurnRecord) if f.type not in ("float", "int"))  # kept as they are
_ROW = struct.Struct(f"{len(_FLOATS)}d{len(_INTS)}i")  # native, no padding: the floats first, 8-aligned
_ROW_SIZE, _NUMBERS, _NO = _ROW.size, len(_FLOATS) + len(_INTS), len(_OBJECTS)
assert _ROW_SIZE == 8 * len(_FLOATS) + 4 * len(_INTS) and _ROW_SIZE % 8 == 0  # rows tile float and int views
# rows are added a block at a time (a run reserves one per turn; its bytes and list slots grow once per block)
_BLOCK = 256
_ZERO_ROWS, _NO_OBJECTS = bytes(_ROW_SIZE * _BLOCK), ("",) * (_NO * _BLOCK)
_PACKED = (*_FLOATS, *_INTS, *_OBJECTS)  # the order of a packed row's values
_in_field_order = itemgetter(*(_PACKED.index(name) for name in RECORD_FIELDS))


class RecordTable(_SequenceABC):
    """A run's records in arrival order: a turn's record is live (the object the simulator fills in,
    ``table[i]`` is that object) from :meth:`reserve` until :meth:`pack`, when the turn is over; packed,
    ``table[i]`` builds an equal, new :class:`TurnRecord` (changing it changes nothing in the table).

    A row is reserved at arrival so rows stay in arrival order although turns end in any order. A
    record :meth:`pack` cannot store exactly (a value not of its field's type, an int beyond 32 bits)
    stays an object, as a live one does."""

    __slots__ = ("_numbers", "_objects", "_held", "_len", "_capacity")

    def __init__(self, records: Iterable[TurnRecord] = ()) -> None:
        self._numbers = bytearray()  # one _ROW per row
        self._objects: list = []  # _NO per row
        self._held: dict[int, TurnRecord] = {}  # row -> the record as an object: live, or not packable
        self._len = self._capacity = 0  # rows reserved; rows the two stores have room for
        for rec in records:
            self.pack(self.reserve(rec))

    def reserve(self, rec: TurnRecord) -> int:
        """Append ``rec``, live; its row number."""
        row = self._len
        if row == self._capacity:
            self._numbers += _ZERO_ROWS
            self._objects += _NO_OBJECTS
            self._capacity += _BLOCK
        self._len = row + 1
        self._held[row] = rec
        return row

    # pack(row): the record of ``row`` will not change again: keep its values, drop the object
    # (generated from the fields, after the class: _pack_source)

    def held(self) -> list[TurnRecord]:
        """The records kept as objects (the live ones and any not packable), in row order."""
        return [self._held[row] for row in sorted(self._held)]

    def pack_held(self) -> None:
        for row in sorted(self._held):
            self.pack(row)

    def __len__(self) -> int:
        return self._len

    def _record(self, row: int) -> TurnRecord:
        rec = self._held.get(row)
        if rec is not None:
            return rec
        start = row * _NO
        values = _ROW.unpack_from(self._numbers, row * _ROW_SIZE) + tuple(self._objects[start:start + _NO])
        return TurnRecord(*_in_field_order(values))

    def __getitem__(self, index):
        n = len(self)
        if isinstance(index, slice):
            return [self._record(row) for row in range(*index.indices(n))]
        row = index.__index__()
        if row < 0:
            row += n
        if not 0 <= row < n:
            raise IndexError("record index out of range")
        return self._record(row)

    def __iter__(self) -> Iterator[TurnRecord]:
        for row in range(len(self)):
            yield self._record(row)

    def __repr__(self) -> str:
        return f"<RecordTable of {len(self)} records, {len(self._held)} held as objects>"

    def select(self, *names: str) -> Iterator[tuple]:
        """Each record's values of ``names``, a tuple per record in row order, read from the packed
        rows without building records (a summary of a million turns would build a million).

        While it runs the table's bytes are exported: reserving a row then raises BufferError."""
        where = [_PACKED.index(name) for name in names]  # ValueError for a name that is no field
        n = self._len
        numbers = memoryview(self._numbers)
        floats, ints = numbers.cast("d"), numbers.cast("i")  # a row is _ROW_SIZE // 8 floats, // 4 ints
        columns = []
        for k in where:
            if k < len(_FLOATS):
                step = _ROW_SIZE // 8
                columns.append(floats[k:n * step:step])
            elif k < _NUMBERS:
                step = _ROW_SIZE // 4
                columns.append(ints[2 * len(_FLOATS) + k - len(_FLOATS):n * step:step])
            else:
                columns.append(islice(self._objects, k - _NUMBERS, n * _NO, _NO))
        held = self._held
        rows = zip(*columns)
        try:
            if not held:
                yield from rows
                return
            of = _getter(names)
            for row, values in enumerate(rows):
                rec = held.get(row)
                yield values if rec is None else of(rec)
        finally:
            # drop the views at once (not when the generator is collected), so the table can grow again
            del rows, columns, floats, ints
            numbers.release()


def _pack_source() -> str:
    """RecordTable.pack written out field by field: a run packs every turn's record, and on CPython 3.11
    ``rec.field`` and ``type(v)`` in a function's own code are specialised bytecodes, several times
    cheaper than the same reads through ``operator.attrgetter`` and ``map(type, ...)``.

    The struct would take an int for a float and a bool for an int: a row packs only with exactly its
    fields' types (and ints within 32 bits), so every record reads back as it was, repr included
    (simpy's clock starts at the int 0: a turn sent at time 0 has arrival_s 0); any other record stays
    held as the object."""
    numbers = ", ".join(f"rec.{name}" for name in (*_FLOATS, *_INTS))
    types = ", ".join(f"type(rec.{name})" for name in (*_FLOATS, *_INTS))
    objects = ", ".join(f"rec.{name}" for name in _OBJECTS)
    return (f"def pack(self, row):\n"
            f"    rec = self._held[row]\n"
            f"    if ({types}) != _TYPES:\n"
            f"        return\n"
            f"    try:\n"
            f"        _pack_into(self._numbers, row * {_ROW_SIZE}, {numbers})\n"
            f"    except _struct_error:\n"
            f"        return\n"
            f"    start = row * {_NO}\n"
            f"    self._objects[start:start + {_NO}] = ({objects},)\n"
            f"    del self._held[row]\n")


def _make_pack():
    names = {"_pack_into": _ROW.pack_into, "_struct_error": struct.error,
             "_TYPES": (float,) * len(_FLOATS) + (int,) * len(_INTS)}
    exec(_pack_source(), names)  # noqa: S102 -- the source is built from TurnRecord's own field names
    pack = names["pack"]
    pack.__qualname__ = "RecordTable.pack"
    pack.__doc__ = "The record of ``row`` will not change again: keep its values, drop the object."
    return pack


RecordTable.pack = _make_pack()  # type: ignore[method-assign]


def _getter(names: Sequence[str]):
    """A function from a record to the tuple of its values of ``names``."""
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda rec: (one(rec),)
    return attrgetter(*names)


def fields_of(records: Sequence[TurnRecord], *names: str) -> Iterator[tuple]:
    """Each record's values of ``names``, as tuples, in order: from a table's packed rows, or from
    the objects of any other sequence of records."""
    if isinstance(records, RecordTable):
        return records.select(*names)
    return map(_getter(names), records)


def distribution(values: Iterable[float]) -> dict:
    """Count, p50/p90/p99 and mean of ``values``, in milliseconds (values in seconds)."""
    return _sorted_dist(sorted(values))


def _sorted_dist(v: list[float]) -> dict:
    return {"n": len(v), "p50_ms": percentile(v, 50) * 1e3, "p90_ms": percentile(v, 90) * 1e3,
            "p99_ms": percentile(v, 99) * 1e3, "mean_ms": (sum(v) / len(v) * 1e3) if v else math.nan}


@dataclass(slots=True)
class NodeTotals:
    retained_block_seconds: float = 0.0
    peak_retained_blocks: int = 0
    preemptions: int = 0
    preemptions_behind_retained: int = 0  # preempted while retained blocks held the pool
    rejected: int = 0
    dropped_under_pressure: int = 0  # instant_drop only
    waits: int = 0  # turns (or preempted sequences) that waited for blocks
    waits_behind_retained: int = 0  # ... that retained blocks alone would have made room for
    given_back: int = 0  # give_back: entries whose renewals stopped under pressure
    given_back_blocks: int = 0
    give_back_s: float = 0.0  # withheld -> freed, summed over the entries that lapsed
    declined_freed: int = 0  # retained entries freed because P declined to read them
    peak_used_blocks: int = 0


_SUMMARIZED = ("rejected", "turn", "prompt_tokens", "ttft_s", "reused_tokens", "miss_reason", "recomputed_tokens",
               "offered_tokens", "verified_tokens", "pulled_tokens", "d2p_transfer_s", "prefill_compute_s",
               "reuse_overhead_s")


def summarize(records: Sequence[TurnRecord], bytes_per_block: float, decode_totals: dict[str, NodeTotals],
              sim_time_s: float) -> dict:
    # one pass over the records' values (fields_of: no record built from a table), one per-turn value
    # list per distribution, in record order as before. The lists are the run's peak memory (a float
    # object per value when read from a table), so the prefill values wait unboxed until the TTFT
    # lists are gone, and each list is sorted in place (the same order sorted() gives: both stable)
    ttft: list[float] = []
    prefill = array("d")
    by_bucket: dict[str, list[float]] = {}
    misses: dict[str, int] = {}
    later = hits = 0
    reused = recomputed = offered = verified = pulled = prompt = 0  # token totals: ints, any order is exact
    for (rejected, turn, prompt_tokens, ttft_s, reused_tokens, miss_reason, recomputed_tokens, offered_tokens,
         verified_tokens, pulled_tokens, d2p_s, compute_s, overhead_s) in fields_of(records, *_SUMMARIZED):
        if rejected:
            continue
        ttft.append(ttft_s)
        prefill.append(prefill_duration_s(d2p_s, compute_s, overhead_s))
        by_bucket.setdefault(bucket_label(prompt_tokens), []).append(ttft_s)
        if turn > 0:
            later += 1
            if reused_tokens > 0:
                hits += 1
            if reused_tokens == 0:
                key = miss_reason or "unknown"
                misses[key] = misses.get(key, 0) + 1
        reused += reused_tokens
        recomputed += recomputed_tokens
        offered += offered_tokens
        verified += verified_tokens
        pulled += pulled_tokens
        prompt += prompt_tokens
    order = {bucket_label(e): i for i, e in enumerate(PROMPT_BUCKETS)}
    completed = len(ttft)
    ttft.sort()
    ttft_dist = _sorted_dist(ttft)
    bucket_dists = {}
    for k, v in sorted(by_bucket.items(), key=lambda kv: order.get(kv[0], 99)):
        v.sort()
        bucket_dists[k] = _sorted_dist(v)
    del ttft, by_bucket
    prefill_values = prefill.tolist()  # the same floats: an array('d') holds a float's 8 bytes exactly
    del prefill
    prefill_values.sort()
    gb = bytes_per_block / 1e9
    return {
        "turns": len(records),
        "completed": completed,
        "rejected": len(records) - completed,
        "sim_time_s": sim_time_s,
        "ttft": ttft_dist,
        "ttft_by_prompt_bucket": bucket_dists,
        "prefill": _sorted_dist(prefill_values),
        "reuse_hit_rate": (hits / later) if later else math.nan,
        "miss_reasons": dict(sorted(misses.items())),
        "tokens_reused": reused,  # = prompt tokens P did not recompute thanks to D
        "tokens_recomputed": recomputed,
        # what the router offered from D, what P verified of it (token ids equal) and what P pulled
        "tokens_offered": offered,
        "tokens_verified": verified,
        "tokens_pulled": pulled,
        "prompt_tokens": prompt,
        "retained_hbm_gb_s": sum(t.retained_block_seconds for t in decode_totals.values()) * gb,
        "peak_retained_hbm_gb": max((t.peak_retained_blocks for t in decode_totals.values()), default=0) * gb,
        "preemptions": sum(t.preemptions for t in decode_totals.values()),
        "dropped_under_pressure": sum(t.dropped_under_pressure for t in decode_totals.values()),
        **decode_memory_summary(records, decode_totals),
    }


def decode_memory_summary(records: Sequence[TurnRecord], decode_totals: dict[str, NodeTotals]) -> dict:
    """What D's memory cost the turns: who waited for blocks and how long, and whether retained blocks
    held the pool then (pinned retention's cost), what give-back returned and how fast."""
    waits = sorted(d_queue_s for rejected, d_queue_s in fields_of(records, "rejected", "d_queue_s")
                   if not rejected and d_queue_s > 0)
    total = NodeTotals()
    for t in decode_totals.values():
        for name in ("waits", "waits_behind_retained", "preemptions_behind_retained", "given_back",
                     "given_back_blocks", "give_back_s", "declined_freed"):
            setattr(total, name, getattr(total, name) + getattr(t, name))
    return {
        "d_wait": {**_sorted_dist(waits), "total_s": sum(waits)},
        "d_waits": total.waits,
        "d_waits_behind_retained": total.waits_behind_retained,
        "preemptions_behind_retained": total.preemptions_behind_retained,
        "given_back": total.given_back,
        "given_back_blocks": total.given_back_blocks,
        "give_back_mean_s": total.give_back_s / total.given_back if total.given_back else math.nan,
        "declined_freed": total.declined_freed,
    }
