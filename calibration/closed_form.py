"""The published metrics of one turn on 1P1D without contention, assembled the way the simulator does.

Notation: N prompt tokens, u new user tokens (the benchmark's 120-160, 140 here), h = P's local prefix
hit (0: prefix caching OFF on P), B = block size.

    ON, later turn   r = min(remote, N) - h        remote = previous prompt + output, held by D = N - u
                     pull      = transfer_s(r)
                     compute   = compute_s(N - h - r, h + r)
                     prefill   = pull + compute + reuse_overhead_s(r)
                     published "KV transfer" = pull
    OFF (or turn 1)  prefill   = compute_s(N - h, h)
    both             handoff   = transfer_s(N - d_hit) if N > d_hit else 0     (P -> D)
                     d_hit     = floor((N - u) / B) x B   (D still holds the previous prompt + output:
                                 ON retained it, OFF its prefix cache kept it)
                     TTFT      = P queue wait (0 here) + prefill + handoff + ttft_overhead_s(N, r)

Two assemblies, both implemented by the simulator (a profile says which it was fitted under:
``handoff_pays_transfer_setup``, ``pull_setup_overlaps_prefill_fixed``). :data:`SERIAL_ASSEMBLY` puts
every part in series. :data:`OVERLAPPED_ASSEMBLY`, which the data asks for and the shipped profiles
use (see calibration.fit and calibration/README.md), lets the P->D hand-off skip the transfer setup
(the published TTFT - prefill gaps are 0-5 ms, far below the ~20 ms setup every D->P pull shows) and
lets the D->P pull's setup overlap P's fixed per-forward cost (a hypothesis: ON prefill minus transfer
is 20-40 ms below what OFF-path compute of the suffix explains).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from calibration.profile import LatencyProfile


@dataclass(frozen=True, slots=True)
class Assembly:
    handoff_pays_transfer_setup: bool = True  # serial: TTFT adds transfer_s(N - d_hit), setup included
    pull_setup_overlaps_prefill_fixed: bool = False  # overlapped: min(setup, prefill_fixed) hidden on ON

    def describe(self) -> dict[str, bool]:
        return asdict(self)


SERIAL_ASSEMBLY = Assembly()
OVERLAPPED_ASSEMBLY = Assembly(handoff_pays_transfer_setup=False, pull_setup_overlaps_prefill_fixed=True)
SHIPPED_ASSEMBLY = OVERLAPPED_ASSEMBLY  # what calibration.fit writes by default


def assembly_of(profile: LatencyProfile) -> Assembly:
    return Assembly(profile.handoff_pays_transfer_setup, profile.pull_setup_overlaps_prefill_fixed)


def turn_metrics(profile: LatencyProfile, prompt_tokens: int, bidirectional: bool, user_tokens: int = 140,
                 local_hit_tokens: int = 0, assembly: Assembly | None = None) -> dict[str, float]:
    """``ttft_s``, ``prefill_s``, ``transfer_s`` (the ON pull; 0 when OFF) and their parts.

    ``assembly`` defaults to the profile's own (what the simulator applies); the fit passes one explicitly.
    """
    if assembly is None:
        assembly = assembly_of(profile)
    n, u = prompt_tokens, user_tokens
    if n <= 0 or not 0 <= u <= n:
        raise ValueError(f"need 0 <= user_tokens <= prompt_tokens and prompt_tokens > 0, got {u}, {n}")
    bs = profile.block_size
    h = (min(local_hit_tokens, n) // bs) * bs
    remote = n - u
    if bidirectional:
        reused = max(min(remote, n) - h, 0)
        pull = profile.transfer_s(reused) if reused > 0 else 0.0
        compute = profile.compute_s(n - h - reused, h + reused)
        reuse = profile.reuse_overhead_s(reused)
        hidden = (min(profile.transfer_setup_s, profile.prefill_fixed_s)
                  if assembly.pull_setup_overlaps_prefill_fixed and reused > 0 else 0.0)
        prefill = pull + compute + reuse - hidden
    else:
        reused, pull, reuse, hidden = 0, 0.0, 0.0, 0.0
        compute = profile.compute_s(n - h, h)
        prefill = compute
    d_hit = (remote // bs) * bs
    handoff_tokens = n - d_hit
    handoff = profile.transfer_s(handoff_tokens) if handoff_tokens > 0 else 0.0
    if handoff_tokens > 0 and not assembly.handoff_pays_transfer_setup:
        handoff -= profile.transfer_setup_s
    overhead = profile.ttft_overhead_s(n, reused)
    return {"ttft_s": prefill + handoff + overhead, "prefill_s": prefill, "transfer_s": pull,
            "compute_s": compute, "reuse_overhead_s": reuse, "hidden_setup_s": hidden, "handoff_s": handoff,
            "ttft_overhead_s": overhead, "reused_tokens": float(reused), "handoff_tokens": float(handoff_tokens)}
