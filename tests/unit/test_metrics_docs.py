"""Every metric docs/metrics.md and the Grafana dashboard name is one the code
defines, with the suffix its kind gets in Prometheus; every defined metric is
documented."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
)

from kvstore_tiers.metrics import PREFIX, metric_definitions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "docs" / "grafana" / "kvstore-tiers.json"
NAME = re.compile(r"vllm:[a-z_:]+\b(?!\*)")  # not the `vllm:kvstore_*` pattern
SUFFIXES = {
    OffloadingCounterMetadata: ("_total", "_created"),
    OffloadingGaugeMetadata: ("",),
    OffloadingHistogramMetadata: ("", "_bucket", "_sum", "_count"),
}


def _exported() -> set[str]:
    """Every series name Prometheus shows for our definitions."""
    names = set()
    for name, meta in metric_definitions().items():
        names.update(name + s for s in SUFFIXES[type(meta)])
    return names


def _vllm_metric_names() -> set[str]:
    """Names vLLM's own stat logger defines (as `name="vllm:..."`)."""
    src = (Path(vllm.__file__).parent / "v1" / "metrics" / "loggers.py").read_text()
    return set(re.findall(r'name="(vllm:[a-z_:]+)"', src))


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


@pytest.mark.parametrize("source", ["docs", "dashboard"])
def test_every_named_metric_exists(source: str) -> None:
    text = DOC.read_text() if source == "docs" else "\n".join(_dashboard_exprs())
    named = set(NAME.findall(text))
    ours = {n for n in named if n.startswith(PREFIX)}
    assert ours, f"no {PREFIX}* metric found in the {source}"
    assert ours <= _exported(), sorted(ours - _exported())
    theirs = {re.sub(r"_total$", "", n) for n in named - ours}
    assert theirs <= _vllm_metric_names(), sorted(theirs - _vllm_metric_names())


def test_every_defined_metric_is_documented_and_charted() -> None:
    doc = set(NAME.findall(DOC.read_text()))
    dash = set(NAME.findall("\n".join(_dashboard_exprs())))
    for name, meta in metric_definitions().items():
        forms = {name + s for s in SUFFIXES[type(meta)]}
        assert forms & doc, f"{name} is not in docs/metrics.md"
        assert forms & dash, f"{name} is not in the Grafana dashboard"


def test_dashboard_labels_are_the_exported_ones() -> None:
    labels = set()
    for expr in _dashboard_exprs():
        labels.update(re.findall(r"([a-z_]+)=~", expr))
        labels.update(x.strip() for m in re.findall(r"by \(([^)]*)\)", expr)
                      for x in m.split(","))
    defined = {lab for meta in metric_definitions().values() for lab in meta.labelnames}
    assert labels <= defined | {"model_name", "engine", "le"}, labels
