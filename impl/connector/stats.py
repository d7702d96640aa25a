"""Token-exact reuse on vLLM's own ``/metrics``: tokens offered, verified, pulled and refused (by reason).

The counts are taken on the scheduler side (where a read is decided) and travel vLLM's own path
for connector statistics: the scheduler asks the connector for scheduler-side stats every step and
aggregates them with the workers' NIXL stats, and the API server turns the result into Prometheus
samples. Both sides must use this class, whose ``data`` has every key, because vLLM aggregates the
two dicts key by key; so the worker's NIXL stats object is replaced by one (worker.py).

Exported as ``vllm:bidikv_prefix_tokens_total{path="d_to_p"|"p_to_d", outcome=...}`` with outcomes
``offered``, ``verified``, ``pulled`` and ``refused_<reason>`` (``partial``, ``no_check``,
``scheme``, ``malformed``; ``unverified`` counts tokens pulled from a peer that published nothing,
where the operator allowed it).

D's give-back (``bidikv_retained_under_pressure: "give_back"``): ``vllm:bidikv_given_back_total`` (retained
turns D stopped renewing under memory pressure), ``vllm:bidikv_given_back_blocks_total`` (their blocks),
``vllm:bidikv_given_back_freed_total`` and ``vllm:bidikv_give_back_seconds_total`` (how many were freed,
and the seconds from withholding to free summed over them: their ratio is the mean time to give back).

D's release of a retained turn whose successor ran on D (prefill on D, ``bidikv_supersedes`` in the successor's
params): ``vllm:bidikv_superseded_released_total`` (turns released before their expiry) and
``vllm:bidikv_superseded_seconds_total`` (the hold they had left, summed: pinned time saved).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics

from impl.connector.prefix import ReuseReport
from impl.policy.prefix_check import VerifyReason

PATHS = ("d_to_p", "p_to_d")
OUTCOMES = ("offered", "verified", "pulled") + tuple(
    f"refused_{r.value}" for r in VerifyReason if r is not VerifyReason.FULL) + ("refused_unverified",)
GIVE_BACK_KEYS = ("bidikv_given_back", "bidikv_given_back_blocks", "bidikv_given_back_freed", "bidikv_give_back_seconds")
SUPERSEDED_KEYS = ("bidikv_superseded_released", "bidikv_superseded_seconds")
RELEASE_KEYS = GIVE_BACK_KEYS + SUPERSEDED_KEYS  # retained turns D let go before their expiry, either way
KEYS = tuple(f"bidikv_{path}_{outcome}" for path in PATHS for outcome in OUTCOMES) + RELEASE_KEYS


class BidikvKVConnectorStats(NixlKVConnectorStats):
    def reset(self) -> None:
        super().reset()
        for key in KEYS:
            self.data[key] = []

    def record_reuse(self, report: ReuseReport) -> None:
        prefix = f"bidikv_{report.path}_"
        if prefix + "offered" not in self.data:
            return
        self.data[prefix + "offered"].append(report.offered)
        self.data[prefix + "verified"].append(report.verified)
        self.data[prefix + "pulled"].append(report.pulled)
        if report.offered > report.verified and prefix + f"refused_{report.reason}" in self.data:
            self.data[prefix + f"refused_{report.reason}"].append(report.offered - report.verified)

    def record_give_back(self, blocks: int) -> None:
        self.data["bidikv_given_back"].append(1)
        self.data["bidikv_given_back_blocks"].append(blocks)

    def record_given_back_freed(self, seconds: float) -> None:
        self.data["bidikv_given_back_freed"].append(1)
        self.data["bidikv_give_back_seconds"].append(seconds)

    def record_superseded(self, seconds_left: float) -> None:
        self.data["bidikv_superseded_released"].append(1)
        self.data["bidikv_superseded_seconds"].append(seconds_left)

    def aggregate(self, other: Any) -> "BidikvKVConnectorStats":
        # a plain NIXL stats object (another connector's worker) lacks our keys: add what is there
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in KEYS)

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        for path in PATHS:
            offered = sum(self.data.get(f"bidikv_{path}_offered", ()))
            if offered:
                out[f"Prefix {path} offered/verified/pulled tokens"] = (
                    f"{offered}/{sum(self.data[f'bidikv_{path}_verified'])}/{sum(self.data[f'bidikv_{path}_pulled'])}")
        given = sum(self.data.get("bidikv_given_back", ()))
        if given:
            out["Retained turns given back (blocks)"] = f"{given} ({sum(self.data['bidikv_given_back_blocks'])})"
        return out


class BidikvPromMetrics(NixlPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(
            name="vllm:bidikv_prefix_tokens",
            documentation="Tokens a peer offered for reuse, of them verified equal to the prompt's token ids, "
                          "pulled, and refused by reason (bidikv token-exact reuse).",
            labelnames=list(labelnames) + ["path", "outcome"])
        self.bidikv_prefix_tokens = {
            (idx, path, outcome): counter.labels(*values, path, outcome)
            for idx, values in per_engine_labelvalues.items() for path in PATHS for outcome in OUTCOMES}
        helps = {"bidikv_given_back": "Retained turns D stopped renewing under memory pressure (give_back).",
                 "bidikv_given_back_blocks": "KV blocks of the retained turns D gave back under memory pressure.",
                 "bidikv_given_back_freed": "Given-back turns D freed (at their last published expiry).",
                 "bidikv_give_back_seconds": "Seconds from withholding a retained turn's renewal to freeing it, "
                                             "summed over the turns freed.",
                 "bidikv_superseded_released": "Retained turns D released before their expiry because their "
                                               "successor ran on D (prefill on D).",
                 "bidikv_superseded_seconds": "Hold those superseded turns had left when D released them, summed."}
        self.bidikv_give_back = {}
        for key, help_text in helps.items():
            c = self._counter_cls(name=f"vllm:{key}", documentation=help_text, labelnames=list(labelnames))
            for idx, values in per_engine_labelvalues.items():
                self.bidikv_give_back[(idx, key)] = c.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for path in PATHS:
            for outcome in OUTCOMES:
                total = sum(transfer_stats_data.get(f"bidikv_{path}_{outcome}", ()))
                if total:
                    self.bidikv_prefix_tokens[(engine_idx, path, outcome)].inc(total)
        for key in RELEASE_KEYS:
            total = sum(transfer_stats_data.get(key, ()))
            if total:
                self.bidikv_give_back[(engine_idx, key)].inc(total)
