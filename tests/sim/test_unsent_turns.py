"""A run cut short (by ``max_sim_time_s``, or stuck on pinned blocks) reports every turn it did not
finish, per conversation: a conversation is its tenant and its id, so another tenant's conversation of
the same id sending its turns never hides this one's unsent turns."""

from __future__ import annotations

import math

import pytest

from calibration.profile import LatencyProfile
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.workload.model import Conversation, Turn

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")
TWO_TURNS = (Turn(2000, 200), Turn(2300, 200, gap_before_s=1.0))


def _pinned_forever(max_sim_time_s: float = math.inf) -> SimConfig:
    # one D of 300 blocks (4,800 tokens) that never frees a retained turn
    cfg = SimConfig(max_sim_time_s=max_sim_time_s)
    cfg.topology.decode_kv_blocks = 300
    cfg.policy.decoder_kv_blocks_ttl = math.inf
    cfg.policy.retained_under_pressure = "pinned"
    return cfg.validate()


def _outcomes(cfg: SimConfig, convs: list[Conversation]) -> dict[tuple[str, str, int], str]:
    records = Cluster(cfg, PROFILE).run(convs).records
    outcomes = {(r.tenant, r.conversation, r.turn): r.rejected for r in records}
    assert len(outcomes) == len(records)  # one record per turn
    return outcomes


@pytest.mark.parametrize("twin_tenant", ["a", "b"])  # "a": the same conversation as before, once
def test_a_cut_run_reports_the_unsent_turns_of_a_conversation_whose_id_another_tenant_sent(twin_tenant):
    # tenant a's c0 runs both turns in the first seconds; tenant b's c0 would start after the cut
    convs = [Conversation("c0", 0.0, TWO_TURNS, 64, tenant="a")]
    if twin_tenant == "b":
        convs.append(Conversation("c0", 100.0, TWO_TURNS, 64, tenant="b"))
    outcomes = _outcomes(_pinned_forever(max_sim_time_s=50.0), convs)
    assert outcomes[("a", "c0", 0)] == outcomes[("a", "c0", 1)] == ""
    if twin_tenant == "b":
        assert len(outcomes) == 4
        assert outcomes[("b", "c0", 0)] == outcomes[("b", "c0", 1)] == "not released by max_sim_time_s"
    else:
        assert len(outcomes) == 2


def test_a_stuck_run_reports_the_unsent_turns_of_a_conversation_whose_id_another_tenant_sent():
    # a's c0 retains its 2,200 tokens (138 blocks) for ever; b's c0 needs more than the 162 blocks left:
    # stuck, its second turn never sent
    convs = [Conversation("c0", 0.0, TWO_TURNS, 64, tenant="a"),
             Conversation("c0", 5.0, (Turn(3000, 200), Turn(3300, 200, gap_before_s=1.0)), 64, tenant="b")]
    outcomes = _outcomes(_pinned_forever(), convs)
    assert len(outcomes) == 4
    assert outcomes[("a", "c0", 0)] == outcomes[("a", "c0", 1)] == ""
    assert outcomes[("b", "c0", 0)] == "stuck: waiting for decode blocks pinned by retained turns that never expire"
    assert outcomes[("b", "c0", 1)] == "not sent: the run was stuck on pinned decode blocks"
