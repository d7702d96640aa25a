"""The closed form mirrors the simulator's assembly of the published metrics."""

from __future__ import annotations

import pytest

from calibration.closed_form import OVERLAPPED_ASSEMBLY, SERIAL_ASSEMBLY, turn_metrics
from calibration.profile import LatencyProfile
from calibration.published import MEASURED


@pytest.mark.parametrize("name", [d.profile_name for d in MEASURED])
@pytest.mark.parametrize("n", [2048, 5000, 24576])
def test_assembly(name, n):
    p = LatencyProfile.load(name)
    u = 140
    off = turn_metrics(p, n, False, u, assembly=SERIAL_ASSEMBLY)
    on = turn_metrics(p, n, True, u, assembly=SERIAL_ASSEMBLY)
    r = n - u
    handoff_tokens = n - ((n - u) // p.block_size) * p.block_size
    assert off["transfer_s"] == 0 and off["prefill_s"] == pytest.approx(p.compute_s(n, 0))
    assert on["reused_tokens"] == r and on["handoff_tokens"] == off["handoff_tokens"] == handoff_tokens
    assert on["transfer_s"] == pytest.approx(p.transfer_s(r))
    assert on["prefill_s"] == pytest.approx(p.transfer_s(r) + p.compute_s(u, r) + p.reuse_overhead_s(r))
    for m, reused in ((off, 0), (on, r)):
        assert m["ttft_s"] == pytest.approx(m["prefill_s"] + p.transfer_s(handoff_tokens) + p.ttft_overhead_s(n, reused))
        assert m["ttft_s"] >= m["prefill_s"]  # the simulator's invariant


def test_no_handoff_when_d_holds_everything():
    p = LatencyProfile.load(MEASURED[0].profile_name)
    m = turn_metrics(p, 2048, True, user_tokens=0)
    assert m["handoff_tokens"] == 0 and m["handoff_s"] == 0


def test_overlapped_assembly_drops_handoff_setup_and_hides_pull_setup():
    p = LatencyProfile.load(MEASURED[0].profile_name)
    sim, proposed = (turn_metrics(p, 2048, True, assembly=SERIAL_ASSEMBLY),
                     turn_metrics(p, 2048, True, assembly=OVERLAPPED_ASSEMBLY))
    assert proposed["handoff_s"] == pytest.approx(sim["handoff_s"] - p.transfer_setup_s)
    assert proposed["prefill_s"] == pytest.approx(sim["prefill_s"] - min(p.transfer_setup_s, p.prefill_fixed_s))
    assert proposed["transfer_s"] == sim["transfer_s"]


def test_rejects_bad_turn():
    p = LatencyProfile.load(MEASURED[0].profile_name)
    with pytest.raises(ValueError):
        turn_metrics(p, 100, True, user_tokens=200)


@pytest.mark.parametrize("name", [d.profile_name for d in MEASURED])
def test_shipped_profiles_default_to_their_own_assembly(name):
    p = LatencyProfile.load(name)
    assert turn_metrics(p, 5000, True) == turn_metrics(p, 5000, True, assembly=OVERLAPPED_ASSEMBLY)
    assert not p.handoff_pays_transfer_setup and p.pull_setup_overlaps_prefill_fixed
