"""The Grafana dashboard the chart ships: off by default, a ConfigMap with the sidecar's label
when on, holding the dashboard file byte for byte; and every query of every panel (and of the
template variables) names only metrics the operator exports (PromQL metric names parsed out of
each expression and checked against the operator's registry plus the per-job families made from
a full status), and every label a query selects, groups by or shows is one the operator exports
and no Prometheus target label shadows."""

from __future__ import annotations

import json
import re
from typing import Any

from prometheus_client import REGISTRY

from ppojob_operator import metrics
from tests.chart.test_chart import VALUE_SETS
from tests.helpers.helm import CHART
from tests.operator.test_job_metrics import STATUS, TARGET_LABELS

DASHBOARD = CHART / "dashboards" / "ppojob-training.json"

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names of a PromQL expression: identifiers that are not functions (followed by
    '('), keywords, label names in grouping clauses, label matchers, strings, durations or
    Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = _GROUPING.sub("", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)  # Grafana variables
    names = set()
    for m in _IDENT.finditer(e):
        word = m.group()
        if m.start() > 0 and e[m.start() - 1].isdigit():
            continue  # a duration's unit (5m) or a number's exponent
        if word.lower() in _PROMQL_WORDS or re.match(r"\s*\(", e[m.end() :]):
            continue
        names.add(word)
    return names


def test_metric_names_parser() -> None:
    assert metric_names('sum by (phase) (rate(a_total{x=~"$ns", y="b c"}[5m])) / b') == {
        "a_total",
        "b",
    }
    assert metric_names('time() - ppojob_x{job=~"$job"} offset 5m > 1e3') == {"ppojob_x"}


def exported_names() -> set[str]:
    """Every sample name the operator's /metrics can carry: its registry (counters and
    histograms by their sample suffixes) and the per-job families of a full status."""
    families = [*REGISTRY.collect(), *metrics.job_families({("ns", "job"): STATUS})]
    names: set[str] = set()
    for fam in families:
        names |= {s.name for s in fam.samples}
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names |= {fam.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(fam.name)
    return names


_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def label_names(expr: str) -> set[str]:
    """Label names of a PromQL expression: its matchers' and its grouping clauses'."""
    names = set()
    for block in re.findall(r"\{([^}]*)\}", expr):
        names |= set(_MATCHER.findall(block))
    for clause in _GROUPING.findall(expr):
        inner = clause[clause.index("(") + 1 : -1]
        names |= {n.strip() for n in inner.split(",") if n.strip()}
    return names


def test_label_names_parser() -> None:
    expr = 'sum by (le, x) (rate(a{ppojob=~"$job", b!="c"}[5m]))'
    assert label_names(expr) == {"le", "x", "ppojob", "b"}


def dashboard_labels(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """Where -> the label names it uses: each panel's queries and legends, each variable's
    query and the label it takes values of."""
    out: dict[str, set[str]] = {}
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            used = label_names(t["expr"]) | set(_LEGEND.findall(t.get("legendFormat", "")))
            out.setdefault(p["title"], set()).update(used)
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.match(r"label_values\((.*),\s*(\w+)\)$", query)
            assert inner, query
            out[f"variable {var['name']}"] = label_names(inner.group(1)) | {inner.group(2)}
    return out


def test_every_label_a_query_uses_is_exported_and_no_target_label() -> None:
    """A query on ``namespace`` or ``job`` would read Prometheus's target labels (the operator's
    namespace and scrape job, whatever the job), so the dashboard could not tell jobs apart."""
    families = [*REGISTRY.collect(), *metrics.job_families({("ns", "job"): STATUS})]
    exported = {"le"} | {k for fam in families for s in fam.samples for k in s.labels}
    # (a labelled counter has no sample before its first increment: its declared label names)
    exported |= {n for m in vars(metrics).values() for n in getattr(m, "_labelnames", ())}
    used = dashboard_labels(json.loads(DASHBOARD.read_text()))
    assert any(set(metrics.JOB_LABELS) <= names for names in used.values())
    for where, names in used.items():
        assert names <= exported, f"{where}: {sorted(names - exported)} not exported"
        assert not names & TARGET_LABELS.keys(), f"{where}: {sorted(names & TARGET_LABELS.keys())}"


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    out = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            # label_values(metric{...}, label): the first argument is the metric
            inner = re.match(r"label_values\((.*),\s*\w+\)$", query)
            out.append((f"variable {var['name']}", inner.group(1) if inner else query))
    return out


def test_every_panel_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    queries = _queries(dashboard)
    assert len(queries) >= len(dashboard["panels"])
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        assert names <= exported, f"{title}: {sorted(names - exported)} not exported ({expr})"
    # and every per-job metric is on the dashboard
    shown = set().union(*(metric_names(e) for _, e in queries))
    per_job = {n for n in exported if n.startswith("ppojob_job_")}
    assert per_job <= shown, sorted(per_job - shown)


def test_dashboard_configmap_is_off_by_default_and_labelled_for_the_sidecar(render) -> None:
    assert not [o for o in render() if o["kind"] == "ConfigMap"]
    (cm,) = [o for o in render(values=VALUE_SETS["servicemonitor"]) if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "ML"}
    assert cm["metadata"]["namespace"] == "ppojob-system"
    assert json.loads(cm["data"]["ppojob-training.json"]) == json.loads(DASHBOARD.read_text())
