"""
The wheels the GPU check (bench/gpu_check.sh) installs on a machine that
reaches no package index, and the check that they are enough there.

``prepare`` (here, with the network) resolves what KCoral and the
conformance tests need for another Python (3.12 on x86-64 by default), and
downloads as wheels only what that machine does not already have::

    python3 -m bench.gpu_carry prepare                   # into .whl/
    python3 -m bench.gpu_carry prepare --python-version 3.11 --glibc 2.36

It then installs them with no index into a throwaway folder, as the check
will, prints their size, and where this Python is the one they were made for,
runs ``check`` against them. ``check`` (there, before anything else) reads
the requirements that ``prepare`` wrote beside the wheels and follows every
one, with its extras, through the installed distributions; then it imports
what a server and the test suite import::

    PYTHONPATH=/tmp/site:. python3 -m bench.gpu_carry check .whl
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Written beside the wheels: what ``check`` follows on the machine.
REQUIREMENTS = "requirements.txt"
#: What travels with the working tree is bounded as a whole; the tree needs some of it.
LIMIT_MIB = 48
#: The test suite's own needs, beside the project's and its JAX extra's.
TEST_NEEDS = ("pytest", "pytest-twisted", "pytest-timeout", "hypothesis")
#: Distributions the device machine's Python already holds, in versions
#: ``check`` verifies there: a second copy would only shadow them (JAX's
#: numpy, say) and cost room in the carry.
PROVIDED = frozenset("""
    attrs certifi charset-normalizer flatbuffers grpcio hypothesis idna iniconfig jax jaxlib
    markupsafe ml-dtypes numpy opt-einsum packaging pluggy prometheus-client protobuf pygments pytest
    pytest-timeout pyyaml requests safetensors scipy six sortedcontainers tqdm typing-extensions
    urllib3 werkzeug
""".split())
#: What a server, a node and the test suite import, once the requirements hold.
MODULES = ("twisted.internet.ssl", "klein", "treq", "service_identity", "zope.interface", "cachetools",
           "tritonclient.grpc", "pytest_twisted", "kcoral.cli", "kcoral.server", "kcoral.client",
           "cuda.bindings.runtime")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def root_requirements() -> list[str]:
    """The project's dependencies, its JAX and CUDA extras and the tests' own needs, from pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    test = [r for r in extras["test"] if canonical(re.split(r"[\[<>=!~ ;]", r)[0]) in TEST_NEEDS]
    return [*project["dependencies"], *extras["jax"], *extras["cuda"], *test]


def target_options(args) -> list[str]:
    """pip's options for another interpreter: its version, ABIs and the
    manylinux tags its C library accepts (pip matches each tag exactly)."""
    version = args.python_version.replace(".", "")
    major, minor = (int(n) for n in args.glibc.split("."))
    options = ["--only-binary=:all:", "--implementation", "cp", "--python-version", args.python_version]
    for abi in (f"cp{version}", "abi3", "none"):
        options += ["--abi", abi]
    for n in range(minor, 16, -1):
        options += ["--platform", f"manylinux_{major}_{n}_{args.arch}"]
    return [*options, "--platform", f"manylinux2014_{args.arch}", "--platform", f"manylinux1_{args.arch}"]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def resolve(requirements: list[str], options: list[str]) -> list[tuple[str, str]]:
    """The (name, version) of every distribution the requirements need, for the target."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch, "report.json")
        pip("install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report),
            "--target", str(Path(scratch, "site")), *options, *requirements)
        found = json.loads(report.read_text())["install"]
    return [(item["metadata"]["name"], item["metadata"]["version"]) for item in found]


def prepare(args) -> int:
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    # One version of each: two stop the whole install there.
    for old in folder.glob("*.whl"):
        old.unlink()
    requirements = root_requirements()
    (folder / REQUIREMENTS).write_text("".join(f"{r}\n" for r in requirements))
    options = target_options(args)
    carried = [(n, v) for n, v in resolve(requirements, options) if canonical(n) not in PROVIDED]
    print(f"carried for Python {args.python_version} ({args.arch}, glibc {args.glibc}):",
          ", ".join(f"{n} {v}" for n, v in carried))
    pip("download", "--quiet", "--no-deps", "--dest", str(folder), *options,
        *(f"{n}=={v}" for n, v in carried))
    wheels = sorted(folder.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {folder}")
    if size > LIMIT_MIB:
        print(f"over {LIMIT_MIB} MiB: they would not travel with the working tree", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as site:
        # The install the check makes there: no index, nothing resolved.
        pip("install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--target", site,
            *options, *map(str, wheels))
        print("installed with no index into a throwaway folder")
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if here != args.python_version or platform.machine() != args.arch:
            print(f"not checked here: this is Python {here} on {platform.machine()}")
            return 0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, str(ROOT)])}
        return subprocess.run([sys.executable, "-m", "bench.gpu_carry", "check", str(folder)],
                              env=env, cwd=ROOT).returncode


def check(args) -> int:
    """Follow the requirements through what this Python finds on its path."""
    from packaging.requirements import Requirement

    problems = []
    seen = set()
    pending = [(Requirement(line), "kcoral") for line in
               Path(args.dir, REQUIREMENTS).read_text().splitlines() if line.strip()]
    while pending:
        requirement, by = pending.pop()
        key = (canonical(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{requirement} (for {by}): missing")
            continue
        if not requirement.specifier.contains(distribution.version, prereleases=True):
            problems.append(f"{requirement} (for {by}): {distribution.version} found")
            continue
        for line in distribution.requires or ():
            needed = Requirement(line)
            # Markers name the extras a line belongs to; "" stands for none asked.
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra})
                                            for extra in ("", *requirement.extras)):
                pending.append((needed, requirement.name))
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:
            problems.append(f"import {name}: {type(e).__name__}: {e}")
    for problem in problems:
        print("not satisfied:", problem)
    print(f"{len(seen)} requirements followed, {len(MODULES)} modules imported, {len(problems)} problem(s)")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("prepare", help="download the wheels and check them")
    made.add_argument("--dir", default=str(ROOT / ".whl"), help="where the wheels go (default: .whl)")
    made.add_argument("--python-version", default="3.12", help="the target's Python (default: 3.12)")
    made.add_argument("--arch", default="x86_64", help="the target's processor (default: x86_64)")
    made.add_argument("--glibc", default="2.39", help="the target's C library (default: 2.39)")
    checked = commands.add_parser("check", help="check what this Python finds against the requirements")
    checked.add_argument("dir", help="the folder prepare filled")
    args = parser.parse_args()
    return prepare(args) if args.command == "prepare" else check(args)


if __name__ == "__main__":
    sys.exit(main())
