"""
The systemd units of C{contrib/systemd}, checked by systemd's own
C{systemd-analyze verify}, and their stop timeouts against the drains they
must wait for.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kcoral.common.serverconfig import ServerConfig
from kcoral.router.service import RouterConfig
from tests.tools import TOP, debian_tool

UNITS = TOP / "contrib" / "systemd"
#: Where the units expect KCoral, as installed by the deployment guide.
INSTALLED = "/opt/kcoral/.venv/bin/kcoral"


def installed_here(unit: Path, directory: Path, name: str | None = None) -> Path:
    """A copy of C{unit} in C{directory} that runs this checkout's C{kcoral}:
    verify checks that the command exists."""
    text = unit.read_text()
    assert INSTALLED in text
    copy = directory / (name or unit.name)
    copy.write_text(text.replace(INSTALLED, str(Path(sys.executable).parent / "kcoral")))
    return copy


def verify(*units: Path) -> subprocess.CompletedProcess:
    analyze = debian_tool("systemd-analyze", "systemd")
    return subprocess.run([analyze, "verify", *map(str, units)], capture_output=True, text=True,
                          cwd=units[0].parent)


@pytest.mark.parametrize("unit, name", [("kcoral-router.service", None),
                                        ("kcoral-node@.service", None),
                                        ("kcoral-node@.service", "kcoral-node@gpu-a.service")])
def test_units_verify(tmp_path, unit, name):
    """systemd-analyze verify accepts each unit (and an instance of the node's) without a word."""
    checked = verify(installed_here(UNITS / unit, tmp_path, name))
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_verify_speaks_up(tmp_path):
    """The check above can fail: verify reports an unknown setting of a unit."""
    unit = installed_here(UNITS / "kcoral-router.service", tmp_path)
    unit.write_text(unit.read_text().replace("[Service]", "[Service]\nTimeoutStopSeconds=1"))
    assert "TimeoutStopSeconds" in verify(unit).stderr


def stop_timeout(unit: str) -> float:
    match = re.search(r"^TimeoutStopSec=(\d+)min$", (UNITS / unit).read_text(), re.MULTILINE)
    assert match is not None, f"{unit} has no TimeoutStopSec in minutes"
    return int(match.group(1)) * 60


def test_stop_timeouts_outlast_the_drains():
    """Each unit waits longer to stop than a queued run may wait, by default, before it runs."""
    assert stop_timeout("kcoral-router.service") > RouterConfig().queue_wait_timeout_seconds
    assert stop_timeout("kcoral-node@.service") > ServerConfig().queue_wait_timeout_seconds


def test_node_instance_is_its_node_id():
    """The node unit's instance name is the node id the supervisor runs with."""
    assert "--node-id %i" in (UNITS / "kcoral-node@.service").read_text()
