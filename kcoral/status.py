"""
Operator commands: C{kcoral status} (a Router's pool as a table, coloured on
a terminal; C{--json} for scripts; C{--watch} to follow it) and C{kcoral
health URL} (one service's C{/health}).
"""

from __future__ import annotations

import json
import os
import sys

from twisted.internet.defer import inlineCallbacks
from twisted.python import usage

from kcoral.client.sync import client_headers
from kcoral.options import positive
from kcoral.web.auth import CLIENT_TOKEN_ENV
from kcoral.web.family import NODE_LIST

DEFAULT_ROUTER = "http://127.0.0.1:9000"


#: Seconds between two reads of the pool with --watch.
WATCH_INTERVAL_SECONDS = 2.0


class StatusOptions(usage.Options):
    synopsis = "[--router URL] [--token TOKEN] [--json] [--watch [--interval SECONDS]]"
    optFlags = [
        ["json", None, "Print the Router's /health and /v1/nodes as one JSON object."],
        ["watch", None, "Print the pool again every --interval seconds, until Ctrl+C."],
    ]
    optParameters = [
        ["router", None, None,
         f"Router URL [env: KCORAL_ROUTER_ENDPOINT, default {DEFAULT_ROUTER}]."],
        ["interval", None, WATCH_INTERVAL_SECONDS, "Seconds between two reads with --watch.",
         positive(float)],
        ["token", None, None, f"Client token of the Router [env: {CLIENT_TOKEN_ENV}]."],
    ]

    def postOptions(self):
        self["router"] = (self["router"] or os.environ.get("KCORAL_ROUTER_ENDPOINT")
                          or DEFAULT_ROUTER).rstrip("/")
        try:
            self["headers"] = {k: [v] for k, v in client_headers(self["token"]).items()}
        except ValueError as e:
            raise usage.UsageError(f"--token: {e}") from None


class HealthOptions(usage.Options):
    synopsis = "URL"

    # usage.Options passes the positional arguments here, and says
    # "Wrong number of arguments" when they do not fit this signature.
    def parseArgs(self, url: str) -> None:  # type: ignore[override]
        self["url"] = url.rstrip("/")


#: ANSI colours of node states and Router statuses on a terminal: green takes
#: work, yellow is on its way in or out, red takes none.
_COLOURS = {"ready": "32", "ok": "32", "joining": "33", "draining": "33",
            "unhealthy": "31", "incompatible": "31", "gone": "31", "unavailable": "31"}


def _colour(text: str, padded: str, on: bool) -> str:
    """C{padded} (C{text} padded to its column), coloured by C{text} when C{on}."""
    code = _COLOURS.get(text)
    return f"\x1b[{code}m{padded}\x1b[0m" if on and code else padded


def format_status(health: dict, nodes: list[dict], *, colour: bool = False) -> str:
    rows = [["NODE", "STATE", "TARGET", "CAPACITY", "ACTIVE", "LAST REPORT"]]
    for node in nodes:
        age = node.get("last_report_age_seconds")
        rows.append([str(node.get("node_id")), str(node.get("state")), str(node.get("gpu_target")),
                     str(node.get("capacity")), str(node.get("active")),
                     "-" if age is None else f"{age:.1f}s ago"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [c.ljust(w) for c, w in zip(row, widths)]
        if index:  # the state of a node, not the header
            cells[1] = _colour(row[1], cells[1], colour)
        lines.append("  ".join(cells).rstrip())
    status = str(health.get("status"))
    summary = (f"router {_colour(status, status, colour)}: capacity {health.get('capacity')}, "
               f"active {health.get('active')}, queued {health.get('queued')}")
    return "\n".join(lines) + "\n\n" + summary


def use_colour(stream) -> bool:
    """Colour for a terminal, unless C{NO_COLOR} is set."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


@inlineCallbacks
def _get_json(reactor, url: str, headers: dict | None = None):
    import treq

    response = yield treq.get(url, headers=headers, reactor=reactor, timeout=10)
    body = yield treq.content(response)
    return response.code, json.loads(body)


@inlineCallbacks
def read_pool(reactor, router: str, headers: dict | None = None):
    """The Router's C{/health} and C{/v1/nodes}, as C{{"health": ..., "nodes": [...]}};
    C{headers} authenticate the client."""
    _, health = yield _get_json(reactor, router + "/health")
    code, nodes = yield _get_json(reactor, router + NODE_LIST.label, headers)
    if code != 200:
        error = nodes.get("error") or {}
        raise ValueError(f"{NODE_LIST.label} answered {code} {error.get('type')}: {error.get('message')}")
    return {"health": health, "nodes": nodes.get("nodes", [])}


@inlineCallbacks
def show_status(reactor, options, out=sys.stdout):
    """Print the pool once, or with C{--watch} again and again (a failed read
    is shown and the watch goes on). Fires with the exit status."""
    from twisted.internet.task import deferLater

    colour = use_colour(out) and not options["json"]
    while True:
        try:
            pool = yield read_pool(reactor, options["router"], options["headers"])
        except Exception as e:
            text, failed = f"kcoral status: error: cannot read {options['router']}: {e}", True
        else:
            text, failed = (json.dumps(pool, sort_keys=True) if options["json"] else
                            format_status(pool["health"], pool["nodes"], colour=colour)), False
        if not options["watch"]:
            print(text, file=sys.stderr if failed else out)
            return 1 if failed else 0
        if colour:
            out.write("\x1b[H\x1b[2J")  # the terminal's home, then clear: a refreshed screen
        print(text, file=out, flush=True)
        yield deferLater(reactor, options["interval"], lambda: None)


def run(command: str, options) -> int:
    from twisted.internet.task import react

    result = []

    @inlineCallbacks
    def main(reactor):
        try:
            if command == "health":
                code, body = yield _get_json(reactor, options["url"] + "/health")
                print(json.dumps(body, indent=2, sort_keys=True))
                result.append(0 if code == 200 else 1)
            else:
                result.append((yield show_status(reactor, options)))
        except Exception as e:
            target = options["url"] if command == "health" else options["router"]
            print(f"kcoral {command}: error: cannot read {target}: {e}", file=sys.stderr)
            result.append(1)

    try:
        react(main)
    except SystemExit:
        pass
    if not result and command == "status" and options["watch"]:
        return 0  # Ctrl+C ended the watch: the reactor stopped under it
    return result[0] if result else 1
