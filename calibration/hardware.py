"""The hardware facts the latency models use (``data/hardware_<name>.json``; source: AWS EC2 P5en specifications, https://aws.amazon.com/ec2/instance-types/p5/).

Peak FLOP/s are dense (no sparsity) per GPU, by the dtype the matmuls run in; the EFA rate is per GPU
(p5en: 3,200 Gbps over 8 GPUs = 400 Gbps = 50 GB/s each), and each TP rank's share of a KV transfer
crosses its own GPU's NICs, so a TP-t instance moves KV at up to t x 50 GB/s.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

from calibration import jsondata

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"


@dataclass(frozen=True, slots=True)
class Hardware:
    key: str  # short name the CLI uses (``p5en``)
    name: str
    gpus_per_node: int
    hbm_bytes_per_gpu: float
    hbm_bytes_per_s_per_gpu: float
    dense_flops_per_s_per_gpu: Mapping[str, float]  # by dtype: "bf16", "fp8"
    efa_bytes_per_s_per_gpu: float
    nvlink_bytes_per_s_per_gpu: float

    def peak_flops_per_s(self, dtype: str, tp: int) -> float:
        key = "bf16" if dtype in ("bf16", "fp16") else dtype
        if key not in self.dense_flops_per_s_per_gpu:
            raise ValueError(f"hardware {self.name!r}: no peak FLOP/s for dtype {dtype!r} "
                             f"(field dense_flops_per_s_per_gpu has {sorted(self.dense_flops_per_s_per_gpu)})")
        return self.dense_flops_per_s_per_gpu[key] * tp

    def efa_line_bytes_per_s(self, tp: int) -> float:
        return self.efa_bytes_per_s_per_gpu * tp

    def check_tp(self, tp: int) -> None:
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= self.gpus_per_node:
            raise ValueError(f"tp must be an integer in 1..{self.gpus_per_node} on {self.name}, got {tp!r}")


_REQUIRED = ("name", "gpus_per_node", "hbm_bytes_per_gpu", "hbm_bytes_per_s_per_gpu", "dense_flops_per_s_per_gpu",
             "efa_bytes_per_s_per_gpu", "nvlink_bytes_per_s_per_gpu")


def hardware_from_dict(data: Mapping[str, Any], source: str, key: str) -> Hardware:
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: hardware must be a JSON object")
    for name in _REQUIRED:
        if name not in data:
            raise ValueError(f"{source}: field {name!r} is missing")
    for name in _REQUIRED[1:]:
        value = data[name]
        values = list(value.values()) if isinstance(value, Mapping) else [value]
        if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in values):
            raise ValueError(f"{source}: field {name!r} must be positive number(s), got {value!r}")
    return Hardware(key=key, name=str(data["name"]), gpus_per_node=int(data["gpus_per_node"]),
                    hbm_bytes_per_gpu=float(data["hbm_bytes_per_gpu"]),
                    hbm_bytes_per_s_per_gpu=float(data["hbm_bytes_per_s_per_gpu"]),
                    dense_flops_per_s_per_gpu={k: float(v) for k, v in data["dense_flops_per_s_per_gpu"].items()},
                    efa_bytes_per_s_per_gpu=float(data["efa_bytes_per_s_per_gpu"]),
                    nvlink_bytes_per_s_per_gpu=float(data["nvlink_bytes_per_s_per_gpu"]))


def load_hardware(name_or_path: str) -> Hardware:
    """``p5en`` (shipped: ``data/hardware_p5en.json``) or a path to a JSON file of the same shape."""
    path = pathlib.Path(name_or_path)
    if not path.suffix:
        path = DATA_DIR / f"hardware_{name_or_path}.json"
    if not path.is_file():
        shipped = sorted(p.stem.removeprefix("hardware_") for p in DATA_DIR.glob("hardware_*.json"))
        raise ValueError(f"hardware {name_or_path!r} not found (shipped: {', '.join(shipped)})")
    return hardware_from_dict(jsondata.read_json(path), str(path), path.stem.removeprefix("hardware_"))
