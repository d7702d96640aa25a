"""KV transfer (a NIXL READ over EFA, either direction):

    t = transfer_setup_s + transfer_per_block_s x blocks + bytes / transfer_bytes_per_s

    transfer_per_block_s = descriptors per block x transfer_per_descriptor_s
    transfer_bytes_per_s = t x EFA bytes/s per GPU x efa_efficiency        (t = TP ranks)
    bytes                = tokens x KV bytes/token (whole model, summed over the ranks)

Causes: the setup is the per-request handshake, notification and scheduling around the read; vLLM's
NixlConnector posts one descriptor per KV block and registered region (2 per layer for FlashAttention's
split K/V, 1 for an MLA latent, +1 for a DSA indexer cache) on every rank in parallel, each with a
fixed cost; the bytes cross each rank's own NICs at line rate x efficiency.

The published transfers cost ~4.4 us/token on both models although GLM-5 moves 3x the bytes per token
(calibration/README.md), so the transfer is descriptor- and setup-bound; from one model alone the bytes term
cannot be told apart from the per-block term (both grow with tokens), which is why single-model fits fix
``efa_efficiency`` and only the two-model fit estimates it. Floor: bytes at line rate, nothing else.
"""

from __future__ import annotations

from calibration.architecture import Architecture
from calibration.efficiencies import HardwareEfficiencies
from calibration.hardware import Hardware


def coefficients(arch: Architecture, hw: Hardware, tp: int, eff: HardwareEfficiencies) -> dict[str, float]:
    return {"transfer_setup_s": eff.transfer_setup_s,
            "transfer_per_block_s": arch.descriptors_per_block() * eff.transfer_per_descriptor_s,
            "transfer_bytes_per_s": hw.efa_line_bytes_per_s(tp) * eff.efa_efficiency}


def transfer_floor_s(arch: Architecture, hw: Hardware, tp: int, tokens: int) -> float:
    return tokens * arch.kv_bytes_per_token(tp) / hw.efa_line_bytes_per_s(tp)
