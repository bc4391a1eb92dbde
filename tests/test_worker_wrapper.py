"""
C{--worker-wrapper "CMD ..."} runs each worker's command line under CMD
(L{kcoral.node.wrapper}), and a supervised process drains when the pipe on
its standard input ends (L{kcoral.cli}): that is how the supervisor stops a
wrapped worker (bubblewrap passes no signal on) and how any worker sees its
supervisor die. On a fake reactor: the command line, the stop by the pipe,
the SIGKILL after the grace, the usage errors at start. For real: a
supervised process whose input pipe ends drains and exits 0, and a node of
two CPU workers under the bubblewrap command that doc/security.rst gives
answers a program through its gateway, each worker confined as it says, and
SIGTERM stops it with status 0 and no process of it left.
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from pathlib import Path

import numpy as np
import pytest
import pytest_twisted

from kcoral import AsyncClient, Program
from kcoral.cli import main
from kcoral.common.serverconfig import ServerConfig
from kcoral.node.config import NodeConfig
from kcoral.node.devices import WorkerSpec
from kcoral.node.restart import RestartSettings
from kcoral.node.supervisor import SupervisorService, worker_argv
from kcoral.node.wrapper import wrapper_argv
from kcoral.options import SettingError
from kcoral.taps.node import NodeOptions
from tests.fakes import FakeOutgoing, ProcessReactor
from tests.harness import LISTENING, START_TIMEOUT, kcoral_argv, until
from tests.httputil import request
from tests.tools import debian_tool

NICE = ("nice", "-n", "5")
SPECS = [WorkerSpec("worker0", 0, None), WorkerSpec("worker1", 1, None)]


def test_a_wrapper_is_split_like_a_shell_and_found_on_path():
    """The wrapper's words, its executable as PATH finds it; none without one."""
    assert wrapper_argv(None) == ()
    found = wrapper_argv("nice -n 5 --")
    assert Path(found[0]).name == "nice" and Path(found[0]).is_absolute()
    assert found[1:] == ("-n", "5", "--")
    assert wrapper_argv("nice 'a b'")[1:] == ("a b",)


@pytest.mark.parametrize("command,error", [
    ("", "names no command"), ("   ", "names no command"), ("nice 'unclosed", "quotation"),
    ("no-such-wrapper-3f9a --", "no-such-wrapper-3f9a is not an executable on PATH")])
def test_a_wrapper_that_cannot_run_is_refused(command, error):
    """A wrapper that names no executable on PATH is refused with the reason."""
    with pytest.raises(ValueError, match=error):
        wrapper_argv(command)


def test_a_wrapper_not_found_is_a_usage_error_at_start(capsys):
    """`kcoral server --worker-wrapper MISSING` exits 2 at once with one line naming it."""
    with pytest.raises(SettingError, match="no-such-wrapper-3f9a"):
        NodeOptions().parseOptions(["--cpu-workers", "2", "--worker-wrapper", "no-such-wrapper-3f9a"])
    assert main(["server", "--cpu-workers", "2", "--worker-wrapper", "no-such-wrapper-3f9a"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kcoral server: error: --worker-wrapper: no-such-wrapper-3f9a is not an executable on PATH"]


def test_the_wrapper_comes_from_the_node_file(tmp_path):
    """The node file's worker_wrapper key is the option's."""
    path = tmp_path / "node.yaml"
    path.write_text("cpu_workers: 2\nworker_wrapper: nice -n 5 --\n")
    options = NodeOptions()
    options.parseOptions(["--config", str(path)])
    assert options.node_config().worker_wrapper == "nice -n 5 --"


def supervised(wrapper: str | None, **restart):
    reactor = ProcessReactor()
    node = NodeConfig(cpu_workers=2, worker_wrapper=wrapper, restart=RestartSettings(**restart))
    supervisor = SupervisorService(node, ServerConfig(port=0, gpus="none"), reactor, SPECS,
                                   [0, 0], "2 CPU worker(s)", outgoing=FakeOutgoing())
    supervisor.privilegedStartService()
    supervisor.startService()
    return supervisor, reactor


def test_each_worker_runs_under_the_wrapper():
    """Each worker's command line is the wrapper's words, then its own."""
    _, reactor = supervised(" ".join(NICE))
    wrapper = wrapper_argv(" ".join(NICE))
    for spec, process in zip(SPECS, reactor.processes, strict=True):
        assert process.executable == wrapper[0]
        assert process.args == [*wrapper, *worker_argv(ServerConfig(port=0, gpus="none"), spec, 0)]


def test_a_wrapped_worker_is_stopped_by_the_end_of_its_input_and_killed_after_the_grace():
    """Stopping a wrapped worker closes its input pipe (no SIGTERM, which would only reach
    the wrapper); one still running after the grace gets SIGKILL, through the wrapper."""
    supervisor, reactor = supervised(" ".join(NICE), startup_grace_seconds=0,
                                     termination_grace_seconds=5)
    supervisor.stopService()
    first, second = reactor.processes
    assert first.stdin_closed and second.stdin_closed
    assert first.signals == second.signals == []
    first.end(status=0)
    reactor.advance_to(60)  # the second never answers its probes
    assert first.signals == [] and second.signals == ["KILL"]


def test_an_unwrapped_worker_is_stopped_with_sigterm():
    """Without a wrapper, SIGTERM, as ever; its input pipe stays open."""
    supervisor, reactor = supervised(None)
    supervisor.stopService()
    assert all(p.signals == ["TERM"] and not p.stdin_closed for p in reactor.processes)


# -- real processes ----------------------------------------------------------------------------

@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_supervised_process_drains_when_its_input_pipe_ends(processes):
    """A process its supervisor started (here a Router, as a front process is) drains and
    exits 0 once the pipe on its standard input ends, as it ends when the supervisor dies."""
    child = processes.spawn(kcoral_argv("router", "--port", "0"), name="supervised",
                            env={"KCORAL_SUPERVISED": "1"})
    await child.wait_for_line(LISTENING, START_TIMEOUT)
    child.transport.closeStdin()
    assert await child.exited(30) == 0, child.tail()
    assert child.matching(r"kcoral router stopped")


def marked(mark: str) -> list[int]:
    """The processes whose environment holds the test's mark."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            variables = environ.read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"KCORAL_TEST_RUN={mark}".encode() in variables:
            found.append(int(environ.parent.name))
    return found


GATEWAY = re.compile(r"kcoral gateway listening on (?P<url>https?://\S+)")


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_node_under_bubblewrap_serves_and_stops_cleanly(processes, tmp_path):
    """
    A node of two CPU workers, each under doc/security.rst's bubblewrap command (its
    compilation cache the one folder it may write), answers a program through its
    gateway, lists the sandbox each worker says it runs in, and on SIGTERM drains and
    exits 0 with no process of it left (wrappers and workers carry the test's mark,
    which passes the environment's allow-list).
    """
    bwrap = debian_tool("bwrap", "bubblewrap")
    cache = tmp_path / "compilation-cache"
    cache.mkdir()
    # The checkout and its virtualenv may lie under /tmp (a CI clone): bound
    # again over the private /tmp, read-only.
    root = Path(__file__).resolve().parent.parent
    wrapper = (f"{bwrap} --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp "
               f"--ro-bind {root} {root} --bind {cache} {cache} --unshare-user --unshare-pid --unshare-ipc "
               "--unshare-uts --cap-drop ALL --new-session --die-with-parent --")
    mark = uuid.uuid4().hex
    node = processes.spawn(kcoral_argv(
        "server", "--port", "0", "--gpus", "none", "--cpu-workers", "2",
        "--health-interval-seconds", "0.5", "--compilation-cache-dir", str(cache),
        "--worker-wrapper", wrapper), name="wrapped-node", env={"KCORAL_TEST_RUN": mark})
    try:
        url = (await node.wait_for_line(GATEWAY, START_TIMEOUT)).group("url")
        for worker in ("worker0", "worker1"):
            await node.wait_for_line(rf"{worker} is ready at ", START_TIMEOUT)

        async def confined():
            workers = (await request("GET", url + "/health", timeout=10)).json["workers"]
            return workers if len(workers) == 2 and all(
                w["healthy"] and w["sandbox"] for w in workers) else None

        for worker in await until(confined, "both workers healthy, with their sandbox", 60):
            assert worker["sandbox"]["mode"] == "auto"

        program = Program.from_function(lambda x: x * 3, np.ones(4, np.float32))
        client = AsyncClient(url)
        try:
            for _ in range(4):
                answer = await client.run(program, np.arange(4, dtype=np.float32))
                np.testing.assert_array_equal(answer, np.arange(4, dtype=np.float32) * 3)
        finally:
            await client.close()
        assert len(marked(mark)) >= 5  # the node, and each worker and its wrapper

        node.signal("TERM")
        assert await node.exited(60) == 0, node.tail(60)
        assert node.matching(r"worker0 stopped \(status 0\)"), node.tail(60)
        assert node.matching(r"worker1 stopped \(status 0\)"), node.tail(60)
        assert marked(mark) == []
    finally:
        await node.stop()
        for pid in marked(mark):  # what a failed test left behind
            os.kill(pid, signal.SIGKILL)
