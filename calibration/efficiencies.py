"""Hardware efficiencies: what turns an architecture into a latency profile on given hardware.

Fitted on the measured models (calibration.fit: one fit to both, stored as ``data/<hardware>_efficiencies.json``;
calibration.shared_fit: engine overheads shared, prefill terms per model, which is what ``bidikv profile``
carries to a model nobody measured on the measured models' hardware, see calibration.portable). Each
field belongs to one latency model:

* prefill (calibration.prefill): ``prefill_fixed_per_layer_s`` [s per layer per forward pass],
  ``gemm_mfu`` and ``attention_mfu`` [fraction of dense peak FLOP/s, in (0, 1]];
* transfer (calibration.transfer): ``transfer_setup_s`` [s per transfer], ``transfer_per_descriptor_s``
  [s per NIXL descriptor], ``efa_efficiency`` [fraction of EFA line rate, in (0, 1]];
* reuse (calibration.reuse): ``reuse_overhead_per_token_s`` [s per reused token, calibrated];
* TTFT (calibration.ttft): ``ttft_overhead_fixed_s`` [s], ``ttft_overhead_per_prompt_token_s`` [s per
  prompt token], ``ttft_overhead_per_reused_byte_s`` [s per reused KV byte, calibrated];
* decode (calibration.decode, calibration.decode_step): ``hbm_efficiency`` [fraction of HBM bandwidth],
  ``decode_per_layer_overhead_s`` [s per layer per step], ``decode_per_allreduce_s`` [s per TP
  all-reduce, two per layer when TP > 1], ``decode_per_seq_overhead_s`` [s per sequence per step]: fitted across
  published vLLM decode measurements across models and GPUs (calibration.decode_fit,
  ``data/decode_overheads.json``) and set on every efficiency calibration.fit builds; the defaults below only fill
  an efficiencies file written without them; ``decode_reference_batch`` [sequences],
  ``gpu_memory_utilization`` [fraction of HBM vLLM may use].
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

from calibration import jsondata

from calibration.hardware import DATA_DIR

_FRACTIONS = ("gemm_mfu", "attention_mfu", "efa_efficiency", "hbm_efficiency", "gpu_memory_utilization")


@dataclass(frozen=True, slots=True)
class HardwareEfficiencies:
    hardware: str
    prefill_fixed_per_layer_s: float
    gemm_mfu: float
    attention_mfu: float
    transfer_setup_s: float
    transfer_per_descriptor_s: float
    efa_efficiency: float
    reuse_overhead_per_token_s: float
    ttft_overhead_fixed_s: float
    ttft_overhead_per_prompt_token_s: float
    ttft_overhead_per_reused_byte_s: float
    hbm_efficiency: float = 0.7
    decode_per_layer_overhead_s: float = 30e-6
    decode_per_seq_overhead_s: float = 50e-6
    decode_per_allreduce_s: float = 0.0
    decode_reference_batch: int = 32
    gpu_memory_utilization: float = 0.9
    provenance: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.type not in ("float", "int"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"efficiencies: field {f.name} must be a number >= 0, got {value!r}")
            if f.name in _FRACTIONS and not 0 < value <= 1:
                raise ValueError(f"efficiencies: field {f.name} must be in (0, 1], got {value!r}")
        if self.decode_reference_batch < 1:
            raise ValueError("efficiencies: field decode_reference_batch must be >= 1")

    def to_json(self) -> str:
        return jsondata.to_json(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> "HardwareEfficiencies":
        return jsondata.from_dict(cls, data, source, "efficiency")


def efficiencies_path(hardware_name: str) -> pathlib.Path:
    return DATA_DIR / f"{hardware_name}_efficiencies.json"


def load_efficiencies(name_or_path: str) -> HardwareEfficiencies:
    """Shipped efficiencies for a hardware name (``p5en``) or a JSON file path."""
    path = pathlib.Path(name_or_path)
    if not path.suffix:
        path = efficiencies_path(name_or_path)
    if not path.is_file():
        raise ValueError(f"efficiencies {name_or_path!r} not found ({path}); run `python -m calibration.fit`")
    return HardwareEfficiencies.from_dict(jsondata.read_json(path), str(path))
