"""docs/grafana/pdxfer.json asks only for series the engines export, and shows every one (#32).

The exported names come from real engines' registries (a prefill and a
decode, each collected once), so a renamed or dropped series fails here
before a dashboard goes blank in production.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pdxfer_testkit import build_pools, config

from pdxfer import DecodeEngine, PrefillEngine, RequestFailed

pytest.importorskip("prometheus_client")

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pdxfer.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def _exported() -> tuple[dict[str, str], set[str]]:
    """Every series name an engine exports -> its family, and every label any of them has."""
    names, labels = {}, {"le", "instance", "job"}
    cfg = config("loopback", metrics=True)
    with PrefillEngine(build_pools(8, 2, seed=1), cfg) as prefill, \
            DecodeEngine(build_pools(8, 2), cfg) as decode:
        # a success and a failure: every labelled family then has a sample naming its labels
        decode.expect("ok", prefill.bootstrap_address, {"kv": [1], "state": [1]})
        prefill.send("ok", {"kv": [2], "state": [0]})
        decode.wait("ok", 30.0)
        decode.expect("no", prefill.bootstrap_address, {"kv": [3], "state": [0]})
        decode.abort("no", "test")
        with pytest.raises(RequestFailed):
            decode.wait("no", 30.0)
        for engine in (prefill, decode):
            for family in engine.metrics.collect():
                for suffix in SUFFIXES[family.type]:
                    names[family.name + suffix] = family.name
                labels.update(k for s in family.samples for k in s.labels)
    return names, labels


def _queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    out += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return out


def test_every_query_names_exported_series_and_every_family_is_shown() -> None:
    names, labels = _exported()
    shown = set()
    for expr in _queries():
        used = set(re.findall(r"\bpdxfer_\w+", expr))
        assert used, f"a dashboard query names no pdxfer series: {expr}"
        unknown = used - set(names)
        assert not unknown, f"{sorted(unknown)} not exported (exported: {sorted(names)}): {expr}"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in labels, f"label {label!r} is on no exported series: {expr}"
        shown |= {names[u] for u in used}
    assert shown == set(names.values()), f"families on no panel: {set(names.values()) - shown}"
