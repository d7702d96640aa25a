"""Prometheus metrics, formatted here (text exposition format 0.0.4).

prometheus_client is in the venv only because vLLM pulls it; the router's needs are a handful of
labelled counters and one histogram, and a dict increment on the request path is cheaper than the
client library's locked value objects (the router's CPU budget is a fraction of a millisecond per
request). Names are prefixed ``bidikv_router_``.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Iterable


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(float(x))


class Counter:
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help_text, labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labelvalues: str, amount: float = 1.0) -> None:
        self.values[labelvalues] = self.values.get(labelvalues, 0.0) + amount

    def get(self, *labelvalues: str) -> float:
        return self.values.get(labelvalues, 0.0)

    def samples(self) -> Iterable[str]:
        for values, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, values)} {_num(v)}"


class FoldedCounter(Counter):
    """A counter that reports some label values as others (``fold``), at increment time."""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...], fold: dict[str, str]) -> None:
        super().__init__(name, help_text, labelnames)
        self.fold = fold

    def inc(self, *labelvalues: str, amount: float = 1.0) -> None:
        labelvalues = tuple(self.fold.get(v, v) for v in labelvalues)
        self.values[labelvalues] = self.values.get(labelvalues, 0.0) + amount


class Gauge(Counter):
    """A value set by the router, or read from its owner at scrape time (``read``).

    ``kind`` may be ``"counter"`` for a monotonic count another object keeps (the store's evictions).
    """

    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = (),
                 read: Callable[[], dict[tuple[str, ...], float]] | None = None, kind: str = "gauge") -> None:
        super().__init__(name, help_text, labelnames)
        self.read = read
        self.kind = kind

    def set(self, *labelvalues: str, value: float) -> None:
        self.values[labelvalues] = value

    def samples(self) -> Iterable[str]:
        if self.read is not None:
            self.values = dict(self.read())
        return super().samples()


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help = name, help_text
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> Iterable[str]:
        cumulative = 0
        for bound, c in zip(self.bounds, self.counts):
            cumulative += c
            yield f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}'
        yield f'{self.name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{self.name}_sum {repr(self.sum)}"
        yield f"{self.name}_count {self.count}"


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Counter | Histogram] = []

    def add(self, metric):
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines.append(f"# HELP {m.name} {m.help}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            lines.extend(m.samples())
        return "\n".join(lines) + "\n"


TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """Every metric the router exports, by what it counts."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        p = "bidikv_router_"
        self.requests = r.add(Counter(p + "requests_total", "Requests answered, by route and HTTP status.", ("route", "status")))
        self.reuse_hits = r.add(Counter(p + "reuse_hits_total", "Turns sent to P with a previous turn's D params."))
        # The store tells "another tenant holds this id" (tenant) from "never seen" (unknown); exported,
        # that difference would let a tenant probe for other tenants' ids, so it is counted as unknown.
        self.reuse_misses = r.add(FoldedCounter(p + "reuse_misses_total", "Turns sent to P without reuse, by reason "
                                                "(store: unknown -- including an id another tenant holds --, expired, guard, "
                                                "evicted, taken: another turn of the same history took it first; router: no_history: a first turn, "
                                                "no_conversation_id: history keys off and no id, unsupported; prefill_error: a hit "
                                                "withdrawn after P failed with it; given_back: a give-back D freed it "
                                                "under memory pressure; not_held: D's renewal answer was not a "
                                                "well-formed held).", ("reason",), fold={"tenant": "unknown"}))
        self.reuse_lookups = r.add(Counter(p + "reuse_lookups_total", "Turns looked up in the store, by what they were "
                                           "looked up by (id: the client named the conversation; prompt_cache_key; "
                                           "history: the messages or prompt the client resent).", ("match",)))
        self.reuse_matches = r.add(Counter(p + "reuse_matches_total", "Turns sent to P with a previous turn's D params, "
                                           "by how that turn was found (id, prompt_cache_key, history).", ("match",)))
        self.trace_lines = r.add(Gauge(p + "trace_lines_total", "Per-turn trace lines (--trace-out), by outcome: "
                                       "written, dropped_queue_full (the writer was behind), dropped_write_error "
                                       "(disk full, directory gone).", ("outcome",), kind="counter"))
        self.trace_unsampled = r.add(Counter(p + "trace_unsampled_turns_total", "Turns of conversations outside "
                                             "--trace-sample-rate."))
        self.give_back_renewals = r.add(Counter(p + "give_back_renewals_total", "Renewals asked of a give-back D "
                                                "before P reads, by outcome (renewed; lapsing: D is giving it back, P may "
                                                "read until its expiry; D's not_held reasons given_back, expired, unknown, "
                                                "other_engine, not_held, and other for any reason the router does not "
                                                "know; no_listener; unreachable; timeout; busy; skipped: the listener "
                                                "failed within --heartbeat-retry-s; bad_answer).", ("outcome",)))
        # --learnt-retention-budget-tokens (impl.router.retention): fleet-wide figures, never per tenant
        self.learnt_retention = r.add(Gauge(p + "learnt_retention", "Learnt per-turn retention, by figure: "
                                            "budget_tokens, price_per_token_s (the value of a token-second of D's memory "
                                            "set to fit a tenant's share of the budget; the highest tenant's), "
                                            "planned_tokens (retained KV the estimates expect, summed over tenants), "
                                            "correction (how far what was asked of D ran from that estimate; the "
                                            "largest tenant's), held_tokens (what was asked of D and is held now, "
                                            "summed).",
                                            ("figure",)))
        self.learnt_holds = r.add(Counter(p + "learnt_retention_holds_total", "Holds the router asked D for, by "
                                          "kind (learnt; none: the turn is not expected back soon enough to be "
                                          "worth its memory, D frees it; fallback: too few returns seen yet, D's "
                                          "decoder_kv_blocks_ttl).", ("kind",)))
        self.learnt_hold_seconds = r.add(Counter(p + "learnt_retention_hold_seconds_total", "Sum of the holds asked "
                                                 "(divide by learnt_retention_holds_total for the mean)."))
        self.learnt_expected_returns = r.add(Counter(p + "learnt_retention_expected_returns_total", "Sum over "
                                                     "learnt holds of the estimated chance the conversation returns "
                                                     "within its hold: the reuse the router expects."))
        self.turn_paths = r.add(Counter(p + "turn_paths_total", "Turns by the path that served them (prefill_on_d: "
                                        "sent whole to the D holding the conversation, --prefill-on-d; pull_to_p: P "
                                        "pulled D's blocks; recompute_on_p) and why (the prefill-on-D policy's reason, "
                                        "impl/policy/prefill_on_d.py: off, short_suffix, p_busy, suffix_too_long, "
                                        "suffix_share_too_high, p_not_busy, d_prefill_busy, d_unavailable, ...; "
                                        "fallback: sent to D, which failed before answering, then served through P).",
                                        ("path", "reason")))
        self.tokens_reused = r.add(Counter(p + "tokens_reused_total", "remote_num_tokens offered to P on hits "
                                           "(P pulls fewer when its own prefix cache covers part or below its threshold)."))
        self.ttft = r.add(Histogram(p + "ttft_seconds", "Router-observed time to first token: request received to "
                                    "first byte of D's answer sent to the client.", TTFT_BUCKETS))
        self.p_verified_tokens = r.add(Counter(p + "reuse_verified_tokens_total", "What P did with the tokens it was "
                                               "offered (its report, impl.policy.prefix_check): offered, verified "
                                               "equal to the prompt's token ids, pulled.", ("outcome",)))
        self.p_verify_results = r.add(Counter(p + "reuse_verify_total", "Offered turns by P's verification outcome "
                                              "(full, partial, no_check, scheme, malformed; none: P sent no report).",
                                              ("reason",)))
        self.upstream_errors = r.add(Counter(p + "upstream_errors_total", "Failed upstream calls, by instance, role and kind.",
                                             ("instance", "role", "kind")))
        self.turns_stored = r.add(Counter(p + "turns_stored_total", "Finished turns whose D params were stored, by where they came from.", ("source",)))
        self.turns_not_stored = r.add(Counter(p + "turns_not_stored_total", "Turns whose D params were not stored, by reason.", ("reason",)))
        self.params_conflicts = r.add(Counter(p + "kv_params_conflicts_total", "Turns where D's final chunk and its "
                                              "notification disagreed (the notification was used)."))
        self.notifications = r.add(Counter(p + "notifications_total", "POSTs to /internal/kv_params, by result.", ("result",)))
        self.stream_errors = r.add(Counter(p + "client_stream_errors_total", "Error events sent to streaming clients, by cause.", ("cause",)))
        self.store_evictions = r.add(Gauge(p + "store_evictions_total", "Conversations evicted by the store's LRU bound.", kind="counter"))
        self.store_entries = r.add(Gauge(p + "store_entries", "Conversations currently in the store."))
        self.store_bytes = r.add(Gauge(p + "store_bytes", "Bytes the in-process store counts for its entries "
                                       "(bounded by max_store_bytes)."))
        self.upstream_healthy = r.add(Gauge(p + "upstream_healthy", "1 if the instance passes health probes.", ("instance", "role")))
        self.upstream_in_flight = r.add(Gauge(p + "upstream_in_flight", "Requests in flight per instance.", ("instance", "role")))
        self.client_connections = r.add(Gauge(p + "client_connections", "Client connections open now."))
        self.client_closed = r.add(Counter(p + "client_connections_closed_total", "Client connections the router "
                                           "closed or refused, by reason (header_timeout and body_timeout: answered 408; "
                                           "idle: kept alive past client_idle_timeout_s; write_timeout: stopped reading for "
                                           "client_write_timeout_s; over_limit: refused with 503 at max_client_connections).",
                                           ("reason",)))
