"""The bench's settings: one dataclass, the single source of its defaults (the CLI reads them from
here without importing the HTTP client)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BenchConfig:
    url: str
    mode: str  # what the deployment runs: "on" or "off"
    model: str | None = None  # default: the first model /v1/models lists
    concurrency: int = 2
    max_rate_per_s: float = 0.0  # turn starts per second over all clients; 0 = unlimited
    gap_scale: float = 0.0  # think time = workload gap x this (0: back to back, as vLLM's benchmark)
    max_model_len: int = 0  # 0: from /v1/models; conversations stop before exceeding it
    token_id_low: int = 100  # synthetic prompt ids are drawn from [low, high): valid in any real vocab
    token_id_high: int = 1000
    seed: int = 0
    timeout_s: float = 300.0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    # Prefixed to every conversation id sent (records keep the workload's own ids). The workload names
    # its conversations alike in every run, so without it a second run's first turns would be offered the
    # first run's KV (correct KV, but an inflated ON measurement). "" = a fresh random one per run.
    run_id: str = ""

    def wire_id(self, conversation_id: str) -> str:
        """The conversation id as sent: scoped by this run."""
        return f"{self.run_id}/{conversation_id}" if self.run_id else conversation_id

    def __post_init__(self) -> None:
        if self.mode not in ("on", "off"):
            raise ValueError(f"mode must be 'on' or 'off', got {self.mode!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_rate_per_s < 0 or self.gap_scale < 0 or self.timeout_s <= 0:
            raise ValueError("max_rate_per_s and gap_scale must be >= 0, timeout_s > 0")
        if not 0 <= self.token_id_low < self.token_id_high:
            raise ValueError("need 0 <= token_id_low < token_id_high")
