"""The API families' declarations: which paths each owns, guards and labels."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kcoral.metrics import HttpMetrics
from kcoral.web.family import ARRAYS, INFERENCE, NODES, RUN, family_of


@pytest.mark.parametrize("path, family", [
    (b"/v1/run", RUN), (b"/v1/nodes", NODES), (b"/v2", INFERENCE),
    (b"/v2/models/mlp/infer", INFERENCE), (b"/v2/models/mlp/versions/1/config", INFERENCE),
    (b"/v1/nodes/gpu-a", None), (b"/v1/runs", None), (b"/v2x", None), (b"/health", None),
    (b"/v2/models/mlp/infer/more", None), (b"/v1/arrays", ARRAYS), (b"/v1/arrays/x-y", ARRAYS),
    (b"/v1/arrays/x/y", None), (b"/v1/arraysx", None),
])
def test_each_path_belongs_to_at_most_one_family(path, family):
    """A path is a family's only when one of its routes matches it whole."""
    assert family_of(path) is family


def test_health_and_server_metadata_stay_open():
    """The inference protocol's health and server metadata need no token; everything else does."""
    assert not INFERENCE.guards(b"/v2/health/ready") and not INFERENCE.guards(b"/v2")
    assert INFERENCE.guards(b"/v2/models/mlp/infer") and INFERENCE.guards(b"/v2/repository/index")
    assert RUN.guards(b"/v1/run") and NODES.guards(b"/v1/nodes")
    assert ARRAYS.guards(b"/v1/arrays") and ARRAYS.guards(b"/v1/arrays/x-y")


def test_model_names_do_not_reach_the_metrics_labels():
    """Every model's inferences share one route label: the labels stay bounded."""
    metrics = HttpMetrics(CollectorRegistry(), frozenset({"/health"}))
    assert metrics.route_of(b"/v2/models/a/infer") == metrics.route_of(b"/v2/models/b/infer?x=1") \
        == "/v2/models/{model}/infer"
    assert metrics.route_of(b"/v2/models/a/versions/7/ready") == "/v2/models/{model}/versions/{version}/ready"
    assert metrics.route_of(b"/v1/run") == "/v1/run" and metrics.route_of(b"/nope") == "other"
