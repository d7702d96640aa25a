"""What a bench JSONL does not say about the deployment it measured, and the simulator must be told.

A ``bidikv bench`` record has the turn's lengths and times, not the deployment's KV geometry or policy.
Fitting a profile needs the geometry (the block size rounds what P can pull; KV bytes per token turn
a fitted per-token pull cost into bytes/s); replaying the turns needs the policy (threshold, TTL).
They come from a ``<run>.deployment.json`` beside the JSONL (``tests/e2e/record_validate.py`` writes
one), overridden by flags. This dataclass is the one source of the defaults; the flags' help is in
each field's metadata.
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field
from typing import Any

from calibration import jsondata
from impl.policy import catalogue


def _default(name: str) -> Any:
    return catalogue.setting(name).default


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class DeploymentSettings:
    bidirectional: bool = _f(True, "the deployment ran bidirectional KV transfer (default: the bench records' mode)")
    kv_recompute_threshold: int = _f(64, "P pulls iff reusable tokens >= this (vLLM's default 64)")
    decoder_kv_blocks_ttl: float = _f(480.0, "seconds D kept a finished turn's blocks (vLLM's default 480)")
    expiry_margin_s: float = _f(5.0, "P and the router decline reads this close to expiry (vLLM: 5 s)")
    # 0 = unknown: kept from the base profile, and said so in the report (a wrong block size changes
    # what the simulator can pull; wrong bytes per token make the fitted wire rate wrong by the same factor)
    block_size: int = _f(0, "tokens per KV block of the deployment (0: the base profile's, reported as kept)")
    kv_bytes_per_token: float = _f(0.0, "KV bytes per token, all layers (0: the base profile's, reported as kept)")
    decode_kv_blocks: int = _f(0, "KV blocks on D (0: from the profile's HBM budget)")
    max_num_seqs: int = _f(256, "vLLM --max-num-seqs of D")
    prefix_caching_on_p: bool = _f(False, "P ran with prefix caching (tests/e2e runs it off, as the published setup)")
    # the router's prefill on D (impl.policy.prefill_on_d; bidikv router --prefill-on-d ...), same names and defaults
    prefill_on_d: str = _f(_default("prefill_on_d"), "the router's --prefill-on-d policy (off, isl_bounding, "
                           "prefill_load, isl_or_load)")
    prefill_on_d_suffix_tokens: int = _f(_default("prefill_on_d_suffix_tokens"), "the router's --prefill-on-d-suffix-tokens")
    prefill_on_d_suffix_ratio: float = _f(_default("prefill_on_d_suffix_ratio"), "the router's --prefill-on-d-suffix-ratio")

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "DeploymentSettings":
        """From a deployment JSON; keys that are not settings (uptime, seed, ...) are ignored."""
        try:
            data = jsondata.read_json(pathlib.Path(path))
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        names = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in data.items():
            if key == "prefix_caching":
                key = "prefix_caching_on_p"
            if key in names:
                kind = type(names[key].default)
                if kind is float and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                    raise ValueError(f"{path}: field {key} must be {kind.__name__}, got {value!r}")
                kwargs[key] = value
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "DeploymentSettings":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def sidecar_path(bench_jsonl: str | pathlib.Path) -> pathlib.Path:
    """``run.jsonl`` -> ``run.deployment.json``."""
    p = pathlib.Path(bench_jsonl)
    return p.with_name(p.name.removesuffix(".jsonl") + ".deployment.json")


def settings_for(bench_jsonl: str | pathlib.Path, **overrides: Any) -> DeploymentSettings:
    """The sidecar's settings if there is one, else the defaults; non-None overrides win."""
    side = sidecar_path(bench_jsonl)
    base = DeploymentSettings.load(side) if side.is_file() else DeploymentSettings()
    return base.replace(**overrides)
