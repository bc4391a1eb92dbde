"""
C{.. kcoral-metrics::}: the metric families of each service's C{/metrics},
read from the C{CollectorRegistry} that the service builds, so that the
reference cannot drift from the code.

A Router's, a server's and a node supervisor's services are built in this
process against a L{MemoryReactorClock} and never started: nothing listens,
no child process starts, and a server's device is loaded only on start, so
JAX is not even imported.

A labelled family has no samples until its first observation, so its label
names cannot be read from the registry; the directive's content names them,
one family a line (C{kcoral_http_requests: route, code}). The build fails
(a warning, an error under C{-W}) when a family without samples is not
named there, when a line names a family no service exports, or when it
leaves out a label that the family's samples carry.
"""

from __future__ import annotations

from collections.abc import Iterable

from docutils import nodes
from docutils.statemachine import StringList
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles
from twisted.internet.testing import MemoryReactorClock

from kcoral.node.config import NodeConfig
from kcoral.node.supervisor import SupervisorService
from kcoral.router.service import RouterConfig, RouterService
from kcoral.server.service import ServerConfig, ServerService

logger = logging.getLogger(__name__)

#: What the gateway's table leaves out, said before it.
_GATEWAY = ("The embedded gateway of a node without a Router serves every family of the Router "
            "above (its pool holds the node's workers), these, and each healthy worker's series "
            "with a ``worker`` label:")

#: Labels Prometheus's own exposition adds (histogram buckets).
_EXPOSITION_LABELS = frozenset({"le"})


def registries() -> dict[str, CollectorRegistry]:
    """The registry of each service whose C{/metrics} it serves, built and not started."""
    reactor = MemoryReactorClock()
    # A node without a Router and without workers: the embedded gateway and
    # the supervisor's own counter, which is registered with the gateway's.
    node = SupervisorService(NodeConfig(), ServerConfig(), reactor, [], [], "documentation")
    assert node.gateway is not None
    return {
        "router": RouterService(RouterConfig(), reactor).app.registry,
        "server": ServerService(ServerConfig(gpus="none"), reactor).app.registry,
        "gateway": node.gateway.registry,
    }


def _series(family: Metric) -> str:
    if family.type == "counter":
        return f"``{family.name}_total``"
    if family.type == "histogram":
        return f"``{family.name}_bucket``, ``_sum``, ``_count``"
    return f"``{family.name}``"


def _sample_labels(family: Metric) -> set[str]:
    return {name for sample in family.samples for name in sample.labels} - _EXPOSITION_LABELS


class KCoralMetricsDirective(SphinxDirective):
    has_content = True

    def _declared(self) -> dict[str, list[str]]:
        declared = {}
        for line in self.content:
            if not line.strip():
                continue
            name, _, labels = line.partition(":")
            declared[name.strip()] = [label.strip() for label in labels.split(",") if label.strip()]
        return declared

    def _warn(self, message: str) -> None:
        logger.warning(message, location=self.get_location())

    def _labels(self, family: Metric, declared: dict[str, list[str]]) -> list[str]:
        seen = _sample_labels(family)
        if family.name in declared:
            named = declared[family.name]
            if not seen <= set(named):
                self._warn(f"{family.name} carries the labels {sorted(seen)}; "
                           f"kcoral-metrics names {named}")
            return named
        if not family.samples:
            self._warn(f"{family.name} has no samples before its first observation: "
                       "name its labels in the kcoral-metrics directive")
        return sorted(seen)

    def _table(self, families: Iterable[Metric], declared: dict[str, list[str]]) -> list[str]:
        lines = [".. list-table::", "   :header-rows: 1", "   :widths: 34 10 16 40", "",
                 "   * - Series", "     - Type", "     - Labels", "     - Help"]
        for family in families:
            labels = ", ".join(f"``{label}``" for label in self._labels(family, declared))
            lines += [f"   * - {_series(family)}", f"     - {family.type}",
                      f"     - {labels or '(none)'}", f"     - {family.documentation}"]
        return lines + [""]

    def run(self) -> list:
        declared = self._declared()
        exported = {name: list(registry.collect()) for name, registry in registries().items()}
        every = {family.name for families in exported.values() for family in families}
        for name in sorted(set(declared) - every):
            self._warn(f"kcoral-metrics names {name}, which no service exports")
        router = {family.name for family in exported["router"]}
        lines = ["Router", "~~~~~~", "", "The Router's ``/metrics``:", ""]
        lines += self._table(exported["router"], declared)
        lines += ["Server", "~~~~~~", "",
                  "A standalone server's ``/metrics``, and each worker's of a node:", ""]
        lines += self._table(exported["server"], declared)
        lines += ["Node gateway", "~~~~~~~~~~~~", "", _GATEWAY, ""]
        lines += self._table([f for f in exported["gateway"] if f.name not in router], declared)
        holder = nodes.section()
        holder.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source="<kcoral-metrics>"), holder)
        return holder.children


def setup(app) -> dict:
    app.add_directive("kcoral-metrics", KCoralMetricsDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
