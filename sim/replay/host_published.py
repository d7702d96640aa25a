"""llm-d's published host-tier pull against recompute (GLM-5.2-FP8, H200), through the simulator.

The report (calibration.host_tier.GLM_SOURCE) measured one request at a time on a source-consumer pair:
the source served a prefix, then the consumer's TTFT with the pull and without it, on a warmed pair,
and the first pull of a fresh pair (~6 s). Here: 1P1D with the profile ``bidikv profile`` builds for
the model (:func:`glm_profile`), the host tier alone as llm-d deploys it (no HBM retention, D offloads
each finished turn), the ``glm-5.2-wide-ep`` pull fit, P's default 8,192-token budget. The source is D
(it served the prefix), the consumer P; a warm-up conversation opens the (P, D) session first.

``python -m sim.replay.host_published`` prints the table, the crossover and the first pull.
"""

from __future__ import annotations

import sys
from typing import Any

from calibration.build import profile_from_architecture
from calibration.host_tier import (FIT_OUTPUT_TOKENS, FIT_PREFILL_BUDGET, FIT_USER_TOKENS, GLM_SOURCE, PUBLISHED,
                                   PUBLISHED_FIRST_PULL_S, PUBLISHED_TIE_TOKENS)
from calibration.hardware import DATA_DIR
from calibration.profile import LatencyProfile
from sim.engine.cluster import Cluster
from sim.engine.config import SimConfig
from sim.workload.model import Conversation, Turn

# GLM-5.2's architecture is taken as GLM-5's (ASSUMPTION: no GLM-5.2 config.json is stored here; Z.ai's
# GLM-5.2 has GLM-5's size, 744B total / 40B active, https://unsloth.ai/docs/models/glm-5.2, and llm-d
# measured ~93 KB of KV per token where GLM-5's BF16 latent with its indexer keys is 100,152 B). The
# testbed ran 16-way data/expert parallel over two pods; the closest shipped shape is one p5en at TP8.
GLM_CONFIG = DATA_DIR / "config_glm-5-fp8.json"
FIT = "glm-5.2-wide-ep"
WARM_PREFIX_TOKENS = 4096
SOURCE_AT_S, CONSUMER_GAP_S = 100.0, 60.0


def glm_profile() -> LatencyProfile:
    """What ``bidikv profile --model-config calibration/data/config_glm-5-fp8.json --hardware p5en --tp 8``
    prints."""
    return profile_from_architecture(GLM_CONFIG, "p5en", 8)


def host_config(pull: bool) -> SimConfig:
    config = SimConfig(seed=0)
    config.topology.max_num_batched_tokens = FIT_PREFILL_BUDGET
    p = config.policy
    p.bidirectional = False  # no HBM retention: the host tier alone
    p.prefix_caching = False
    p.host_tier = pull
    p.host_pull_fit = FIT
    p.min_cached_token_delta = 0  # every offered span is pulled: the report's pull column
    return config.validate()


def _conversations(prefix: int, warm: bool) -> list[Conversation]:
    def pair(name: str, start: float, tokens: int) -> Conversation:
        return Conversation(name, start, (Turn(tokens, FIT_OUTPUT_TOKENS),
                                          Turn(tokens + FIT_OUTPUT_TOKENS + FIT_USER_TOKENS, 1,
                                               gap_before_s=CONSUMER_GAP_S)))
    convs = [pair("target", SOURCE_AT_S, prefix)]
    if warm:
        convs.insert(0, pair("warm-up", 0.0, WARM_PREFIX_TOKENS))
    return convs


def consumer_ttft_s(profile: LatencyProfile, prefix: int, pull: bool, warm: bool = True) -> dict[str, Any]:
    """The consumer turn's TTFT (s) and how P served it."""
    result = Cluster(host_config(pull), profile).run(_conversations(prefix, warm))
    rec = next(r for r in result.records if r.conversation == "target" and r.turn == 1)
    if rec.rejected:
        raise RuntimeError(f"the consumer turn was rejected: {rec.rejected}")
    return {"ttft_s": rec.ttft_s, "decision": rec.decision, "reused_tokens": rec.reused_tokens}


def tie_tokens(rows: list[dict[str, Any]]) -> float | None:
    """Where pull and recompute cross, linearly between the bracketing points (None: no crossing)."""
    for a, b in zip(rows, rows[1:]):
        da, db = a["pull_s"] - a["recompute_s"], b["pull_s"] - b["recompute_s"]
        if da >= 0 > db:
            return a["prefix_tokens"] + (b["prefix_tokens"] - a["prefix_tokens"]) * da / (da - db)
    return None


def compare(profile: LatencyProfile | None = None) -> dict[str, Any]:
    """Every published point simulated, the crossover, the first pull of a new pair."""
    profile = profile or glm_profile()
    rows = []
    for prefix, recompute, pull in PUBLISHED:
        sim_recompute = consumer_ttft_s(profile, prefix, pull=False)
        sim_pull = consumer_ttft_s(profile, prefix, pull=True)
        if sim_pull["decision"] != "host_pull" or sim_recompute["decision"] == "host_pull":
            raise RuntimeError(f"{prefix}: the pull arm did not pull or the recompute arm did")
        rows.append({"prefix_tokens": prefix, "published_recompute_s": recompute, "recompute_s": sim_recompute["ttft_s"],
                     "published_pull_s": pull, "pull_s": sim_pull["ttft_s"]})
    first = consumer_ttft_s(profile, PUBLISHED[0][0], pull=True, warm=False)["ttft_s"]
    return {"rows": rows, "tie_tokens": tie_tokens(rows), "published_tie_tokens": PUBLISHED_TIE_TOKENS,
            "first_pull_s": first, "published_first_pull_s": PUBLISHED_FIRST_PULL_S, "profile": profile.name}


def _err(sim: float, pub: float) -> str:
    return f"{(sim / pub - 1) * 100:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    out = compare()
    print(f"llm-d GLM-5.2-FP8 host-tier pull vs recompute ({GLM_SOURCE})")
    print(f"simulated: {out['profile']} (bidikv profile of GLM-5's architecture, p5en TP8), fit {FIT}")
    print(f"{'prefix':>8} {'recompute pub':>14} {'sim':>7} {'err':>7} {'pull pub':>9} {'sim':>7} {'err':>7}")
    for r in out["rows"]:
        print(f"{r['prefix_tokens']:>8,} {r['published_recompute_s']:>12.2f} s {r['recompute_s']:>5.2f} s "
              f"{_err(r['recompute_s'], r['published_recompute_s']):>7} {r['published_pull_s']:>7.2f} s "
              f"{r['pull_s']:>5.2f} s {_err(r['pull_s'], r['published_pull_s']):>7}")
    tie = out["tie_tokens"]
    print(f"crossover: published {PUBLISHED_TIE_TOKENS:,} tokens, simulated "
          + (f"{tie:,.0f} tokens ({_err(tie, PUBLISHED_TIE_TOKENS)})" if tie else "none"))
    print(f"first pull of a new pair at {PUBLISHED[0][0]:,} tokens: published ~{PUBLISHED_FIRST_PULL_S:.0f} s, "
          f"simulated {out['first_pull_s']:.2f} s ({_err(out['first_pull_s'], PUBLISHED_FIRST_PULL_S)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
