"""How the tuner runs its simulations (sim/tune/executor.py Runs, sim/tune/narrow.py): started as
decided, each point once, and the same points whatever order the simulations finish in."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.profile import LatencyProfile
from sim.engine.config import SimConfig
from sim.tune import executor
from sim.tune.evaluate import evaluate
from sim.tune.grid import REFERENCES, build_grid
from sim.tune.screen import screener
from sim.tune.sensitivity import surely_simulated, sweep_jobs, tune_across_behaviours
from sim.workload.model import Conversation, Turn
from tests.tune.test_screen import workloads

PROFILE = LatencyProfile.load("qwen3-32b@p5en-tp8")


def _config(decode_blocks: int = 100_000) -> SimConfig:
    cfg = SimConfig()
    cfg.topology.decode_kv_blocks = decode_blocks
    return cfg.validate()


@settings(max_examples=30, deadline=None)
@given(convs=workloads(), objective=st.sampled_from(("ttft_p90", "compute")), batch=st.sampled_from((2, 3)),
       tight=st.booleans(), delays=st.lists(st.sampled_from((0.0, 0.02, 0.05)), min_size=5, max_size=5))
def test_the_same_points_are_simulated_whatever_order_simulations_finish_in(convs, objective, batch, tight, delays):
    largest = max(-(-(t.prompt_tokens + t.output_tokens) // PROFILE.block_size) for c in convs for t in c.turns)
    cfg = _config(largest + 2 if tight else 100_000)
    screen, _ = screener(cfg, convs, PROFILE, cfg.topology.decode_kv_blocks)
    candidates = [*build_grid((0.0, 5.0, 10.0, 20.0, 40.0, 60.0, 100.0, 150.0), ("0", "64", "1024"), (), ()),
                  *REFERENCES]
    decode_gb = cfg.topology.decode_kv_blocks * PROFILE.kv_bytes_per_token * PROFILE.block_size / 1e9
    started: dict[str, list] = {"one at a time": [], "on threads": []}

    def run(configs, overrides):
        started["one at a time"].extend(o.get("decoder_kv_blocks_ttl") for o in overrides)
        return [evaluate(c, o, convs) for c, o in zip(configs, overrides)]

    def slowly(c, o, delay):
        metrics = evaluate(c, o, convs)
        time.sleep(delay)  # so a simulation started later often finishes first
        return metrics

    with ThreadPoolExecutor(batch) as pool:
        def submit(configs, overrides):
            out = []
            for c, o in zip(configs, overrides):
                out.append(pool.submit(slowly, c, o, delays[len(started["on threads"]) % len(delays)]))
                started["on threads"].append(o.get("decoder_kv_blocks_ttl"))
            return out

        tunings = [tune_across_behaviours(cfg, candidates, run, objective, 30.0, decode_gb, 1.0, "never", screen,
                                          batch=batch, submit=submit if threads else None) for threads in (False, True)]
    assert started["one at a time"] == started["on threads"]
    a, b = (t.narrowing for t in tunings)
    assert (a.simulated, a.screened, a.results) == (b.simulated, b.screened, b.results)


def test_a_point_asked_for_twice_runs_once(monkeypatch):
    calls = []
    monkeypatch.setattr(executor, "timed_evaluate", lambda c, o: (calls.append(o) or {"o": o}, 0.0, 0.0))
    runs = executor.Runs("serial")
    cfg = _config()
    first = runs.submit([cfg, cfg], [{"decoder_kv_blocks_ttl": 1.0}, {"decoder_kv_blocks_ttl": 2.0}])
    again = runs.submit([cfg], [{"decoder_kv_blocks_ttl": 2.0}])
    assert again[0] is first[1] and runs.simulations == len(calls) == 2
    assert runs.run([cfg], [{"decoder_kv_blocks_ttl": 3.0}]) == [{"o": {"decoder_kv_blocks_ttl": 3.0}}]
    assert runs.simulations == 3


def test_vllm_defaults_twins_take_its_simulation():
    """ttl=480 s thr=0 and thr=64 pull the same on every turn as vLLM's default, pinned or giving back (D's
    memory never binds here): no simulation of their own."""
    cfg = _config()
    convs = [Conversation("c", 0.0, (Turn(3000, 50), Turn(3200, 50, gap_before_s=10.0)))]
    screen, _ = screener(cfg, convs, PROFILE, cfg.topology.decode_kv_blocks)
    sweep = build_grid((480.0,), ("0", "64"), (), ())
    calls = []

    def run(configs, overrides):
        calls.extend(overrides)
        return [evaluate(c, o, convs) for c, o in zip(configs, overrides)]

    tuning = tune_across_behaviours(cfg, [*sweep, *REFERENCES], run, "ttft_p90", 100.0, 1e6, 1.0, "never", screen,
                                    batch=2)
    assert calls == [r.policy for r in REFERENCES]  # the references alone: the probe is the default's twin
    by = {p.candidate.label: p for p in tuning.main.points}
    default = by[REFERENCES[1].label].metrics
    assert all(by[c.label].metrics == default and not by[c.label].screened for c in sweep)
    assert len(sweep) == 4 and tuning.narrowing.same_as_simulated == 4


def test_what_starts_before_screening_is_what_the_screen_cannot_spare():
    cfg = _config()
    candidates = [*build_grid((0.0, 60.0), ("64",), (30.0,), (0.9,)), *REFERENCES]
    configs, overrides, _ = sweep_jobs(cfg, candidates)
    sure = surely_simulated(cfg, candidates, screening=True)
    # the two fixed TTLs (pinned and giving back) wait for the screen; every other give_back point waits for its
    # pinned twin (it takes the twin's figures when giving back never acted there); the pinned lease (once per
    # client behaviour) and gap quantile and the references start at once
    waiting = [(overrides[j].get("retention"), overrides[j].get("retained_under_pressure"))
               for j in range(len(configs)) if j not in sure]
    assert waiting == [("ttl", "pinned"), ("ttl", "give_back")] * 2 + [("lease", "give_back")] * 4 + [
        ("gap_quantile", "give_back")]
    assert all(overrides[j] is not REFERENCES[1].policy or j in sure for j in range(len(configs)))
    assert [overrides[j]["retained_under_pressure"] for j in range(len(configs))
            if j not in surely_simulated(cfg, candidates, screening=False)] == ["give_back"] * 7
