"""
C{kcoral status}'s table, in process: its columns, its colours on a
terminal and none elsewhere. The command against a real Router is in
L{tests.test_routed}.
"""

from __future__ import annotations

import io

from kcoral.status import format_status, use_colour

HEALTH = {"status": "ok", "capacity": 4, "active": 1, "queued": 0}
NODES = [
    {"node_id": "node-a", "state": "ready", "gpu_target": "cpu", "capacity": 2, "active": 1,
     "last_report_age_seconds": 0.4},
    {"node_id": "node-bb", "state": "unhealthy", "gpu_target": "cpu", "capacity": 2, "active": 0,
     "last_report_age_seconds": None},
]


def test_plain_table_has_a_row_per_node_and_a_summary():
    """Without colour: a header, one aligned row per node, a blank line, the Router's summary."""
    lines = format_status(HEALTH, NODES).splitlines()
    assert lines[0].split() == ["NODE", "STATE", "TARGET", "CAPACITY", "ACTIVE", "LAST", "REPORT"]
    assert lines[1].split() == ["node-a", "ready", "cpu", "2", "1", "0.4s", "ago"]
    assert lines[2].split() == ["node-bb", "unhealthy", "cpu", "2", "0", "-"]
    assert lines[1].index("ready") == lines[2].index("unhealthy") == lines[0].index("STATE")
    assert lines[3:] == ["", "router ok: capacity 4, active 1, queued 0"]
    assert "\x1b" not in format_status(HEALTH, NODES)


def test_colour_marks_states_and_keeps_the_columns():
    """With colour: ready and ok in green, unhealthy in red, and the columns as wide as without."""
    coloured = format_status(HEALTH, NODES, colour=True)
    assert "\x1b[32mready    \x1b[0m" in coloured
    assert "\x1b[31munhealthy\x1b[0m" in coloured
    assert "router \x1b[32mok\x1b[0m: capacity 4" in coloured
    plain = [line.replace("\x1b[32m", "").replace("\x1b[31m", "").replace("\x1b[0m", "")
             for line in coloured.splitlines()]
    assert plain == format_status(HEALTH, NODES).splitlines()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_without_no_color(monkeypatch):
    """Colour is used on a terminal, not on a pipe or a file, and never with NO_COLOR set."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_colour(_Terminal()) and not use_colour(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_colour(_Terminal())
