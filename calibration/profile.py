"""A latency profile: the numbers the simulator runs on, for one model on one hardware/TP setup.

Every term has a unit and a stated cause. The equations (n = new tokens computed, c = tokens
already cached in front of them, r = tokens reused from a peer, B = batch size):

* prefill step      t = prefill_fixed_s + prefill_per_token_s * n + prefill_attn_s * n * (c + n / 2)
                         (fixed launch/scheduling cost, linear GEMM work, attention over the context)
* KV transfer       t = transfer_setup_s + transfer_per_block_s * blocks + bytes / transfer_bytes_per_s
                         (handshake/notification, per-descriptor work, wire time at line rate x efficiency)
* reuse overhead    t = reuse_overhead_per_token_s * r
                         (calibrated, not physical: the ON path's measured growth beyond transfer +
                         suffix compute, see ../shared/BRIEF.md "ON prefill grows ~12.5 us per context token")
* decode step       t = decode_fixed_s + decode_per_seq_s * B + decode_per_ctx_token_s * sum(context)
* TTFT overhead     t = ttft_overhead_fixed_s (router, P->D hand-off and first decode step as seen by the client)

The profile implements :class:`impl.policy.KVCostModel` so ``BreakEvenThreshold`` can use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any, Sequence

PROFILES_DIR = pathlib.Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    name: str
    model: str
    hardware: str
    tp: int
    kv_bytes_per_token: float  # whole model, all layers, summed over TP ranks
    block_size: int  # tokens per KV block (vLLM's GPU default is 16)
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_attn_s: float  # per new token per token of context
    transfer_setup_s: float
    transfer_per_block_s: float
    transfer_bytes_per_s: float  # effective: line rate x efficiency, over all NICs the KV crosses
    reuse_overhead_per_token_s: float
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    ttft_overhead_fixed_s: float
    decode_hbm_kv_bytes: float  # KV budget per decode instance (HBM left after weights and activations)
    provenance: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", "int") and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                               or math.isnan(value) or value < 0):
                raise ValueError(f"profile {self.name!r}: field {f.name} must be a number >= 0, got {value!r}")
        if self.block_size < 1 or self.tp < 1:
            raise ValueError(f"profile {self.name!r}: block_size and tp must be >= 1")
        if self.transfer_bytes_per_s <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError(f"profile {self.name!r}: transfer_bytes_per_s and kv_bytes_per_token must be > 0")

    # --- prefill -------------------------------------------------------------------------------
    def prefill_step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One prefill forward pass over ``(new_tokens, cached_context_tokens)`` chunks."""
        work = 0.0
        for n, c in chunks:
            work += self.prefill_per_token_s * n + self.prefill_attn_s * n * (c + n / 2)
        return self.prefill_fixed_s + work

    def compute_s(self, new_tokens: int, cached_context_tokens: int) -> float:
        return self.prefill_step_s(((new_tokens, cached_context_tokens),))

    # --- transfer ------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def transfer_fixed_s(self, blocks: int) -> float:
        """The part of a transfer that does not scale with bytes on the wire."""
        return self.transfer_setup_s + self.transfer_per_block_s * blocks

    def transfer_bytes(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token

    def transfer_s(self, tokens: int) -> float:
        """Uncontended transfer of ``tokens`` worth of KV."""
        return self.transfer_fixed_s(self.blocks_for(tokens)) + self.transfer_bytes(tokens) / self.transfer_bytes_per_s

    def reuse_overhead_s(self, reused_tokens: int) -> float:
        return self.reuse_overhead_per_token_s * reused_tokens

    def ttft_overhead_s(self, prompt_tokens: int, reused_tokens: int) -> float:
        """What the client waits beyond P's prefill and the P->D transfer for its first token."""
        return self.ttft_overhead_fixed_s

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
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> "LatencyProfile":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a profile must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{source}: unknown profile field(s) {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in data and f.name != "provenance")
        if missing:
            raise ValueError(f"{source}: missing profile field(s) {missing}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, name_or_path: str) -> "LatencyProfile":
        """A shipped profile by name (``calibration/profiles/<name>.json``) or a JSON file path."""
        path = pathlib.Path(name_or_path)
        if not path.suffix:
            path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            shipped = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
            raise ValueError(f"profile {name_or_path!r} not found (shipped: {', '.join(shipped) or 'none'})")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
        return cls.from_dict(data, str(path))
