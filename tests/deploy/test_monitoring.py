"""The Grafana dashboard and the Prometheus alert rules shipped in impl/deploy/monitoring.

Every PromQL expression is parsed (promql-parser, the Rust PromQL parser's Python binding); every metric
it names must be exported: bidikv's router and connector metrics as the generated reference lists them
(docs/reference/metrics.md, itself checked against the code by tests/test_docs.py), vLLM's as the
installed vLLM's source names them. Label matchers on bidikv's metrics must use their labels (or the
scrape's target labels), and an exact label value must be one the exporting code spells. No Prometheus
or Grafana runs here: what is not checked is that the panels draw what their titles say.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import promql_parser
import pytest
import yaml

from impl.deploy.k8s_render import ALERTS_FILE, DASHBOARD_FILE
from tests.deploy.conftest import ROOT

# Labels Prometheus (through the ServiceMonitors: targetLabels bidikv_role) adds to every scraped series
TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "endpoint", "container", "bidikv_role"}
VLLM_LABELS = {"engine", "model_name"}  # vLLM's per-engine labels, on the connector's metrics too
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*"}


def _reference() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from the generated metrics reference."""
    out = {}
    for line in (ROOT / "docs" / "reference" / "metrics.md").read_text().splitlines():
        m = re.match(r"^\| `([a-z_:]+)` \| (counter|gauge|histogram) \| ([^|]*) \|", line)
        if m:
            out[m[1]] = (m[2], set(re.findall(r"`([a-z_]+)`", m[3])))
    return out


_VLLM_ROOT = Path(importlib.util.find_spec("vllm").origin).parent
# vLLM registers its metrics as self._counter_cls(name="vllm:...") etc. (prometheus_client's classes)
_VLLM_TYPED = re.compile(r"_?(histogram|counter|gauge|Histogram|Counter|Gauge)(?:_cls)?\(\s*name=\"(vllm:[a-z_]+)\"")


def _vllm_names() -> tuple[set[str], dict[str, str]]:
    """Every vllm:... name the installed vLLM's source spells, and the type of those it registers in the
    usual way (a name without a known type is accepted with any suffix)."""
    names, types = set(), {}
    for path in _VLLM_ROOT.rglob("*.py"):
        text = path.read_text(errors="replace")
        names.update(re.findall(r"[\"'](vllm:[a-z][a-z0-9_]*)[\"']", text))
        types.update({name: kind.lower() for kind, name in _VLLM_TYPED.findall(text)})
    return names, types


REFERENCE = _reference()
VLLM, VLLM_TYPES = _vllm_names()
SUFFIX_OF = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
SOURCES = {"bidikv": "\n".join(p.read_text() for p in (ROOT / "impl").rglob("*.py")),
           "vllm": "\n".join(p.read_text(errors="replace")
                             for p in Path(importlib.util.find_spec("vllm").origin).parent.rglob("v1/**/*.py"))}


def _exported(name: str) -> tuple[str, set[str] | None] | None:
    """(who exports it, its labels if known) or None."""
    if name in REFERENCE:
        return "bidikv", REFERENCE[name][1]
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and REFERENCE.get(base, ("",))[0] == "histogram":
            return "bidikv", REFERENCE[base][1] | ({"le"} if suffix == "_bucket" else set())
    for suffix in ("", "_total", "_bucket", "_sum", "_count"):
        if suffix and not name.endswith(suffix):
            continue
        base = name.removesuffix(suffix) if suffix else name
        kind = VLLM_TYPES.get(base)
        if base in VLLM and (kind is None or suffix in SUFFIX_OF[kind]):  # not a gauge read as a histogram
            return "vllm", None
    return None


def expression_problems(expr: str) -> list[str]:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    try:
        ast = promql_parser.parse(expr)
    except ValueError as e:
        return [f"does not parse: {e}"]
    problems: list[str] = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            who = _exported(node.name)
            if who is None:
                problems.append(f"names {node.name}, which neither bidikv nor the installed vLLM exports")
                return
            exporter, labels = who
            for m in node.matchers.matchers:
                if m.name in TARGET_LABELS:
                    continue
                if labels is not None and m.name not in labels | VLLM_LABELS:
                    problems.append(f"{node.name} has no label {m.name!r} (its labels: {sorted(labels)})")
                if m.op == promql_parser.MatchOp.Equal and f'"{m.value}"' not in SOURCES[exporter]:
                    problems.append(f"{node.name}{{{m.name}=\"{m.value}\"}}: no such value in {exporter}'s code")

    promql_parser.walk(ast, visit, None)
    return problems


def _dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def _panels():
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _rules():
    return [r for g in yaml.safe_load(ALERTS_FILE.read_text())["groups"] for r in g["rules"]]


def test_the_metric_inventories_are_not_empty():
    assert "bidikv_router_reuse_hits_total" in REFERENCE and "vllm:bidikv_given_back_total" in REFERENCE
    assert {"vllm:time_to_first_token_seconds", "vllm:num_requests_waiting_by_reason"} <= VLLM


@pytest.mark.parametrize("bad, words", [
    ("sum(rate(bidikv_router_reuse_hitz_total[5m]))", "neither bidikv nor the installed vLLM"),
    ("sum(rate(bidikv_router_reuse_hits_total[5m])", "does not parse"),
    ('bidikv_router_reuse_misses_total{reasn="expired"}', "has no label 'reasn'"),
    ('bidikv_router_reuse_misses_total{reason="store_unavailble"}', "no such value in bidikv's code"),
    ("histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_tokens_seconds_bucket[5m])))", "neither"),
    ("histogram_quantile(0.9, sum by (le) (rate(vllm:kv_cache_usage_perc_bucket[5m])))", "neither"),  # a gauge
    ("rate(vllm:time_to_first_token_seconds_total[5m])", "neither"),  # a histogram has no _total
])
def test_the_expression_check_fails_on_a_bad_expression(bad, words):
    assert any(words in p for p in expression_problems(bad)), expression_problems(bad)


def test_the_dashboard_loads_and_its_panels_are_well_formed():
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["schemaVersion"] >= 36
    for p in _panels():
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace"}


@pytest.mark.parametrize("panel", _panels(), ids=lambda p: p["title"])
def test_every_dashboard_expression_parses_and_names_exported_metrics(panel):
    for target in panel["targets"]:
        assert expression_problems(target["expr"]) == [], (panel["title"], target["expr"])


def test_the_dashboard_covers_what_the_issue_lists():
    text = " ".join(t["expr"] for p in _panels() for t in p["targets"])
    for metric in ("bidikv_router_reuse_hits_total", "bidikv_router_reuse_matches_total", "bidikv_router_turn_paths_total",
                   "bidikv_router_reuse_misses_total", "bidikv_router_reuse_verified_tokens_total",
                   "vllm:bidikv_prefix_tokens_total", "vllm:bidikv_given_back_blocks_total",
                   "vllm:bidikv_give_back_seconds_total", "vllm:num_requests_waiting_by_reason",
                   "vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
                   'reason="store_unavailable"', 'figure="price_per_token_s"', "budget_tokens"):
        assert metric in text, metric


def test_the_guide_lists_every_panel():
    guide = (ROOT / "docs" / "guides" / "kubernetes.md").read_text()
    missing = [p["title"] for p in _panels() if p["title"] not in guide]
    assert missing == []


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_every_alert_parses_and_names_exported_metrics(rule):
    assert expression_problems(rule["expr"]) == []
    assert rule["labels"]["severity"] in ("warning", "critical")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert re.fullmatch(r"[0-9]+[smh]", rule["for"])


def test_the_alerts_cover_what_the_issue_lists():
    names = {r["alert"] for r in _rules()}
    assert {"BidikvDecodeWaitingForBlocks", "BidikvStoreDown", "BidikvVerificationFailures",
            "BidikvReuseCollapsed"} <= names
