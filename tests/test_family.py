"""The API families' declarations: which paths each owns, guards and labels."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kcoral.metrics import HttpMetrics
from kcoral.web.family import ARRAYS, CLIENT, FAMILIES, INFERENCE, NODES, OPEN, RUN, guarded, route_of


def family_of(path: bytes):
    """The family whose route C{path} is; None when it is none's."""
    route = route_of(path)
    return next((f for f in FAMILIES if route in f.routes), None)


@pytest.mark.parametrize("path, family", [
    (b"/v1/run", RUN), (b"/v1/nodes", NODES), (b"/v2", INFERENCE),
    (b"/v2/models/mlp/infer", INFERENCE), (b"/v2/models/mlp/versions/1/config", INFERENCE),
    (b"/v1/nodes/gpu-a", NODES), (b"/v1/nodes/a/b", None), (b"/v1/runs", None), (b"/v2x", None),
    (b"/health", None),
    (b"/v2/models/mlp/infer/more", None), (b"/v1/arrays", ARRAYS), (b"/v1/arrays/x-y", ARRAYS),
    (b"/v1/arrays/x/y", None), (b"/v1/arraysx", None),
])
def test_each_path_belongs_to_at_most_one_family(path, family):
    """A path is a family's only when one of its routes matches it whole."""
    assert family_of(path) is family


def test_health_and_server_metadata_stay_open():
    """The inference protocol's health and server metadata need no token; everything else does."""
    assert not guarded(b"/v2/health/ready") and not guarded(b"/v2") and not guarded(b"/v2/health/live")
    assert {r.guard for r in INFERENCE.routes} == {OPEN, CLIENT}
    assert guarded(b"/v2/models/mlp/infer") and guarded(b"/v2/repository/index")
    assert guarded(b"/v1/run") and guarded(b"/v1/nodes")
    assert guarded(b"/v1/arrays") and guarded(b"/v1/arrays/x-y")
    # The node token guards node control, in its handler: no client token there.
    assert not guarded(b"/v1/nodes/gpu-a")


def test_model_names_do_not_reach_the_metrics_labels():
    """Every model's inferences share one route label: the labels stay bounded."""
    metrics = HttpMetrics(CollectorRegistry(), frozenset({"/health"}))
    assert metrics.route_of(b"/v2/models/a/infer") == metrics.route_of(b"/v2/models/b/infer?x=1") \
        == "/v2/models/{model}/infer"
    assert metrics.route_of(b"/v2/models/a/versions/7/ready") == "/v2/models/{model}/versions/{version}/ready"
    assert metrics.route_of(b"/v1/run") == "/v1/run" and metrics.route_of(b"/nope") == "other"


def test_the_security_pages_table_lists_every_route():
    """doc/security.rst's table of routes names every declared route, with its family and its guard."""
    text = (Path(__file__).parents[1] / "doc" / "security.rst").read_text()
    rows = {line.split("``")[1]: line for line in text.splitlines()
            if line.startswith(("``/", "``..."))}
    for family in FAMILIES:
        for route in family.routes:
            label = route.label
            row = rows.get(label) or rows[".../" + label.split("/", 4)[4]]
            assert family.name in row and route.guard in row.replace("nothing", OPEN), row
