"""
What KCoral shows Prometheus and Grafana, checked with their own tools
against live services: every C{/metrics} (a Router, a node's gateway, a
worker) passes C{promtool check metrics}, and every metric that
C{deploy/grafana/kcoral.json} queries is one that these services export,
in expressions that Prometheus parses (C{promtool check rules}).
"""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest
import pytest_twisted
import yaml
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.threads import deferToThread

from kcoral import Client, Program
from tests.httputil import request
from tests.test_node_multi import node_args
from tests.test_node_multi import start_node as start_standalone
from tests.test_routed import start_node, start_router, until_ready
from tests.tools import TOP, debian_tool

DASHBOARD = TOP / "deploy" / "grafana" / "kcoral.json"
#: Grafana's variables in the dashboard, as a Prometheus query would see them.
VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", re.MULTILINE)
_METRIC = re.compile(r"\bkcoral_[a-z0-9_]+\b")


def promtool() -> str:
    return debian_tool("promtool", "prometheus")


def check_metrics(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)


def exported_names(text: str) -> set[str]:
    """Every series name a scrape of C{text} gives, whether or not it has samples yet."""
    names = set(_SAMPLE.findall(text))
    for name, kind in _TYPE.findall(text):
        names.add(name)
        if kind == "histogram":
            names.update(f"{name}_{part}" for part in ("bucket", "sum", "count"))
    return names


def panel_queries(dashboard: dict) -> list[str]:
    """The PromQL of every panel of C{dashboard}."""
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def variable_queries(dashboard: dict) -> list[str]:
    """The queries of its variables (Grafana's C{label_values(...)}, not PromQL)."""
    return [variable["query"]["query"] for variable in dashboard["templating"]["list"]
            if variable["type"] == "query"]


def as_prometheus(expression: str) -> str:
    for variable, value in VARIABLES.items():
        expression = expression.replace(variable, value)
    return expression


@pytest_twisted.async_fixture(scope="module")
async def scrapes(module_processes) -> dict[str, str]:
    """The C{/metrics} text of a Router, of a node's gateway and of a worker,
    each after serving a run (so that their histograms have series)."""
    router = await start_router(module_processes)
    routed, gateway = await gatherResults([
        Deferred.fromCoroutine(start_node(module_processes, router.url, "node-a")),
        Deferred.fromCoroutine(start_standalone(module_processes, node_args(), name="gateway"))],
        consumeErrors=True)
    await until_ready(router, "node-a")
    program = Program.from_function(lambda x: x * 2, np.ones(3, np.float32))

    def run(url: str) -> None:
        with Client(url) as client:
            np.testing.assert_array_equal(client.run(program, np.ones(3, np.float32)), [2, 2, 2])

    await gatherResults([deferToThread(run, router.url), deferToThread(run, gateway.url)],
                        consumeErrors=True)
    urls = {"router": router.url, "gateway": gateway.url, "worker": routed.worker_url}
    texts = {}
    for name, url in urls.items():
        answer = await request("GET", url + "/metrics")
        assert answer.code == 200
        texts[name] = answer.body.decode()
    return texts


@pytest.mark.integration
@pytest.mark.parametrize("service", ["router", "gateway", "worker"])
def test_metrics_pass_promtool(scrapes, service):
    """promtool check metrics finds nothing to say about a live service's /metrics."""
    checked = check_metrics(scrapes[service])
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_promtool_speaks_up():
    """The check above can fail: promtool objects to a counter without _total."""
    checked = check_metrics("# HELP kcoral_things Things\n# TYPE kcoral_things counter\nkcoral_things 1\n")
    assert "_total" in checked.stdout + checked.stderr


@pytest.mark.integration
def test_dashboard_queries_exported_metrics(scrapes):
    """Every metric the Grafana dashboard queries is exported by a Router, a gateway or a worker."""
    exported = set().union(*map(exported_names, scrapes.values()))
    dashboard = json.loads(DASHBOARD.read_text())
    queried = [set(_METRIC.findall(query))
               for query in panel_queries(dashboard) + variable_queries(dashboard)]
    assert all(queried), "a query names no KCoral metric"
    missing = set().union(*queried) - exported
    assert not missing, f"the dashboard queries metrics no service exports: {sorted(missing)}"


def test_dashboard_expressions_parse(tmp_path):
    """Prometheus parses every expression of the dashboard (as recording rules, by promtool)."""
    rules = [{"record": f"kcoral:dashboard:{i}", "expr": as_prometheus(expression)}
             for i, expression in enumerate(panel_queries(json.loads(DASHBOARD.read_text())))]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(rules)} rules found" in checked.stdout
