"""
The operators' own tools, run for real by the tests that check what KCoral
ships for them (service files, manifests, metrics): Debian's packages,
installed by the test where missing, as CI starts on a clean machine, and
the ones PyPI ships, from the test extra in this virtualenv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: The repository's top directory.
TOP = Path(__file__).resolve().parent.parent


def debian_tool(command: str, package: str) -> str:
    """The path of C{command}, installing Debian's C{package} if it is missing."""
    found = shutil.which(command)
    if found is None and os.geteuid() == 0:
        environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        # Another apt-get (an unattended upgrade) may hold the lock for a while.
        install = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y",
                   "--no-install-recommends", package]
        if subprocess.run(install, env=environment, capture_output=True).returncode != 0:
            # A fresh machine's package lists may be missing or stale.
            subprocess.run(["apt-get", "update"], env=environment, capture_output=True)
            subprocess.run(install, env=environment, capture_output=True)
        found = shutil.which(command)
    if found is None:
        pytest.fail(f"{command} is missing and Debian's {package} could not be installed")
    return found


def venv_tool(command: str) -> str:
    """The path of C{command} from a package of the test extra, beside this Python."""
    found = Path(sys.executable).parent / command
    if not found.exists():
        pytest.fail(f"{command} is missing: install the test extra (pip install -e '.[test]')")
    return str(found)
