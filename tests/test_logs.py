"""
Logs as JSON lines (C{--log-format json}): the encoding of one event, a
worker's lines as its supervisor relays them, the option on every service
and under twistd; then a Router under C{twistd -n} and a node, real
processes, whose every output line is a JSON object carrying the run's
C{request_id}, the node's C{node_id} and the C{worker}, and whose spans
(C{--tracing console}) show the client's trace carried Router -> worker.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import pytest_twisted
from twisted.logger import Logger, LogLevel, eventFromJSON, formatEvent, globalLogPublisher
from twisted.python import usage

from kcoral import logs
from kcoral.logs import log_observer
from kcoral.node.devices import WorkerSpec
from kcoral.node.supervisor import worker_argv
from kcoral.protocol.wire import REQUEST_CONTENT_TYPE
from kcoral.taps import node as node_tap
from kcoral.taps import router as router_tap
from tests.conftest import server_args, server_env
from tests.harness import START_TIMEOUT, RunningService, kcoral_argv, until
from tests.httputil import request
from tests.test_routed import FAST_NODE, FAST_ROUTER, quick_program, twistd_argv, until_ready
from tests.test_server import run_frame
from tests.test_worker import Supervised

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def published():
    """Every event published while the test runs."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


def test_an_event_is_one_line_of_json_with_its_fields():
    """A JSON line holds the event's own fields, its text and level, and the process's node_id."""
    stream = io.StringIO()
    observer = log_observer(stream, log_format="json", node_id="node-a")
    Logger(namespace="kcoral.test", observer=observer).info(
        "{request_id} ran on {worker}", request_id="r-1", worker="worker0")
    line, = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["request_id"] == "r-1" and record["worker"] == "worker0"
    assert record["node_id"] == "node-a" and record["level"] == "info"
    assert record["message"] == "r-1 ran on worker0"
    assert record["log_namespace"] == "kcoral.test"
    # twisted.logger reads it back as the event it was.
    assert formatEvent(eventFromJSON(line)) == "r-1 ran on worker0"


def test_a_failure_is_one_line_with_its_traceback():
    """An event with a traceback stays one JSON line; its message holds the traceback."""
    stream = io.StringIO()
    log = Logger(namespace="kcoral.test", observer=log_observer(stream, log_format="json"))
    try:
        raise ZeroDivisionError("no capacity")
    except ZeroDivisionError:
        log.failure("{request_id} internal error", request_id="r-2")
    line, = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["request_id"] == "r-2" and "node_id" not in record
    assert "ZeroDivisionError" in record["message"] and record["level"] == "critical"


def test_a_line_break_a_client_chose_stays_in_its_events_line():
    """A text line's message holding CR or LF (a name a client chose) is one
    line, its breaks escaped; a failure's traceback still follows it."""
    stream = io.StringIO()
    log = Logger(namespace="kcoral.test", observer=log_observer(stream))
    log.info("{request_id} answered 400: {message}", request_id="r-4",
             message="no model 'x\nERROR [kcoral.forged] mine\r'")
    line, = stream.getvalue().splitlines()
    assert line.endswith("info  [kcoral.test] r-4 answered 400: no model 'x\\nERROR [kcoral.forged] mine\\r'")
    try:
        raise ZeroDivisionError("no capacity")
    except ZeroDivisionError:
        log.failure("{request_id} internal error\n", request_id="r-5")
    lines = stream.getvalue().splitlines()[1:]
    assert lines[0].endswith("[kcoral.test] r-5 internal error\\n")
    assert lines[1].startswith("Traceback") and "ZeroDivisionError: no capacity" in lines[-1]


def test_text_stays_the_default():
    """Without --log-format, lines are text, as before."""
    stream = io.StringIO()
    Logger(namespace="kcoral.test", observer=log_observer(stream)).info("hello {who}", who="you")
    assert re.fullmatch(r"\S+ info  \[kcoral.test\] hello you\n", stream.getvalue())


def test_a_worker_s_json_line_is_relayed_as_its_event_with_the_worker(published):
    """The supervisor re-publishes a worker's JSON event as it was logged, adding the worker's name."""
    s = Supervised()
    s.worker.startService()
    stream = io.StringIO()
    Logger(namespace="kcoral.server.app", observer=log_observer(stream, log_format="json")).warn(
        "{request_id} answered {status}", request_id="r-3", status=422)
    s.process.write_to(1, stream.getvalue().encode())
    relayed = [e for e in published if e.get("request_id") == "r-3"]
    assert len(relayed) == 1
    event = relayed[0]
    assert event["worker"] == "worker0" and event["log_namespace"] == "kcoral.server.app"
    assert event["log_level"] == LogLevel.warn and formatEvent(event) == "r-3 answered 422"


def test_a_worker_s_other_lines_are_relayed_as_text_events(published):
    """A line that is no JSON event (text a library printed) is relayed as text, with the worker."""
    s = Supervised()
    s.worker.startService()
    s.process.write_to(2, b'{"not": "an event"}\nW0000 some warning\n')
    lines = [e["line"] for e in published if e.get("worker") == "worker0" and "line" in e]
    assert lines == ['{"not": "an event"}', "W0000 some warning"]
    stream = io.StringIO()
    observer = log_observer(stream, log_format="json")
    for event in published:
        observer(event)
    assert all(json.loads(line) for line in stream.getvalue().splitlines())


@pytest.mark.parametrize("tap", [router_tap, node_tap])
def test_every_service_takes_the_log_format_and_tracing_options(tap):
    """Router and node options: text and none by default, checked values, named in errors."""
    options = tap.Options()
    options.parseOptions([])
    assert (options["log-format"], options["tracing"]) == ("text", "none")
    options = tap.Options()
    options.parseOptions(["--log-format", "json", "--tracing", "console"])
    assert (options["log-format"], options["tracing"]) == ("json", "console")
    with pytest.raises(usage.UsageError, match="--log-format: must be one of text, json"):
        tap.Options().parseOptions(["--log-format", "xml"])
    with pytest.raises(usage.UsageError, match="--tracing"):
        tap.Options().parseOptions(["--tracing", "zipkin"])


def test_workers_log_and_trace_as_their_node():
    """A node passes its --log-format and --tracing on to the workers it starts."""
    options = node_tap.Options()
    options.parseOptions(["--router", "http://r:9000", "--node-id", "n",
                          "--log-format", "json", "--tracing", "otlp"])
    argv = worker_argv(options.server_config(), WorkerSpec("worker0", 0, None), 8000)
    assert argv[argv.index("--log-format") + 1] == "json"
    assert argv[argv.index("--tracing") + 1] == "otlp"


def _twistd(*args: str):
    from twisted.scripts.twistd import ServerOptions

    options = ServerOptions()
    options.parseOptions(list(args))
    return options


def test_under_twistd_json_becomes_twistd_s_logger(monkeypatch):
    """twistd's --logger is the JSON observer with --log-format json, writing where twistd would."""
    assert _twistd("-n", "kcoral-router")["logger"] is None
    options = _twistd("-n", "kcoral-node", "--log-format", "json", "--node-id", "n1",
                      "--router", "http://r:9000")
    assert options["logger"] is logs.twistd_json_observer
    stdout = io.StringIO()
    monkeypatch.setattr("sys.stdout", stdout)
    observer = options["logger"]()
    Logger(namespace="kcoral.test", observer=observer).info("up")
    record = json.loads(stdout.getvalue())
    assert record["message"] == "up" and record["node_id"] == "n1"


def test_under_twistd_an_explicit_logger_wins():
    """A --logger given to twistd is kept, whatever the plugin's --log-format."""
    options = _twistd("--logger", "twisted.logger.textFileLogObserver", "-n", "kcoral-router",
                      "--log-format", "json")
    assert options["logger"].__name__ == "textFileLogObserver"


# -- real processes --------------------------------------------------------------------------

def _records(child) -> list[dict]:
    """Every output line of C{child}, each parsed as JSON (a line that is not fails the test)."""
    records = []
    for line in child.output.lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{child.name} wrote a line that is not JSON: {line!r}")
    return records


def _spans(records, name):
    return [r for r in records if r.get("span") == name]


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_json_logs_and_a_trace_across_router_and_node(processes):
    """A twistd Router and a node write only JSON lines, with request_id, node_id, worker, and one trace."""
    observing = ("--log-format", "json", "--tracing", "console")
    router = processes.spawn(twistd_argv("-n", "--pidfile=", "kcoral-router", "--port", "0",
                                         *FAST_ROUTER, *observing), name="router")
    url = (await router.wait_for_line(r'"message": "kcoral router listening on (?P<url>[^"]+)"',
                                      START_TIMEOUT)).group("url")
    node = processes.spawn(kcoral_argv(*server_args("--router", url, "--node-id", "node-j",
                                                    *FAST_NODE, *observing)),
                           name="node-j", env=server_env())
    await node.wait_for_line(r'"message": "worker0 is ready at', START_TIMEOUT)
    await until_ready(RunningService(router, url, 0), "node-j")

    program = quick_program()
    answer = await request("POST", url + "/v1/run", body=run_frame(program, [np.float32(1)]),
                           headers={"Content-Type": REQUEST_CONTENT_TYPE,
                                    "X-Request-ID": "json-1",
                                    "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    assert answer.code == 200, answer
    await until(lambda: _spans(_records(node), "kcoral.server.run"), "the worker's run span")
    await until(lambda: _spans(_records(router), "kcoral.router.run"), "the Router's run span")
    await processes.stop_all()

    routed, served = _records(router), _records(node)
    assert all("node_id" in r and r["node_id"] == "node-j" for r in served)
    compiled = [r for r in served if "compiled program" in r["message"]]
    assert compiled and compiled[0]["request_id"] == "json-1" and compiled[0]["worker"] == "worker0"
    # The Router's span is the client's span's child; the worker's run, its forward's.
    run, = _spans(routed, "kcoral.router.run")
    forward, = _spans(routed, "kcoral.forward")
    assert run["trace_id"] == TRACE_ID and run["parent_id"] == CLIENT_SPAN
    assert forward["parent_id"] == run["span_id"]
    worker_run, = _spans(served, "kcoral.server.run")
    assert worker_run["trace_id"] == TRACE_ID and worker_run["parent_id"] == forward["span_id"]
    assert worker_run["request_id"] == "json-1" and worker_run["worker"] == "worker0"
    inside = {r["span"] for r in served if r.get("parent_id") == worker_run["span_id"]}
    assert inside == {"kcoral.queue_wait", "kcoral.compile", "kcoral.execute"}
