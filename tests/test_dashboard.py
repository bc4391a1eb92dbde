"""
The dashboard: its ring of samples on a fake clock, its files and JSON from
the Router's resource in process, and the page itself in a real headless
Chromium (Debian's C{chromium}, installed by the test where it is missing)
against a real Router and node: the node appears, is stopped, and its new
state shows. That test saves its screenshot as C{dashboard.png} in
C{KCORAL_SCREENSHOT_DIR} (the documentation's is made with
C{KCORAL_SCREENSHOT_DIR=doc/_static}), or in the test's temporary folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry, Counter, Gauge
from treq.testing import StubTreq
from twisted.internet.defer import gatherResults
from twisted.internet.task import Clock

from kcoral import AsyncClient
from kcoral.dashboard.history import History, Sample, Totals, quantile
from kcoral.metrics import HttpMetrics
from kcoral.node.gateway import Gateway
from kcoral.router.service import ROUTES, RouterConfig
from tests.fakes import node_report
from tests.harness import until
from tests.httputil import request
from tests.test_routed import pool_nodes, quick_program, start_node, start_router, until_ready
from tests.test_router_app import RID, Router, assert_error
from tests.test_worker import URL as WORKER_URL
from tests.test_worker import Supervised
from tests.tools import debian_tool

# -- the ring of samples ------------------------------------------------------------------------


class Traffic:
    """A registry with the series a Router's history reads, and a History of it on a fake clock."""

    def __init__(self, interval=2.0, window=10.0):
        self.clock = Clock()
        self.registry = CollectorRegistry()
        self.http = HttpMetrics(self.registry, ROUTES)
        self.placements = Counter("kcoral_placements", "Runs placed", ["cache"], registry=self.registry)
        self.queued = Gauge("kcoral_queued_requests", "Waiting", registry=self.registry)
        self.history = History(self.registry, self.clock, interval=interval, window=window)

    def runs(self, *seconds: float) -> None:
        for duration in seconds:
            self.http.observe(b"/v1/run", 200, duration)


def test_quantile_interpolates_within_its_bucket():
    """Quantiles of cumulative buckets are interpolated linearly, as Prometheus's histogram_quantile."""
    buckets = [(0.1, 50.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.25, buckets) == pytest.approx(0.05)
    assert quantile(0.75, buckets) == pytest.approx(0.55)


def test_quantile_of_nothing_and_of_the_unbounded_bucket():
    """An empty histogram has no quantile; one in the +Inf bucket is the largest finite bound."""
    assert quantile(0.5, []) is None
    assert quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0


def test_history_samples_what_changed_each_interval():
    """Each sample holds the run rate, latency quantiles, queue depth and cache hits since the last."""
    traffic = Traffic()
    traffic.history.startService()
    assert list(traffic.history.samples) == []  # the first reading is only a baseline
    traffic.runs(*[0.003] * 9, 2.0)
    traffic.http.observe(b"/health", 200, 0.001)
    traffic.placements.labels("hit").inc(3)
    traffic.placements.labels("miss").inc(1)
    traffic.queued.set(4)
    traffic.clock.advance(2)
    [sample] = traffic.history.samples
    assert sample.time == 2.0
    assert sample.rate == pytest.approx(5.0)  # 10 runs over 2 s; /health does not count
    assert 0.0025 < sample.p50 <= 0.005
    assert 1.0 < sample.p99 <= 2.5
    assert sample.queued == 4
    assert sample.cache_hits == pytest.approx(1.5) and sample.cache_hit_ratio == pytest.approx(0.75)


def test_history_quiet_interval_has_no_latency():
    """An interval without runs has rate 0 and no latency or hit ratio, not the last interval's."""
    traffic = Traffic()
    traffic.history.startService()
    traffic.runs(0.01)
    traffic.clock.advance(2)
    traffic.clock.advance(2)
    busy, quiet = traffic.history.samples
    assert busy.rate == pytest.approx(0.5) and busy.p50 is not None
    assert quiet.rate == 0 and quiet.p50 is None and quiet.p99 is None
    assert quiet.cache_hit_ratio is None
    assert quiet.to_json()["p50"] is None


def test_history_keeps_its_window_only():
    """The ring holds window / interval samples, the oldest dropped first."""
    traffic = Traffic(interval=2.0, window=10.0)
    traffic.history.startService()
    traffic.clock.pump([2.0] * 8)
    assert [s.time for s in traffic.history.samples] == [8.0, 10.0, 12.0, 14.0, 16.0]


def test_history_stops_with_its_service():
    """A stopped history takes no more samples."""
    traffic = Traffic()
    traffic.history.startService()
    traffic.clock.advance(2)
    traffic.history.stopService()
    traffic.clock.advance(10)
    assert len(traffic.history.samples) == 1
    assert not traffic.clock.getDelayedCalls()


def test_sample_json_is_rounded_and_complete():
    """A sample's JSON has every field the page plots, rounded for the wire."""
    before = Totals(0.0)
    after = Totals(2.0, runs=1.0, buckets=((0.001, 0.0), (0.0025, 1.0), (float("inf"), 1.0)),
                   queued=1.0, active=2.0)
    assert Sample.between(before, after).to_json() == {
        "time": 2.0, "rate": 0.5, "p50": 0.00175, "p99": 0.002485, "queued": 1.0, "active": 2.0,
        "cache_hits": 0.0, "cache_hit_ratio": None}


# -- the page and its JSON, in process -------------------------------------------------------------

POLICY = re.compile(r"default-src 'none'.*connect-src 'self'")


@pytest.mark.parametrize(("path", "kind"), [
    ("/", b"text/html; charset=utf-8"),
    ("/dashboard/dashboard.js", b"text/javascript; charset=utf-8"),
    ("/dashboard/dashboard.css", b"text/css; charset=utf-8"),
])
def test_dashboard_files_are_served_with_their_type_and_policy(path, kind):
    """The page and its assets come with their content type and a policy that forbids outside loads."""
    response, content = Router().request("GET", path)
    assert response.code == 200 and content
    assert response.headers.getRawHeaders(b"Content-Type") == [kind]
    [policy] = response.headers.getRawHeaders(b"Content-Security-Policy")
    assert POLICY.search(policy.decode())
    assert response.headers.getRawHeaders(b"X-Content-Type-Options") == [b"nosniff"]


def test_page_loads_nothing_from_elsewhere():
    """Every URL the page names is relative to the service that serves it."""
    _, content = Router().request("GET", "/")
    urls = re.findall(rb'(?:src|href)="([^"]+)"', content)
    assert urls and all(not re.match(rb"[a-z]+:|//", url) for url in urls), urls


def test_unknown_dashboard_file_is_a_json_404():
    """A file the dashboard does not have is a JSON 404 with the request id."""
    response, body = Router().json("GET", "/dashboard/../setup.py")
    assert_error(response, body, 404, "not_found")
    response, body = Router().json("GET", "/dashboard/secret.txt")
    assert_error(response, body, 404, "not_found")


def test_dashboard_json_is_health_and_history():
    """/v1/dashboard answers 200 with what /health shows and the history's samples."""
    router = Router()
    router.ready()
    router.app.history.startService()
    router.clock.advance(router.app.history.interval)
    response, body = router.json("GET", "/v1/dashboard")
    assert response.code == 200
    _, health = router.json("GET", "/health")
    assert body["health"] == health
    assert body["history"]["interval_seconds"] == router.app.history.interval
    [sample] = body["history"]["samples"]
    assert set(sample) >= {"time", "rate", "p50", "p99", "queued", "cache_hits"}


def test_dashboard_json_with_no_node_is_still_200():
    """An empty pool's dashboard is an answer to show, not an error (/health says 503)."""
    router = Router()
    response, body = router.json("GET", "/v1/dashboard")
    assert response.code == 200 and body["health"]["status"] == "unavailable"
    assert response.headers.getRawHeaders(RID)


def test_gateway_serves_the_dashboard_and_runs_its_history():
    """A node's gateway serves the same page, and its history is one of its services."""
    gateway = Gateway(RouterConfig(port=0), Clock())
    assert gateway.app.history in list(gateway)
    treq = StubTreq(gateway.app.resource())
    answers: list = []
    treq.get("http://gateway.test/").addCallback(answers.append)
    treq.flush()
    [response] = answers
    assert response.code == 200
    assert response.headers.getRawHeaders(b"Content-Type") == [b"text/html; charset=utf-8"]


# -- the page in a browser --------------------------------------------------------------------

#: A browser that talks to nothing but the page under test, and keeps nothing between runs
#: (each run gets a fresh --user-data-dir).
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1280,900",
                  # The page's first rounds of fetches run in virtual time, then the run ends.
                  "--virtual-time-budget=4000")


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's Chromium, installed with apt-get where it is missing (as CI's clean machine)."""
    return debian_tool("chromium", "chromium")


class Browser:
    """Runs of a headless Chromium, each a child of the test's process group."""

    def __init__(self, executable: str, processes, profiles: Path):
        self._executable = executable
        self._processes = processes
        self._profiles = profiles
        self._runs = 0

    async def _run(self, url: str, *args: str) -> list[str]:
        self._runs += 1
        profile = self._profiles / f"profile{self._runs}"
        child = self._processes.spawn(
            [self._executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
            name=f"chromium{self._runs}")
        code = await child.exited(timeout=120)
        assert code == 0, child.tail()
        return child.output.lines

    async def dom(self, url: str) -> str:
        """The page at C{url} as rendered, serialised (on its standard output)."""
        return "\n".join(await self._run(url, "--dump-dom"))

    async def screenshot(self, url: str, path: Path) -> None:
        await self._run(url, f"--screenshot={path}")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"no PNG at {path}"


def node_row(dom: str, node_id: str) -> str:
    """The state of C{node_id} in the rendered table."""
    match = re.search(rf'<tr class="node" data-node="{re.escape(node_id)}" data-state="(\w+)"', dom)
    assert match, f"no row for {node_id} in the page:\n{dom[:3000]}"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_dashboard_in_chromium_shows_a_node_come_and_go(processes, chromium, tmp_path):
    """In Chromium the Router's page lists a ready node and its worker, plots runs, shows the node gone."""
    browser = Browser(chromium, processes, tmp_path)
    router = await start_router(processes)
    node = await start_node(processes, router.url, "dash-node")
    await until_ready(router, "dash-node")

    # Runs until the history holds a few samples of them, so that the plots have lines.
    client = AsyncClient(router.url, busy_timeout=30)
    program = quick_program()

    async def plotted():
        await gatherResults([client.run(program, np.float32(i)) for i in range(4)], consumeErrors=True)
        answer = await request("GET", router.url + "/v1/dashboard", timeout=10)
        return sum(s["rate"] > 0 for s in answer.json["history"]["samples"]) >= 4

    try:
        await until(plotted, "four samples with runs", timeout=90)
    finally:
        await client.close()

    page = router.url + "/"
    dom = await browser.dom(page)
    assert 'data-loaded="yes"' in dom
    assert node_row(dom, "dash-node") == "ready"
    assert re.search(r'<tr class="worker" data-worker="worker0" data-state="healthy"', dom)
    assert re.search(r'data-plot="rate">.*?<path d="M[^"]+L', dom), "the rate plot has no line"
    shots = Path(os.environ.get("KCORAL_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    await browser.screenshot(page, shots / "dashboard.png")

    await node.process.stop()

    async def gone():
        return (await pool_nodes(router))["dash-node"]["state"] == "gone"

    await until(gone, "the node gone from the pool")
    assert node_row(await browser.dom(page), "dash-node") == "gone"


# -- restarts, from the worker to the node list ---------------------------------------------------

def test_a_worker_report_counts_its_restarts():
    """A worker's report says how many times its supervisor has restarted it."""
    s = Supervised(restart_max_delay_seconds=1)
    s.worker.startService()
    assert s.worker.report(WORKER_URL).restarts == 0
    for _ in range(2):
        s.process.end(signal=9)
        s.reactor.advance(1)
    assert s.worker.report(WORKER_URL).restarts == 2 == s.restart_count()


def test_node_list_gives_each_workers_restarts():
    """/v1/nodes lists the restarts each worker's node reported, 0 where a report has none."""
    router = Router()
    report = node_report(capacities=(2, 2))
    report["workers"][1]["restarts"] = 3
    router.ready(report=report)
    _, body = router.json("GET", "/v1/nodes")
    assert [w["restarts"] for w in body["nodes"][0]["workers"]] == [0, 3]
    report["workers"][1]["restarts"] = -1
    response, body = router.put("gpu-a", report)
    assert_error(response, body, 400)
