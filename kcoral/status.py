"""
Operator commands: C{kcoral status} (a Router's pool as a table) and
C{kcoral health URL} (one service's C{/health}).
"""

from __future__ import annotations

import json
import os
import sys

from twisted.internet.defer import inlineCallbacks
from twisted.python import usage

DEFAULT_ROUTER = "http://127.0.0.1:9000"


class StatusOptions(usage.Options):
    synopsis = "[--router URL]"
    optParameters = [["router", None, None,
                      f"Router URL [env: KCORAL_ROUTER_ENDPOINT, default {DEFAULT_ROUTER}]."]]

    def postOptions(self):
        self["router"] = (self["router"] or os.environ.get("KCORAL_ROUTER_ENDPOINT")
                          or DEFAULT_ROUTER).rstrip("/")


class HealthOptions(usage.Options):
    synopsis = "URL"

    # usage.Options passes the positional arguments here, and says
    # "Wrong number of arguments" when they do not fit this signature.
    def parseArgs(self, url: str) -> None:  # type: ignore[override]
        self["url"] = url.rstrip("/")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_status(health: dict, nodes: list[dict]) -> str:
    rows = [["NODE", "STATE", "TARGET", "CAPACITY", "ACTIVE", "LAST REPORT"]]
    for node in nodes:
        age = node.get("last_report_age_seconds")
        rows.append([str(node.get("node_id")), str(node.get("state")), str(node.get("gpu_target")),
                     str(node.get("capacity")), str(node.get("active")),
                     "-" if age is None else f"{age:.1f}s ago"])
    summary = (f"router {health.get('status')}: capacity {health.get('capacity')}, "
               f"active {health.get('active')}, queued {health.get('queued')}")
    return _table(rows) + "\n\n" + summary


@inlineCallbacks
def _get_json(reactor, url: str):
    import treq

    response = yield treq.get(url, reactor=reactor, timeout=10)
    body = yield treq.content(response)
    return response.code, json.loads(body)


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
                _, health = yield _get_json(reactor, options["router"] + "/health")
                _, nodes = yield _get_json(reactor, options["router"] + "/v1/nodes")
                print(format_status(health, nodes.get("nodes", [])))
                result.append(0)
        except Exception as e:
            target = options["url"] if command == "health" else options["router"]
            print(f"kcoral {command}: error: cannot read {target}: {e}", file=sys.stderr)
            result.append(1)

    try:
        react(main)
    except SystemExit:
        pass
    return result[0] if result else 1
