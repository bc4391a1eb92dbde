"""
The C{kcoral} command: C{router} and C{server} run the same services as the
twistd plugins, with the same options; C{status} and C{health} are for
operators.

Unlike stock C{twistd}, which re-raises SIGTERM after shutting down, C{kcoral}
drains on SIGTERM or Ctrl+C and exits with status 0.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from twisted.internet import fdesc
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IReadDescriptor
from twisted.python import usage
from zope.interface import implementer

from kcoral import status
from kcoral._version import __version__
from kcoral.logs import CHILD_ENV
from kcoral.options import SettingError
from kcoral.taps import node as node_tap
from kcoral.taps import router as router_tap


class CommandOptions(usage.Options):
    synopsis = "kcoral <command> [options]"
    longdesc = "Run JAX programs on a pool of GPU machines through one stable address."
    subCommands = [
        ["router", None, router_tap.RouterOptions, "Run a Router."],
        ["server", None, node_tap.NodeOptions, "Run a server, or with --router a node."],
        ["status", None, status.StatusOptions, "Print a Router's pool and queue."],
        ["health", None, status.HealthOptions, "Print one service's /health."],
    ]

    def opt_version(self):
        """Print the version and exit."""
        print(f"kcoral {__version__}")
        sys.exit(0)

    def postOptions(self):
        if self.subCommand is None:
            raise usage.UsageError("a command is required: router, server, status or health")


def run_service(tap, options) -> int:
    from twisted.internet import reactor

    from kcoral.logs import start_console_logging

    start_console_logging(log_format=options["log-format"], node_id=options.get("node-id"))
    try:
        svc = tap.makeService(options, reactor)
        svc.privilegedStartService()
    except CannotListenError as e:
        print(f"kcoral: error: cannot listen on {e.interface or '*'}:{e.port}: {e.socketError}",
              file=sys.stderr)
        return 1
    except (usage.UsageError, ValueError, OSError) as e:
        print(f"kcoral: error: {e}", file=sys.stderr)
        return 1
    reactor.callWhenRunning(svc.startService)
    reactor.callWhenRunning(_stop_once_on_signals, reactor)
    reactor.addSystemEventTrigger("before", "shutdown", svc.stopService)
    reactor.run()
    return getattr(svc, "exit_status", 0)


def _stop_once_on_signals(reactor) -> None:
    """SIGTERM and Ctrl+C start one draining shutdown; repeats are ignored
    (the reactor's own handler would raise on them)."""
    stopping: list[int] = []

    def handler(signum, frame):
        if not stopping:
            stopping.append(signum)
            reactor.callFromThread(reactor.stop)

    signal.signal(signal.SIGTERM, handler)
    if os.environ.get(CHILD_ENV):
        # A supervised worker: Ctrl+C in a terminal reaches the whole process
        # group, but the supervisor must order the drain (gateway first, then
        # SIGTERM to each worker), or workers leave early and are restarted.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _drain_when_the_supervisor_goes(reactor, handler)
    else:
        signal.signal(signal.SIGINT, handler)


@implementer(IReadDescriptor)
class _SupervisorPipe:
    """
    The standard input of a supervised process: a pipe whose other end only
    its supervisor holds. Nothing is sent on it; its end calls C{gone}.
    """

    def __init__(self, gone: Callable[[], None]):
        self._gone = gone
        fdesc.setNonBlocking(0)

    def fileno(self) -> int:
        return 0

    def logPrefix(self) -> str:
        return "supervisor"

    def doRead(self):
        return fdesc.readFromFD(0, lambda data: None)

    def connectionLost(self, reason) -> None:
        self._gone()


def _drain_when_the_supervisor_goes(reactor, handler) -> None:
    """
    A supervised process drains and exits, as on SIGTERM, when the pipe on
    its standard input ends. That happens when its supervisor dies without
    stopping it (SIGKILL, the OOM killer, a crash: the kernel closes the
    supervisor's end), and an orphan would keep its port and its device's
    memory, so the restarted supervisor's new worker could not start. It
    is also how the supervisor stops a worker run under C{--worker-wrapper}
    (L{kcoral.node.wrapper}), where a SIGTERM would reach the wrapper, not
    the worker: bubblewrap passes no signal on.

    A pipe, not the kernel's signal on the parent's death
    (C{PR_SET_PDEATHSIG}), because the pipe crosses a wrapper (the signal
    watches the direct parent, the wrapper, and the supervisor's pid means
    nothing in the wrapper's PID namespace), and it says the same whether
    the supervisor died before or after this runs (the seconds of importing
    JAX), with no pid to compare.
    """
    reactor.addReader(_SupervisorPipe(lambda: handler(signal.SIGTERM, None)))


def main(argv: list[str] | None = None) -> int:
    config = CommandOptions()
    try:
        config.parseOptions(sys.argv[1:] if argv is None else argv)
    except usage.UsageError as e:
        command = f"kcoral {config.subCommand}" if config.subCommand else "kcoral"
        print(f"{command}: error: {e}", file=sys.stderr)
        if not isinstance(e, SettingError):
            print(f"Try '{command} --help'.", file=sys.stderr)
        return 2
    subcommand = config.subCommand
    assert subcommand is not None  # postOptions refuses a missing command
    if subcommand == "router":
        return run_service(router_tap, config.subOptions)
    if subcommand == "server":
        return run_service(node_tap, config.subOptions)
    return status.run(subcommand, config.subOptions)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
