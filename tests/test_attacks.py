"""
What an operator's slip lets happen to a node, found by attacking its
fronts: two of its listeners given one port.
"""

from __future__ import annotations

import pytest
import pytest_twisted

from tests.harness import kcoral_argv

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("ports", [
    ("--port", "18700", "--grpc-port", "18701"),
    ("--port", "18700", "--base-port", "18702", "--metrics-base-port", "18701"),
    ("--grpc-port", "18700", "--base-port", "18699"),
])
@pytest_twisted.ensureDeferred
async def test_a_node_whose_listeners_share_a_port_stops_at_start(processes, ports):
    """A port two of a node's listeners would take ends the command at start with one line
    naming both, rather than a worker that cannot listen restarted forever."""
    child = processes.spawn(kcoral_argv("server", "--gpus", "none", "--cpu-workers", "2", *ports),
                            name="clash")
    assert await child.exited(60) == 1
    errors = child.matching(r"kcoral: error: ")
    assert len(errors) == 1 and "would both listen on port" in errors[0], child.tail()
    assert child.matching(r"worker\d started") == []
