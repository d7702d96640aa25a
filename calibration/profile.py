"""A latency profile: the numbers the simulator runs on, for one model on one hardware/TP setup.

Every term has a unit and a stated cause. The equations (n = new tokens computed, c = tokens already
cached in front of them, r = tokens reused from a peer, N = prompt tokens, B = batch size,
b = KV bytes per token, whole model over the TP ranks):

* prefill step      t = prefill_fixed_s
                        + sum over chunks [ prefill_per_token_s * n
                                            + prefill_attn_s * P_W(n, c) + prefill_index_s * P(n, c) ]
      P(n, c)   = n (c + n/2)                      causal (query, key) pairs, continuous form
      P_W(n, c) = sum_i min(c + i, W)              pairs a query attends when it reads at most
                                                   W = attn_window_tokens keys (DSA top-k); W = 0: P
      causes: per-forward fixed cost (launches, syncs, scheduling; calibrated, see calibration.prefill),
      linear-layer FLOPs, attention FLOPs, the DSA indexer's FLOPs over every pair.
* KV transfer       t = transfer_setup_s + transfer_per_block_s * blocks + b * tokens / transfer_bytes_per_s
      causes: per-request handshake/notification, per-descriptor work (one NIXL descriptor per block and
      registered region on every rank), wire time at EFA line rate x efficiency (calibration.transfer).
* reuse overhead    t = reuse_overhead_per_token_s * r
      calibrated, not physical: the ON path's measured growth beyond transfer + suffix compute
      (from the published figures: "ON prefill grows ~12.5 us per context token, ~8 us/token more than transfer +
      suffix compute explain"); cause not identified (calibration.reuse).
* decode step       t = decode_fixed_s + decode_per_seq_s * B + decode_per_ctx_token_s * sum(context)
      causes: weights read from HBM + per-layer launch/all-reduce cost, extra experts read per extra
      sequence (MoE), KV read per context token (calibration.decode; first principles, not calibrated:
      nothing about decode is published).
* TTFT overhead     t = ttft_overhead_fixed_s + ttft_overhead_per_prompt_token_s * N
                        + ttft_overhead_per_reused_byte_s * b * r
      what the client sees beyond P's queue, prefill and the P->D transfer: proxy hops and D's
      scheduling and first step (fixed, s); D re-rendering and re-tokenising the forwarded prompt (s per
      prompt token); and on the ON path a cost per reused KV byte that is calibrated, not physical, cause
      not identified (calibration.ttft).

The profile implements :class:`impl.policy.KVCostModel` so ``BreakEvenThreshold`` can use it.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any, Sequence

from calibration import jsondata
from calibration.prefill import causal_pairs, windowed_pairs

PROFILES_DIR = pathlib.Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    name: str
    model: str
    hardware: str
    tp: int
    kv_bytes_per_token: float  # whole model, all layers, summed over TP ranks
    block_size: int  # tokens per KV block (vLLM: 16 for FlashAttention, 64 for FlashMLA)
    prefill_fixed_s: float  # per forward pass
    prefill_per_token_s: float  # linear layers, per new token
    prefill_attn_s: float  # per (new token, attended key) pair within the window
    attn_window_tokens: int  # keys a query attends at most (DSA top-k); 0 = dense causal attention
    prefill_index_s: float  # DSA indexer, per (new token, context token) pair; 0 without an indexer
    transfer_setup_s: float  # per transfer
    transfer_per_block_s: float  # per KV block (descriptors per block x per-descriptor cost)
    transfer_bytes_per_s: float  # effective: line rate x efficiency, over all NICs the KV crosses
    reuse_overhead_per_token_s: float  # calibrated, per reused token (ON path)
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    decode_hbm_kv_bytes: float  # KV budget per decode instance (HBM left after weights and activations)
    ttft_overhead_fixed_s: float
    ttft_overhead_per_prompt_token_s: float
    ttft_overhead_per_reused_byte_s: float  # calibrated, per reused KV byte (ON path)
    # How the parts assemble (calibration.closed_form.Assembly; the simulator applies the same):
    # does the P->D hand-off pay transfer_setup_s, and does the D->P pull's setup overlap P's fixed cost?
    handoff_pays_transfer_setup: bool = True
    pull_setup_overlaps_prefill_fixed: bool = False
    provenance: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", "int") and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                               or math.isnan(value) or value < 0):
                raise ValueError(f"profile {self.name!r}: field {f.name} must be a number >= 0, got {value!r}")
            if f.type == "int" and not isinstance(value, int):
                raise ValueError(f"profile {self.name!r}: field {f.name} must be an integer, got {value!r}")
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"profile {self.name!r}: field {f.name} must be true or false, got {value!r}")
            if f.type == "str" and not isinstance(value, str):
                raise ValueError(f"profile {self.name!r}: field {f.name} must be a string, got {value!r}")
        if self.block_size < 1:
            raise ValueError(f"profile {self.name!r}: field block_size must be >= 1, got {self.block_size}")
        if self.tp < 1:
            raise ValueError(f"profile {self.name!r}: field tp must be >= 1, got {self.tp}")
        for name in ("transfer_bytes_per_s", "kv_bytes_per_token"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name!r}: field {name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.provenance, dict):
            raise ValueError(f"profile {self.name!r}: field provenance must be an object")

    # --- prefill -------------------------------------------------------------------------------
    def prefill_step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One prefill forward pass over ``(new_tokens, cached_context_tokens)`` chunks."""
        work = 0.0
        window = self.attn_window_tokens
        for n, c in chunks:
            pairs = causal_pairs(n, c)
            # dense attention (window 0) attends every causal pair: windowed_pairs would return these
            attended = pairs if window <= 0 else windowed_pairs(n, c, window)
            work += self.prefill_per_token_s * n + self.prefill_attn_s * attended + self.prefill_index_s * pairs
        return self.prefill_fixed_s + work

    def compute_s(self, new_tokens: int, cached_context_tokens: int) -> float:
        return self.prefill_step_s(((new_tokens, cached_context_tokens),))

    # --- transfer ------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def transfer_fixed_s(self, blocks: int) -> float:
        """The part of a transfer that does not scale with bytes on the wire."""
        return self.transfer_setup_s + self.transfer_per_block_s * blocks

    def handoff_fixed_s(self, blocks: int) -> float:
        """Fixed part of the P->D hand-off: the setup only if this profile's assembly charges it."""
        setup = self.transfer_setup_s if self.handoff_pays_transfer_setup else 0.0
        return setup + self.transfer_per_block_s * blocks

    def pull_hidden_s(self) -> float:
        """Fixed prefill work a pulled request has already done while its pull was being set up."""
        return min(self.transfer_setup_s, self.prefill_fixed_s) if self.pull_setup_overlaps_prefill_fixed else 0.0

    def transfer_bytes(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token

    def transfer_s(self, tokens: int) -> float:
        """Uncontended transfer of ``tokens`` worth of KV."""
        return self.transfer_fixed_s(self.blocks_for(tokens)) + self.transfer_bytes(tokens) / self.transfer_bytes_per_s

    def reuse_overhead_s(self, reused_tokens: int) -> float:
        return self.reuse_overhead_per_token_s * reused_tokens

    # --- time to first token -------------------------------------------------------------------
    def ttft_overhead_s(self, prompt_tokens: int, reused_tokens: int) -> float:
        """Client-visible time beyond P's queue, prefill and the P->D transfer (>= 0)."""
        return (self.ttft_overhead_fixed_s + self.ttft_overhead_per_prompt_token_s * prompt_tokens
                + self.ttft_overhead_per_reused_byte_s * (reused_tokens * self.kv_bytes_per_token))  # transfer_bytes

    # --- decode --------------------------------------------------------------------------------
    def decode_step_s(self, batch_size: int, total_context_tokens: int) -> float:
        return self.decode_fixed_s + self.decode_per_seq_s * batch_size + self.decode_per_ctx_token_s * total_context_tokens

    def decode_blocks(self) -> int:
        return int(self.decode_hbm_kv_bytes // (self.kv_bytes_per_token * self.block_size))

    # --- impl.policy.KVCostModel ---------------------------------------------------------------
    def pull_time_s(self, tokens: int, blocks: int) -> float:
        return (self.transfer_fixed_s(blocks) + self.transfer_bytes(tokens) / self.transfer_bytes_per_s
                + self.reuse_overhead_s(tokens))

    def recompute_time_s(self, tokens: int, cached_context_tokens: int) -> float:
        # the marginal cost: the fixed step cost is paid either way for the suffix
        return self.compute_s(tokens, cached_context_tokens) - self.prefill_fixed_s

    # --- I/O -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        return jsondata.to_json(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> "LatencyProfile":
        return jsondata.from_dict(cls, data, source, "profile")

    @classmethod
    def load(cls, name_or_path: str) -> "LatencyProfile":
        """A shipped profile by name (``calibration/profiles/<name>.json``) or a JSON file path."""
        path = pathlib.Path(name_or_path)
        if not path.suffix:
            path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            shipped = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
            raise ValueError(f"profile {name_or_path!r} not found (shipped: {', '.join(shipped) or 'none'})")
        return cls.from_dict(jsondata.read_json(path), str(path))
