"""
The child-process harness itself (tests/harness.py), on tiny Python children:
line waits, timeouts, exits, and teardown that escalates to SIGKILL.
"""

from __future__ import annotations

import sys

import pytest
import pytest_twisted

from tests.harness import ChildExited, LineTimeout

# Real child processes, their timeouts and signals: as timing-sensitive as
# the kcoral ones.
pytestmark = pytest.mark.integration

SCRIPT = r"""
import signal, sys, time
mode = sys.argv[1]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, lambda *a: print("ignoring TERM", flush=True))
print("hello from stdout", flush=True)
print("and stderr", file=sys.stderr, flush=True)
sys.stdout.write("no newline at the end")
sys.stdout.flush()
if mode == "exit":
    sys.exit(3)
while True:
    time.sleep(0.05)
"""


def python(*args):
    return [sys.executable, "-c", SCRIPT, *args]


@pytest_twisted.ensureDeferred
async def test_lines_from_both_streams(processes):
    """Lines of stdout and stderr, and an unterminated last line, are seen; the exit status is reported."""
    child = processes.spawn(python("exit"), name="child")
    match = await child.wait_for_line(r"hello from (\w+)", 30)
    assert match.group(1) == "stdout"
    await child.wait_for_line("and stderr", 30)
    assert await child.exited(30) == 3
    # The unterminated last line is kept too.
    assert child.output.lines[-1] == "no newline at the end"
    assert child.output.describe_exit() == "exit status 3"
    # A line that already arrived satisfies a later wait at once.
    assert (await child.wait_for_line("hello", 0.01)).group(0) == "hello"


@pytest_twisted.ensureDeferred
async def test_waiting_for_a_line_that_never_comes(processes):
    """A wait for a line that never comes raises LineTimeout with the output's tail; the child runs on."""
    child = processes.spawn(python("run"), name="child")
    await child.wait_for_line("hello", 30)
    with pytest.raises(LineTimeout, match="hello from stdout"):  # the tail is in the message
        await child.wait_for_line("never printed", 0.2)
    assert child.running


@pytest_twisted.ensureDeferred
async def test_waiting_on_a_child_that_exits(processes):
    """A wait for a line from a child that exits without it raises ChildExited."""
    child = processes.spawn(python("exit"), name="child")
    with pytest.raises(ChildExited, match="exit status 3"):
        await child.wait_for_line("never printed", 30)
    with pytest.raises(ChildExited):
        await child.wait_for_line("never printed", 30)


@pytest_twisted.ensureDeferred
async def test_since_skips_earlier_lines(processes):
    """A wait since a mark ignores the lines that came before it."""
    child = processes.spawn(python("exit"), name="child")
    await child.exited(30)
    mark = child.mark()
    with pytest.raises(ChildExited):
        await child.wait_for_line("hello", 30, since=mark)
    assert child.matching("from std") == ["hello from stdout"]


@pytest_twisted.ensureDeferred
async def test_stop_terminates_politely(processes):
    """stop() ends a child that honours SIGTERM with that signal."""
    child = processes.spawn(python("run"), name="child")
    await child.wait_for_line("hello", 30)
    await child.stop(grace=10)
    assert child.output.exit_signal is not None  # ended by SIGTERM's default action
    assert not child.running


@pytest_twisted.ensureDeferred
async def test_stop_escalates_to_kill(processes):
    """stop() kills a child that ignores SIGTERM past the grace; stopping it again does nothing."""
    child = processes.spawn(python("stubborn"), name="child")
    await child.wait_for_line("hello", 30)
    await child.stop(grace=0.5)
    assert child.matching("ignoring TERM")
    assert child.output.exit_signal == 9
    # Stopping an ended child is a no-op.
    await child.stop(grace=0.5)
