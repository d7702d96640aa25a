"""sim.engine.interconnect: processor sharing of per-node NICs by KV transfers.

The model: a transfer pays its fixed part, then moves its bytes at min(per-transfer cap, NIC capacity /
the larger count of moving flows on its two NICs), rates changing only when a flow starts or ends.
Every expected time below is worked out by hand from that definition (or, in the property test, by a
brute-force event loop written here from the same definition), never read back from the code.
"""

from __future__ import annotations

import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from sim.engine.interconnect import Interconnect

# NIC capacity 10 B/s, per-transfer cap 8 B/s: one flow alone moves at 8, two on a NIC at 5 each, three at 10/3
CAPACITY, CAP = 10.0, 8.0


def run(transfers, capacity=CAPACITY, cap=CAP):
    """transfers: (name, src, dst, start_at, fixed_s, nbytes). Returns name -> (end time, elapsed)."""
    env = simpy.Environment()
    net = Interconnect(env, capacity, cap)
    ends = {}

    def starter(name, src, dst, fixed, nbytes):
        def go(_event):
            net.start(src, dst, nbytes, fixed, lambda elapsed: ends.__setitem__(name, (env.now, elapsed)))
        return go

    for name, src, dst, at, fixed, nbytes in transfers:
        env.timeout(at).callbacks.append(starter(name, src, dst, fixed, nbytes))
    env.run()
    assert net.transfers == len(transfers)
    assert net.bytes_moved == sum(t[5] for t in transfers)
    return ends


def test_one_transfer_alone_pays_its_fixed_part_then_moves_at_the_per_transfer_cap():
    ends = run([("a", "p0", "d0", 2.0, 1.0, 16)])
    assert ends["a"] == (2.0 + 1.0 + 16 / 8, 1.0 + 16 / 8)  # 5.0, 3.0: exact, nothing shares its NICs


def test_the_nic_share_limits_a_flow_only_below_the_cap():
    # capacity 100: two flows on a NIC would get 50 each, above the cap of 8, so both move at 8 as if alone
    ends = run([("a", "p0", "d0", 0.0, 0.0, 16), ("b", "d0", "p0", 0.0, 0.0, 8)], capacity=100.0)
    assert ends["a"] == (2.0, 2.0) and ends["b"] == (1.0, 1.0)


def test_a_transfer_alone_is_one_event():
    env = simpy.Environment()
    net = Interconnect(env, CAPACITY, CAP)
    net.start("p0", "d0", 16, 1.0, lambda elapsed: None)
    # one queue entry, its end, where a fixed-part timer followed by a flow timer would be two
    assert [entry[0] for entry in env._queue] == [3.0]
    env.run()
    assert next(env._eid) == 1


def test_two_flows_on_one_nic_that_start_at_different_times_share_it_equally():
    ends = run([("a", "p0", "d0", 0.0, 0.0, 16),  # alone at 8 until t=1: 8 moved, 8 left
                ("b", "d1", "p0", 1.0, 0.0, 10)])  # shares p0 from t=1: both at 10/2 = 5
    # a: 8 left at 5 -> ends 1 + 1.6 = 2.6; b moved 8 by then, 2 left, alone again at 8 -> 2.6 + 0.25
    assert ends["a"][0] == pytest.approx(2.6)
    assert ends["b"][0] == pytest.approx(2.85)
    assert ends["b"][1] == pytest.approx(1.85)


def test_a_flow_on_a_disjoint_pair_of_nics_is_unaffected():
    ends = run([("a", "p0", "d0", 0.0, 0.0, 16), ("b", "d1", "p0", 1.0, 0.0, 10),
                ("c", "p1", "d2", 1.0, 0.0, 8)])  # no NIC in common with a or b
    assert ends["c"] == (2.0, 1.0)  # 8 bytes at 8 B/s, exact
    assert ends["a"][0] == pytest.approx(2.6) and ends["b"][0] == pytest.approx(2.85)


def test_a_fixed_part_does_not_use_the_nic_but_the_bytes_after_it_do():
    ends = run([("a", "p0", "d0", 0.0, 0.0, 16),  # alone: would end at 2
                ("b", "d0", "p0", 0.5, 1.0, 6)])  # its bytes start at 1.5, when a has 16 - 12 = 4 left
    # from 1.5 both at 5: a's 4 take 0.8 -> 2.3; b moved 4 by then, 2 left at 8 -> 2.55
    assert ends["a"][0] == pytest.approx(2.3)
    assert ends["b"] == (pytest.approx(2.55), pytest.approx(2.05))


def test_a_fixed_part_that_ends_after_the_other_flow_leaves_the_bytes_alone():
    ends = run([("a", "p0", "d0", 0.0, 0.0, 16),  # ends at 2, alone throughout
                ("b", "d0", "p0", 0.5, 2.0, 6)])  # its bytes start at 2.5: alone at 8 -> 3.25
    assert ends["a"] == (2.0, 2.0)
    assert ends["b"][0] == pytest.approx(3.25)


def test_a_flow_started_during_anothers_fixed_part_is_slowed_when_that_part_ends():
    ends = run([("a", "p0", "d0", 0.0, 1.0, 8),  # bytes from t=1
                ("b", "d0", "p0", 0.5, 0.0, 10)])  # bytes from 0.5, alone at 8 until 1: 4 moved, 6 left
    # from 1 both at 5: b's 6 take 1.2 -> 2.2; a moved 6 by then, 2 left at 8 -> 2.45
    assert ends["b"] == (pytest.approx(2.2), pytest.approx(1.7))
    assert ends["a"] == (pytest.approx(2.45), pytest.approx(2.45))


def test_p_to_d_and_d_to_p_on_the_same_nics_contend():
    ends = run([("pull", "d0", "p0", 0.0, 0.0, 10), ("handoff", "p0", "d0", 0.0, 0.0, 10)])
    # both at 5 for their whole life (alone they would take 10/8 = 1.25)
    assert ends["pull"][0] == pytest.approx(2.0) and ends["handoff"][0] == pytest.approx(2.0)


def test_three_flows_on_one_nic_get_a_third_each():
    ends = run([("a", "p0", "d0", 0.0, 0.0, 10), ("b", "d1", "p0", 0.0, 0.0, 10), ("c", "d2", "p0", 0.0, 0.0, 20)])
    # 10/3 each until a and b finish at 3; c moved 10, 10 left alone at 8 -> 4.25
    assert ends["a"][0] == pytest.approx(3.0) and ends["b"][0] == pytest.approx(3.0)
    assert ends["c"][0] == pytest.approx(4.25)


def test_the_more_loaded_nic_sets_the_share():
    # c shares d0 with a only, but a's other NIC p0 also carries b: a gets 10/2 from p0's count, and so
    # does c (d0 holds a and c); b, on p0 with a and on d1 alone, also 5
    ends = run([("a", "p0", "d0", 0.0, 0.0, 10), ("b", "p0", "d1", 0.0, 0.0, 10), ("c", "p1", "d0", 0.0, 0.0, 10)])
    assert all(ends[n][0] == pytest.approx(2.0) for n in "abc")


def test_zero_bytes_take_the_fixed_part_only_and_slow_no_one():
    ends = run([("a", "p0", "d0", 0.0, 0.0, 16), ("nothing", "d0", "p0", 0.5, 0.25, 0),
                ("instant", "d0", "p0", 1.0, 0.0, 0)])
    assert ends["nothing"] == (0.75, 0.25)
    assert ends["instant"] == (1.0, 0.0)
    assert ends["a"] == (2.0, 2.0)


def test_a_zero_byte_transfer_without_a_fixed_part_ends_during_the_call():
    env = simpy.Environment()
    done = []
    Interconnect(env, CAPACITY, CAP).start("p0", "d0", 0, 0.0, done.append)
    assert done == [0.0]


def reference_ends(transfers, capacity, cap):
    """Processor sharing by brute force: at every start or end, every moving flow's rate from scratch."""
    ends, left, rate = {}, {}, {}
    begins = {}
    for name, src, dst, at, fixed, nbytes in transfers:
        if nbytes == 0:
            ends[name] = at + fixed
        else:
            begins[name], left[name] = at + fixed, float(nbytes)
    nics = {t[0]: (t[1], t[2]) for t in transfers}
    moving, now = set(), 0.0
    while begins or moving:
        count = {}
        for name in moving:
            for nic in nics[name]:
                count[nic] = count.get(nic, 0) + 1
        for name in moving:
            rate[name] = min(cap, capacity / max(count[nic] for nic in nics[name]))
        finishing = {name: now + left[name] / rate[name] for name in moving}
        upcoming = min(list(begins.values()) + list(finishing.values()))
        for name in moving:
            left[name] -= rate[name] * (upcoming - now)
        now = upcoming
        for name, end in finishing.items():
            if end <= now:
                ends[name] = now
                moving.discard(name)
        for name, at in list(begins.items()):
            if at <= now:
                moving.add(name)
                del begins[name]
    return ends


@st.composite
def transfer_sets(draw):
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        p, d = f"p{draw(st.integers(0, 2))}", f"d{draw(st.integers(0, 2))}"
        src, dst = (p, d) if draw(st.booleans()) else (d, p)
        out.append((f"t{i}", src, dst, draw(st.integers(0, 12)) * 0.25, draw(st.sampled_from([0.0, 0.5, 1.0, 1.3])),
                    draw(st.integers(0, 40))))
    return out


@settings(max_examples=300, deadline=None)
@given(transfers=transfer_sets(), capacity=st.sampled_from([10.0, 16.0, 30.0]))
def test_every_end_matches_processor_sharing_by_brute_force(transfers, capacity):
    ends = run(transfers, capacity=capacity)
    expected = reference_ends(transfers, capacity, CAP)
    for name, end in expected.items():
        assert ends[name][0] == pytest.approx(end, rel=1e-9, abs=1e-8), name
