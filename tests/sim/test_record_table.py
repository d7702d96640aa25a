"""sim.engine.records.RecordTable: what it gives back is what a plain list of the records would have held.

Records are compared by the repr of their field tuples, so a dropped, reordered or retyped field shows
(NaN equals itself there, -0.0 differs from 0.0, the int 0 from 0.0 and True from 1)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from sim.engine import cluster as cluster_module
from sim.engine.cluster import Cluster
from sim.engine.records import RECORD_FIELDS, RecordTable, TurnRecord, fields_of, summarize
from tests.sim.test_invariants import PROFILE, configs, conversations

FIELDS = dataclasses.fields(TurnRecord)


def exact(rec: TurnRecord) -> str:
    return repr(dataclasses.astuple(rec))


floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf])
ints = st.integers(-2**31, 2**31 - 1) | st.sampled_from([0, 1, -1, 2**31 - 1, -2**31])
# what a row cannot hold exactly: the record must stay an object
odd_floats = st.sampled_from([0, 1, True, None])  # simpy's clock starts at the int 0
odd_ints = st.sampled_from([2**31, -2**31 - 1, 2**70, True, False, 1.0])
texts = st.sampled_from(["", "c0", "p3", "recompute", "expired"]) | st.text(max_size=8)


@st.composite
def records(draw, odd: bool = True) -> TurnRecord:
    values = []
    for f in FIELDS:
        weird = odd and draw(st.integers(0, 19)) == 0
        if f.type == "float":
            values.append(draw(odd_floats if weird else floats))
        elif f.type == "int":
            values.append(draw(odd_ints if weird else ints))
        elif f.type == "bool":
            values.append(draw(st.booleans()))
        else:
            values.append(draw(texts))
    return TurnRecord(*values)


@settings(max_examples=300, deadline=None)
@given(recs=st.lists(records(), max_size=40), data=st.data())
def test_rows_read_back_exactly_in_arrival_order_whatever_order_they_are_packed_in(recs, data):
    table = RecordTable()
    rows = [table.reserve(rec) for rec in recs]
    assert rows == list(range(len(recs)))
    order = data.draw(st.permutations(rows))
    packed = order[:data.draw(st.integers(0, len(order)))]  # the rest stay live
    for row in packed:
        table.pack(row)
    assert len(table) == len(recs)
    assert [exact(r) for r in table] == [exact(r) for r in recs]
    assert [exact(table[i]) for i in range(len(recs))] == [exact(r) for r in recs]
    assert [exact(table[i]) for i in range(-len(recs), 0)] == [exact(r) for r in recs]
    # every field's column, from the packed rows and from the records still held
    for name in RECORD_FIELDS:
        assert repr([v for (v,) in table.select(name)]) == repr([getattr(r, name) for r in recs]), name
    assert repr(list(fields_of(table, *reversed(RECORD_FIELDS)))) == repr(
        [tuple(getattr(r, n) for n in reversed(RECORD_FIELDS)) for r in recs])


@settings(max_examples=100, deadline=None)
@given(recs=st.lists(records(odd=False), min_size=1, max_size=20), data=st.data())
def test_a_live_record_is_the_object_itself_and_a_packed_one_a_copy(recs, data):
    table = RecordTable()
    rows = [table.reserve(rec) for rec in recs]
    live = data.draw(st.sampled_from(rows))
    assert table[live] is recs[live]
    recs[live].rejected = "changed while live"
    assert table[live].rejected == "changed while live"  # visible before it is packed
    table.pack(live)
    copy = table[live]
    assert copy is not recs[live] and exact(copy) == exact(recs[live])
    copy.rejected = "changed after"
    assert table[live].rejected == "changed while live"  # a built record is the caller's own


def test_records_a_row_cannot_hold_stay_held_as_the_objects():
    at_zero = TurnRecord("c0", 0, "t", 10, 5, 0)  # arrival at simpy's int 0
    big = TurnRecord("c1", 0, "t", 2**40, 5, 1.0)
    flag = TurnRecord("c2", True, "t", 10, 5, 1.0)  # a bool in an int field
    plain = TurnRecord("c3", 0, "t", 10, 5, 1.0)
    table = RecordTable([at_zero, big, flag, plain])
    assert table[0] is at_zero and table[1] is big and table[2] is flag and table[3] is not plain
    assert table.held() == [at_zero, big, flag]
    assert [exact(r) for r in table] == [exact(r) for r in (at_zero, big, flag, plain)]


def test_sequence_behaviour():
    recs = [TurnRecord(f"c{i}", i, "t", 100 * i, 7, float(i)) for i in range(600)]  # beyond one block of rows
    table = RecordTable(recs)
    assert len(table) == 600 and not table.held()
    assert [exact(r) for r in table[10:20]] == [exact(r) for r in recs[10:20]]
    assert [exact(r) for r in table[::-37]] == [exact(r) for r in recs[::-37]]
    assert [exact(r) for r in table[-3:]] == [exact(r) for r in recs[-3:]]
    assert table[-1].conversation == "c599" and table[0].conversation == "c0"
    for bad in (600, -601):
        with pytest.raises(IndexError):
            table[bad]
    assert [exact(r) for r in reversed(table)] == [exact(r) for r in reversed(recs)]
    assert list(RecordTable()) == [] and len(RecordTable()) == 0
    assert list(RecordTable().select("ttft_s", "turn")) == []
    with pytest.raises(ValueError):
        list(table.select("no_such_field"))


def test_the_table_can_grow_again_after_a_read_of_its_columns():
    table = RecordTable([TurnRecord("c", 0, "t", 1, 1, 1.0)] * 256)  # exactly full
    assert sum(1 for _ in table.select("turn", "arrival_s")) == 256
    half = table.select("turn")
    next(half)
    half.close()  # a read abandoned half way lets go of the bytes too
    table.pack(table.reserve(TurnRecord("c", 1, "t", 1, 1, 2.0)))
    assert len(table) == 257 and table[256].turn == 1


@settings(max_examples=200, deadline=None)
@given(recs=st.lists(records(odd=False), max_size=40), at_zero=st.lists(st.booleans(), max_size=40), data=st.data())
def test_the_summary_of_a_table_is_the_summary_of_its_records(recs, at_zero, data):
    for rec, zero in zip(recs, at_zero):
        if zero:
            rec.arrival_s = rec.p_queue_s = 0  # ints, as a turn sent at simpy's time 0 has: held rows
    table = RecordTable()
    for row in [table.reserve(rec) for rec in recs]:
        if data.draw(st.booleans()):
            table.pack(row)
    assert repr(summarize(table, 1e6, {}, 10.0)) == repr(summarize(list(recs), 1e6, {}, 10.0))


class PlainRecords(list):
    """Cluster.records as it was before the table: the record objects themselves, in arrival order."""

    def reserve(self, rec: TurnRecord) -> int:
        self.append(rec)
        return len(self) - 1

    def pack(self, row: int) -> None:
        pass

    def held(self) -> list[TurnRecord]:
        return list(self)

    def pack_held(self) -> None:
        pass


@st.composite
def runs(draw):
    cfg = draw(configs())
    cfg.max_sim_time_s = draw(st.sampled_from([math.inf, math.inf, 20.0, 150.0]))  # unfinished, unreleased turns
    cfg.num_clients = draw(st.sampled_from([0, 0, 2]))
    try:
        cfg.validate()
    except ValueError:
        assume(False)
    return cfg, draw(conversations())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=runs())
def test_a_cluster_run_keeps_the_records_a_plain_list_would_have(run):
    cfg, convs = run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cluster_module, "RecordTable", PlainRecords)
        plain = Cluster(cfg, PROFILE).run(convs)
    assert type(plain.records) is PlainRecords  # the stand-in did run
    packed = Cluster(cfg, PROFILE).run(convs)
    assert type(packed.records) is RecordTable
    assert [exact(r) for r in packed.records] == [exact(r) for r in plain.records]
    assert json.dumps(packed.summary, sort_keys=True, default=repr) == json.dumps(plain.summary, sort_keys=True,
                                                                                  default=repr)
    assert packed.series == plain.series
    # after the run nothing is live: held are only records a row cannot hold exactly (a turn sent at
    # simpy's int 0 has arrival_s 0), and only those are
    assert [exact(r) for r in packed.records.held()] == [exact(r) for r in plain.records if not fits(r)]


def fits(rec: TurnRecord) -> bool:
    """Whether every number field holds exactly its annotated type (and an int fits 32 bits)."""
    for f in FIELDS:
        v = getattr(rec, f.name)
        if f.type == "float" and type(v) is not float:
            return False
        if f.type == "int" and (type(v) is not int or not -2**31 <= v < 2**31):
            return False
    return True
