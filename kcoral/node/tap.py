"""
C{twistd kcoral-node} and C{kcoral server}: one C{usage.Options}, one
C{makeService}. Without C{--router} and with one worker this is a standalone
server; otherwise a supervisor that runs the server process(es).
"""

from __future__ import annotations

from twisted.python import usage

from kcoral.options import LISTEN, KCoralOptions, check_listen, non_negative, port, positive

SUPERVISOR_OPTIONS = [
    ["health-interval-seconds", None, 2.0, "Interval between health probes and heartbeats.", positive(float)],
    ["health-timeout-seconds", None, 1.0, "Timeout of each local health probe.", positive(float)],
    ["failure-threshold", None, 3, "Failed probes in a row before a restart.", positive(int)],
    ["startup-grace-seconds", None, 30.0, "Time after a start when failed probes do not count.", non_negative(float)],
    ["stable-reset-seconds", None, 60.0, "Healthy time that resets the restart backoff.", non_negative(float)],
    ["termination-grace-seconds", None, 5.0, "Wait between SIGTERM and SIGKILL.", non_negative(float)],
    ["restart-min-delay-seconds", None, 1.0, "First restart delay.", non_negative(float)],
    ["restart-max-delay-seconds", None, 30.0, "Largest restart delay before jitter.", non_negative(float)],
    ["restart-jitter", None, 0.2, "Random variation of restart delays, a fraction in [0, 0.5].", float],
]


class Options(KCoralOptions):
    synopsis = "[options]"
    longdesc = ("Run a KCoral server. With --router, run a node: a supervisor that starts "
                "one server process per device and reports to the Router.")

    optParameters = [
        ["host", None, "127.0.0.1", "Interface to listen on."],
        ["port", None, 8000, "Port of the first worker (worker i listens on port + i).", port],
        ["gpus", None, "0", "GPUs to serve: a comma list, 'all' or 'none'."],
        ["cpu-workers", None, 1, "CPU workers when there is no GPU or with --gpus none.", positive(int)],
        ["capacity", None, 2, "Programs each worker runs at once.", positive(int)],
        ["max-queued-requests", None, 64, "Runs that may wait for a slot on a worker.", non_negative(int)],
        ["queue-wait-timeout-seconds", None, 1800.0, "Longest wait for a slot.", non_negative(float)],
        ["router", None, None, "Router URL to join [env: KCORAL_ROUTER_ENDPOINT]."],
        ["node-id", None, None, "Stable identifier of this node [env: KCORAL_NODE_ID]."],
        ["node-token", None, None, "Bearer token for the Router [env: KCORAL_NODE_TOKEN]."],
        ["advertise-host", None, None, "Host the Router uses to reach this node (default: --host)."],
        ["max-request-bytes", None, 268435456, "Largest request body accepted.", positive(int)],
        ["cache-memory-bytes", None, 1 << 30, "Upload cache size in memory.", non_negative(int)],
        ["cache-dir", None, None, "Directory for an upload cache that survives restarts."],
        ["cache-disk-bytes", None, 10 << 30, "Upload cache size on disk.", non_negative(int)],
        ["compile-cache-entries", None, 64, "Compiled programs kept per worker.", positive(int)],
        ["device-cache-bytes", None, 1 << 30,
         "Large inputs kept on each worker's device between runs, in bytes (0: none).",
         non_negative(int)],
        ["compilation-cache-dir", None, None, "Directory for JAX's persistent compilation cache."],
        ["tls-cert", None, None, "PEM certificate (chain): listen with TLS."],
        ["tls-key", None, None, "PEM private key of --tls-cert (default: inside --tls-cert)."],
        ["tls-ca", None, None, "PEM CA to verify https peers with (default: the system's roots)."],
        LISTEN,
        ["config", None, None, "A YAML node file with any of these options (the command line wins)."],
    ] + SUPERVISOR_OPTIONS

    environment = {"router": "KCORAL_ROUTER_ENDPOINT", "node-id": "KCORAL_NODE_ID",
                   "node-token": "KCORAL_NODE_TOKEN"}
    hidden = frozenset(o[0] for o in SUPERVISOR_OPTIONS)

    def postOptions(self):
        from_environment = self.from_environment()
        if self["config"]:
            from kcoral.node import config
            config.load(self["config"], self, self.named | from_environment)
        check_listen(self)
        if self["listen"] and self["router"]:
            raise usage.UsageError("--listen is for a server without --router; under a Router, "
                                   "workers listen on --host and --port (see --advertise-host)")
        if self["router"] and not self["node-id"]:
            raise usage.UsageError("--router needs --node-id (or KCORAL_NODE_ID)")
        if not 0 <= self["restart-jitter"] <= 0.5:
            raise usage.UsageError(f"--restart-jitter must be within 0-0.5, got {self['restart-jitter']}")
        if not self.supervised:
            given = sorted(o for o in self.hidden if self.given(o))
            if given:
                raise usage.UsageError(f"--{given[0]} requires --router (or several workers)")
        if self["restart-min-delay-seconds"] > self["restart-max-delay-seconds"]:
            raise usage.UsageError("--restart-min-delay-seconds exceeds --restart-max-delay-seconds")

    @property
    def supervised(self) -> bool:
        """Whether a supervisor runs the server process(es)."""
        gpus = self["gpus"]
        return bool(self["router"]) or self["cpu-workers"] > 1 or "," in gpus or gpus == "all"

    def server_config(self, **overrides):
        from kcoral.server.service import ServerConfig

        values = dict(
            host=self["host"], port=self["port"], gpus=self["gpus"], capacity=self["capacity"],
            max_queued_requests=self["max-queued-requests"],
            queue_wait_timeout_seconds=self["queue-wait-timeout-seconds"],
            max_request_bytes=self["max-request-bytes"],
            cache_memory_bytes=self["cache-memory-bytes"], cache_dir=self["cache-dir"],
            cache_disk_bytes=self["cache-disk-bytes"],
            compile_cache_entries=self["compile-cache-entries"],
            device_cache_bytes=self["device-cache-bytes"],
            compilation_cache_dir=self["compilation-cache-dir"],
            secured=bool(self["node-token"]),
            tls_cert=self["tls-cert"], tls_key=self["tls-key"], listen=self["listen"],
        )
        values.update(overrides)
        return ServerConfig(**values)


def makeService(options: Options, reactor=None):
    if reactor is None:
        from twisted.internet import reactor
    if options.supervised:
        from kcoral.node.supervisor import makeSupervisorService

        return makeSupervisorService(options, reactor)
    from kcoral.server.service import ServerService

    return ServerService(options.server_config(), reactor)
