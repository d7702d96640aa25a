"""The hardware facts the latency models use (``data/hardware_<name>.json``), one preset per instance type.

Shipped presets (:data:`PRESETS`): ``p5`` (p5.48xlarge, 8x H100 SXM), ``p5e`` (p5e.48xlarge, 8x H200),
``p5en`` (p5en.48xlarge, 8x H200: the hardware every published figure this project fits was measured
on), ``p6-b200`` (p6-b200.48xlarge, 8x B200) and ``trn2`` (trn2.48xlarge, 16x Trainium2). Each file cites
the page every value comes from (``_sources``: field -> URL) and says in ``_notes`` what no source gave.

Peak FLOP/s are dense (no sparsity) per accelerator, by the dtype the matmuls run in; the EFA rate is per
accelerator (p5en: 3,200 Gbps over 8 GPUs = 400 Gbps = 50 GB/s each), and each TP rank's share of a KV
transfer crosses its own accelerator's NICs, so a TP-t instance moves KV at up to t x 50 GB/s. On trn2 the
``*_per_gpu`` fields mean per Trainium2 chip and ``nvlink_bytes_per_s_per_gpu`` is NeuronLink's.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

from calibration import jsondata

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"

# The shipped presets, in the order the CLI lists them: short name -> instance type.
PRESETS: dict[str, str] = {"p5": "p5.48xlarge", "p5e": "p5e.48xlarge", "p5en": "p5en.48xlarge",
                           "p6-b200": "p6-b200.48xlarge", "trn2": "trn2.48xlarge"}
MEASURED_ON = "p5en"  # the hardware the published figures (and so every fitted efficiency) were measured on


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
    accelerator: str = ""  # the file's "gpu" field: "H200", "B200", "Trainium2"
    host_ram_bytes: float = 0.0  # the instance's host DRAM (what a host KV tier draws on); 0 = not given
    pcie_bytes_per_s_per_gpu: float = 0.0  # one direction of the GPU's host link (offload, load); 0 = not given

    @property
    def is_neuron(self) -> bool:
        """An AWS Trainium/Inferentia accelerator: vLLM runs there on the Neuron backend, not CUDA."""
        return self.accelerator.lower().startswith(("trainium", "inferentia"))

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
                    nvlink_bytes_per_s_per_gpu=float(data["nvlink_bytes_per_s_per_gpu"]),
                    accelerator=str(data.get("gpu", "")),
                    host_ram_bytes=_optional_positive(data, "host_ram_bytes", source),
                    pcie_bytes_per_s_per_gpu=_optional_positive(data, "pcie_bytes_per_s_per_gpu", source))


def _optional_positive(data: Mapping[str, Any], name: str, source: str) -> float:
    """A field a preset may leave out (0.0 then: not given); given, it must be a positive number."""
    if name not in data:
        return 0.0
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{source}: field {name!r} must be a positive number, got {value!r}")
    return float(value)


def preset_choices() -> str:
    """The shipped preset names, as the CLI lists them."""
    return ", ".join(PRESETS)


def _preset_key(name: str) -> str | None:
    if name in PRESETS:
        return name
    for key, instance in PRESETS.items():
        if name == instance:
            return key
    return None


def load_hardware(name_or_path: str) -> Hardware:
    """A shipped preset by short name (``p6-b200``) or instance type (``p6-b200.48xlarge``), or a path
    to a JSON file of the same shape."""
    key = _preset_key(name_or_path)
    path = DATA_DIR / f"hardware_{key}.json" if key else pathlib.Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown hardware {name_or_path!r}: choose one of {preset_choices()} "
                         f"(or the instance type, e.g. {PRESETS['p6-b200']}), or give the path of a hardware "
                         f"JSON file")
    return hardware_from_dict(jsondata.read_json(path), str(path), key or path.stem.removeprefix("hardware_"))
