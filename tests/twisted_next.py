"""
The newest Twisted release on the package index, laid over this virtualenv
without changing it, for ``make test-twisted-next``: pyproject.toml pins
Twisted to the releases the web tests passed on, and a newer one is tried
here before the pin is raised.

``python -m tests.twisted_next DIRECTORY`` empties C{DIRECTORY} and installs
into it the newest C{twisted[tls]} and, of what that release requires, only
what this virtualenv does not already meet: pip resolves it as it would an
upgrade of Twisted alone here, the project's pin aside. With C{DIRECTORY}
first on C{PYTHONPATH}, this Python imports that Twisted and everything else
from the virtualenv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def pip(*arguments: str) -> None:
    """Run this Python's pip, failing where it fails."""
    subprocess.run([sys.executable, "-m", "pip", *arguments], check=True)


def upgrade(requirement: str) -> list[str]:
    """What pip would install here to upgrade to the newest C{requirement}
    (C{name==version} each), installing nothing: only the requirement's
    own requirements are weighed, not those of what is installed."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        pip("install", "--quiet", "--dry-run", "--upgrade", "--report", str(report), requirement)
        chosen = json.loads(report.read_text())["install"]
    return [f"{each['metadata']['name']}=={each['metadata']['version']}" for each in chosen]


def lay_over(directory: Path, requirement: str) -> None:
    """Install into C{directory}, emptied first, what L{upgrade} finds."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    wanted = upgrade(requirement)
    if wanted:
        pip("install", "--quiet", "--no-deps", "--target", str(directory), *wanted)
    print("laid over the virtualenv:", " ".join(wanted) or "nothing (it has the newest already)")


if __name__ == "__main__":
    lay_over(Path(sys.argv[1]), "twisted[tls]")
