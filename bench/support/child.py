"""
``kcoral`` child processes, for the benchmarks and the tests.

The parts that need no event loop live here once: the command line and the
environment of a child, the lines it writes (kept with their arrival time,
searched from a mark), and the ready lines of the services. L{KCoralChild}
drives a child with a thread and a condition, for the benchmarks and the
chaos run; C{tests/harness.py} drives the same L{OutputLines} from the
reactor, for the integration tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from re import Pattern
from typing import IO, TypeVar

ROOT = Path(__file__).resolve().parents[2]

#: JAX takes most of a GPU's memory when it starts, unless this says "false".
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"

#: The line every kcoral service logs once its port is open.
LISTENING = re.compile(r"kcoral (?P<service>[\w-]+) listening on (?P<url>https?://\S+)")
#: The line a standalone server logs once its device is loaded.
SERVER_READY = re.compile(r"kcoral server ready on (?P<target>\S+)")

#: Seconds between SIGTERM and SIGKILL when a child is stopped.
STOP_GRACE = 15.0

T = TypeVar("T")


class ChildFailed(Exception):
    """The child ended, or stayed silent, while a line was awaited."""


def kcoral_argv(*args: str) -> list[str]:
    """Run the C{kcoral} command of this source tree with this interpreter."""
    return [sys.executable, "-m", "kcoral", *args]


def child_environment(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment, unbuffered, plus C{extra}; a value of
    None removes that variable."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def as_pattern(pattern: str | Pattern[str]) -> Pattern[str]:
    return re.compile(pattern) if isinstance(pattern, str) else pattern


class OutputLines:
    """
    What a child wrote on its output streams, as text lines in arrival
    order, each with its arrival time on C{clock}. Bytes come in per stream
    (L{feed}); a line is complete at its newline, or when the child ends
    (L{flush}).
    """

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic,
                 echo: Callable[[str], object] | None = None, log: IO[str] | None = None):
        self.name = name
        self._clock = clock
        self._echo = echo
        self._log = log
        self.lines: list[str] = []
        self.times: list[float] = []
        self._partial: dict[int, bytes] = {}

    def feed(self, fd: int, data: bytes) -> list[str]:
        """Take C{data} from stream C{fd}; returns the lines it completed."""
        data = self._partial.pop(fd, b"") + data
        *complete, rest = data.split(b"\n")
        if rest:
            self._partial[fd] = rest
        return [self._add(line) for line in complete]

    def flush(self) -> list[str]:
        """The streams have closed: their unfinished lines count as lines."""
        return [self._add(self._partial.pop(fd)) for fd in sorted(self._partial)]

    def _add(self, raw: bytes) -> str:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        now = self._clock()
        self.lines.append(text)
        self.times.append(now)
        if self._echo is not None:
            self._echo(f"[{self.name}] {text}")
        if self._log is not None:
            self._log.write(f"{now:.3f} {text}\n")
        return text

    def first(self, pattern: Pattern[str], since: int = 0) -> tuple[int, re.Match[str]] | None:
        """The index and match of the first line from C{since} on that matches."""
        for index in range(since, len(self.lines)):
            match = pattern.search(self.lines[index])
            if match is not None:
                return index, match
        return None

    def find(self, pattern: str | Pattern[str],
             since: int = 0) -> list[tuple[int, float, re.Match[str]]]:
        """(index, arrival time, match) of each line from C{since} on that matches."""
        pattern = as_pattern(pattern)
        found = ((i, pattern.search(self.lines[i])) for i in range(since, len(self.lines)))
        return [(i, self.times[i], match) for i, match in found if match is not None]

    def matching(self, pattern: str | Pattern[str], since: int = 0) -> list[str]:
        return [match.string for _, _, match in self.find(pattern, since)]

    def tail(self, count: int = 40) -> str:
        lines = self.lines[-count:]
        return "\n".join(f"  [{self.name}] {line}" for line in lines) or f"  [{self.name}] (no output)"


def describe_exit(code: int | None) -> str:
    """A child's exit, from its C{subprocess} return code."""
    if code is None:
        return "running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit status {code}"


class KCoralChild:
    """
    A child process (C{kcoral ARGS} unless C{program} names another script)
    in its own session, so that a Ctrl+C reaches only this process, which
    then stops its children in order. A thread collects its output (stdout
    and stderr together) into L{OutputLines}, also written to C{log} when
    given. C{ready} maps names to regular expressions that must each match a
    line before the constructor returns; their first groups are kept in
    C{found}. C{cores} pins it (``taskset``); C{env} adds to the environment
    (None removes a variable); C{cwd} is where it runs (another version's
    tree, say). C{executable} runs another program than this interpreter
    (with C{program=()}: HAProxy, say).
    """

    def __init__(self, args: Iterable[str], ready: Mapping[str, str | Pattern[str]] | None = None, *,
                 name: str = "kcoral", cores: set[int] | None = None,
                 env: Mapping[str, str | None] | None = None, cwd: str | Path = ROOT,
                 timeout: float = 180.0, program: tuple[str, ...] = ("-m", "kcoral"),
                 log: Path | None = None, echo: bool = False, executable: str = sys.executable):
        self.name = name
        self.command = [executable, *program, *args]
        if cores is not None:
            self.command = ["taskset", "-c", ",".join(map(str, sorted(cores))), *self.command]
        self._log = open(log, "a", buffering=1) if log is not None else None
        printer = (lambda line: print(line, file=sys.stderr, flush=True)) if echo else None
        self.output = OutputLines(name, echo=printer, log=self._log)
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            self.command, cwd=cwd, env=child_environment(env), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()
        self.found: dict[str, str] = {}
        try:
            for key, pattern in (ready or {}).items():
                self.found[key] = self.wait_for(pattern, timeout)[1].group(1)
        except ChildFailed as e:
            self.stop()
            raise ChildFailed(f"{' '.join(self.command)} did not start: {e}") from None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def _read(self) -> None:
        assert self.process.stdout is not None
        stream = self.process.stdout.fileno()
        while data := os.read(stream, 65536):
            with self._changed:
                self.output.feed(1, data)
                self._changed.notify_all()
        self.process.stdout.close()
        self.process.wait()
        with self._changed:
            self.output.flush()
            self._changed.notify_all()
        if self._log is not None:
            self._log.close()

    def mark(self) -> int:
        """The index of the next line, for C{since}."""
        with self._changed:
            return len(self.output.lines)

    def find(self, pattern: str | Pattern[str], since: int = 0) -> list[tuple[float, re.Match[str]]]:
        """(arrival time, match) of each line from C{since} on that matches."""
        return [(t, match) for _, t, match in self.find_indexed(pattern, since)]

    def find_indexed(self, pattern: str | Pattern[str],
                     since: int = 0) -> list[tuple[int, float, re.Match[str]]]:
        """(line index, arrival time, match) of each line from C{since} on that matches."""
        with self._changed:
            return self.output.find(pattern, since)

    def wait_for(self, pattern: str | Pattern[str], timeout: float,
                 since: int = 0) -> tuple[float, re.Match[str]]:
        """
        The arrival time and match of the first line from C{since} on that
        matches C{pattern}, once there is one. Raises L{ChildFailed} after
        C{timeout} seconds, or once the child has ended without one.
        """
        pattern = as_pattern(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = self.output.first(pattern, since)
                if found is not None:
                    index, match = found
                    return self.output.times[index], match
                since = len(self.output.lines)
                if not self._reader.is_alive():
                    raise ChildFailed(f"{self.name} ended ({describe_exit(self.process.returncode)}) "
                                      f"before logging {pattern.pattern!r}\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChildFailed(f"{self.name} did not log {pattern.pattern!r} within "
                                      f"{timeout} s\n{self.tail()}")
                self._changed.wait(left)

    def signal(self, sig: int) -> None:
        """Send C{sig} unless the child has ended."""
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int | None:
        """The exit code once the child ends, or None after C{timeout} seconds."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM, then SIGKILL to its whole session if the child still runs
        after C{grace} seconds; returns its exit code."""
        self.signal(signal.SIGTERM)
        if self.wait(grace) is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = self.process.wait()
        self._reader.join()
        return code

    def fail(self, why: str):
        """Stop, and raise C{why} with the end of the output."""
        self.stop()
        raise ChildFailed(f"{why}:\n{self.tail(60)}")

    def tail(self, count: int = 30) -> str:
        with self._changed:
            return self.output.tail(count)


def until(check: Callable[[], T], what: str, timeout: float = 30.0, interval: float = 0.05) -> T:
    """
    Poll C{check} (other processes and sockets: no event here to wait on)
    until it returns something true, which is returned; fail after
    C{timeout} seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s (last: {value!r})"
        time.sleep(interval)


def start_jax(gpus: str):
    """
    Start JAX in this process for a benchmark of a service run with
    C{--gpus gpus}, and return the device its in-process calls use. With
    'none', on the CPU, here and in the children (they inherit
    C{JAX_PLATFORMS}). Otherwise on the GPU (the one C{gpus} names, if one),
    without taking most of its memory up front as JAX does by default: the
    service under test, started afterwards, needs it.
    """
    if gpus == "none":
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        return jax.devices()[0]
    before = os.environ.get(PREALLOCATE)
    os.environ[PREALLOCATE] = "false"
    try:
        import jax

        device = jax.devices()[int(gpus) if gpus.isdigit() else 0]  # JAX reads it here, once
    finally:
        # The services allocate as they would anywhere.
        if before is None:
            del os.environ[PREALLOCATE]
        else:
            os.environ[PREALLOCATE] = before
    jax.config.update("jax_default_device", device)
    return device


def command_line() -> str:
    """This process's command as it was given, for the results: with
    C{python -m bench.NAME}, that and not the module's file."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["-m", spec.name] if spec is not None else sys.argv[:1]
    return " ".join([Path(sys.executable).name, *program, *sys.argv[1:]])


def write_results(results: object, path: str | None) -> None:
    """C{results} as JSON in the file C{path}, where one is given (--json)."""
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")


def start_py_spy(pid: int, output: str, *options: str) -> subprocess.Popen:
    """py-spy (from this Python's environment) recording C{pid} at 200 Hz
    into C{output}, raw; stopped with L{stop_py_spy}."""
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid),
         "--rate", "200", "--format", "raw", *options, "--output", output],
        stdout=subprocess.DEVNULL)


def stop_py_spy(profiler: subprocess.Popen | None) -> None:
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)  # py-spy writes its file and exits
        profiler.wait(60)
