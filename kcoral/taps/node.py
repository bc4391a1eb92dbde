"""
C{twistd kcoral-node} and C{kcoral server}: one C{usage.Options}, one
C{makeService}. Without C{--router} and with one worker this is a standalone
server; otherwise a supervisor that runs the server process(es).
"""

from __future__ import annotations

import os
from typing import Any

from twisted.python import usage

from kcoral.common.serverconfig import ServerConfig
from kcoral.node import config
from kcoral.node.config import GATEWAY_GRPC_PORT, GATEWAY_HTTP_PORT, NodeConfig
from kcoral.node.devices import NODE_DEVICES_ENV, gpus_from_count
from kcoral.node.environment import SECURED_ENV, WorkerEnvironment
from kcoral.node.restart import RestartSettings
from kcoral.node.supervisor import make_supervisor_service
from kcoral.node.wrapper import wrapper_argv
from kcoral.options import (
    CLIENT_AUTH_OPTIONS,
    CLIENT_TOKEN,
    CLIENT_TOKENS_FILE,
    LISTEN,
    OBSERVING,
    ROUTING,
    TLS_CA,
    TLS_CERT,
    TLS_CLIENT_CA,
    TLS_KEY,
    KCoralOptions,
    OneOf,
    SettingError,
    check_listen,
    config_from,
    non_negative,
    parameter,
    port,
    positive,
)
from kcoral.router.placement import ROUTINGS
from kcoral.sandbox import SANDBOX_MODES
from kcoral.server.control import MODES
from kcoral.server.service import ServerService
from kcoral.web.auth import CLIENT_TOKEN_ENV

_SUPERVISOR_ROWS: list[tuple[Any, ...]] = [
    ("health_interval_seconds", "Interval between health probes and heartbeats.", positive(float)),
    ("health_timeout_seconds", "Timeout of each local health probe.", positive(float)),
    ("failure_threshold", "Failed probes in a row before a restart.", positive(int)),
    ("startup_grace_seconds", "Time after a start when failed probes do not count.",
     non_negative(float)),
    ("stable_reset_seconds", "Healthy time that resets the restart backoff.", non_negative(float)),
    ("termination_grace_seconds", "Wait between SIGTERM and SIGKILL.", non_negative(float)),
    ("restart_min_delay_seconds", "First restart delay.", non_negative(float)),
    ("restart_max_delay_seconds", "Largest restart delay before jitter.", non_negative(float)),
    ("restart_jitter", "Random variation of restart delays, a fraction in [0, 0.5].", float),
]
#: The supervisor options, left out of --help.
SUPERVISOR_OPTIONS = [parameter(RestartSettings, *row) for row in _SUPERVISOR_ROWS]


def _server(field: str, doc: str, coerce=None) -> list:
    return parameter(ServerConfig, field, doc, coerce)


def _node(field: str, doc: str, coerce=None) -> list:
    return parameter(NodeConfig, field, doc, coerce)


class NodeOptions(KCoralOptions):
    synopsis = "[options]"
    longdesc = ("Run a KCoral server. With --router, run a node: a supervisor that starts "
                "one server process per device and reports to the Router.")

    optParameters = [
        _server("host", "Interface to listen on."),
        _server("port", "Port of the first worker (worker i listens on port + i).", port),
        _server("gpus", "GPUs to serve: a comma list, 'all' or 'none'."),
        _server("devices_per_worker", "Devices each worker owns: that many of --gpus, in the order "
                "named, or on the CPU that many host devices.", positive(int)),
        _node("cpu_workers", "CPU workers when there is no GPU or with --gpus none.", positive(int)),
        _server("capacity", "Programs each worker runs at once.", positive(int)),
        _server("max_queued_requests", "Runs that may wait for a slot on a worker.",
                non_negative(int)),
        _server("queue_wait_timeout_seconds", "Longest wait for a slot.", non_negative(float)),
        _node("router", "Router URL to join, or a comma list of them [env: KCORAL_ROUTER_ENDPOINT]."),
        _node("node_id", "Stable identifier of this node [env: KCORAL_NODE_ID]."),
        _node("node_token", "Bearer token for the Router [env: KCORAL_NODE_TOKEN]."),
        _node("advertise_host", "Host the Router uses to reach this node (default: --host)."),
        _server("max_request_bytes", "Largest request body accepted.", positive(int)),
        _server("cache_memory_bytes", "Upload cache size in memory.", non_negative(int)),
        _server("cache_dir", "Directory for an upload cache that survives restarts."),
        _server("cache_disk_bytes", "Upload cache size on disk.", non_negative(int)),
        _server("compile_cache_entries", "Compiled programs kept per worker.", positive(int)),
        _server("device_cache_bytes",
                "Large inputs kept on each worker's device between runs, in bytes (0: none).",
                non_negative(int)),
        _server("kept_bytes", "Bytes of the arrays runs keep on each worker's devices (keep=True); "
                "a run whose kept outputs would pass it is refused before it runs.",
                non_negative(int)),
        _server("kept_idle_seconds", "A kept array no run or fetch used for this long is freed.",
                positive(float)),
        _server("compilation_cache_dir", "Directory for JAX's persistent compilation cache."),
        _server("model_repository", "A folder of model bundles (kcoral.export_bundle) every worker "
                "loads and compiles before it is ready [node file: model_repository or model_repo]."),
        _server("model_control_mode", "Which models are served: none (all, the repository read "
                "once), poll (all, the repository read again every --repository-poll-seconds) "
                "or explicit (those of --load-model, then loaded and unloaded on request).",
                OneOf(MODES)),
        _server("repository_poll_seconds", "How often poll mode reads the model repository "
                "again.", positive(float)),
        _server("max_batch_delay_microseconds", "Longest wait of a batched model's short batch "
                "for more requests (0: run what is queued at once).", non_negative(int)),
        _server("max_sequences", "Live sequences each worker holds of each sequence model; a "
                "new one past them is refused (503 sequences_full).", positive(int)),
        _server("grpc_port", "Port of the inference protocol over gRPC (the gateway's, with several "
                "workers; default: gRPC off).", port),
        _node("front_processes", "Processes serving --grpc-port, the gateway among them, each "
              "listening with SO_REUSEPORT (default: one per four cores; more than one "
              "puts a gateway before even a single worker).", positive(int)),
        _node("base_port", "gRPC port of worker 0 (worker i: + i); with it or --metrics-base-port "
              f"the gateway takes gRPC {GATEWAY_GRPC_PORT} and HTTP {GATEWAY_HTTP_PORT} unless "
              "--grpc-port and --port say otherwise.", port),
        _node("metrics_base_port", "HTTP port of worker 0 (worker i: + i): its /health, /readyz, "
              "/metrics and the protocols.", port),
        _server("tls_cert", TLS_CERT),
        _server("tls_key", TLS_KEY),
        _node("tls_ca", TLS_CA),
        _server("listen", LISTEN),
        _node("routing", ROUTING + " (the gateway of several workers)", OneOf(tuple(ROUTINGS))),
        _server("client_token", CLIENT_TOKEN),
        _server("client_tokens_file", CLIENT_TOKENS_FILE),
        _server("tls_client_ca", TLS_CLIENT_CA),
        _server("max_run_seconds", "A run or inference batch still executing this long after it "
                "started is ended with its process: the client gets 504 run_timeout, a node's "
                "worker is replaced, a standalone server exits with status 3 (0: no limit).",
                non_negative(float)),
        _server("sandbox", "How each process that runs programs confines itself: auto (every "
                "layer the kernel offers), strict (exit 2 when one is missing) or off.",
                OneOf(SANDBOX_MODES)),
        _node("worker_wrapper", "A command line each worker's own is run under (bubblewrap, "
              "nsjail, runsc): it must pass descriptors 0 to 3 on to the worker, and take the "
              "worker along when it is killed, e.g. 'bwrap --ro-bind / / --dev /dev --proc /proc "
              "--unshare-pid --die-with-parent --'."),
        *(_server(*row) for row in OBSERVING),
        ["config", None, None, "A YAML node file with any of these options (the command line wins)."],
    ] + SUPERVISOR_OPTIONS

    optFlags = [
        ["batch-invariant", None, ("Give each row of a batched model the same output bytes "
                                   "whatever else is in its batch (each row computed on its "
                                   "own: slower) [node file: batch_invariant].")],
        ["allow-client-shm", None, ("Serve system shared memory to clients on this host: they "
                                    "name any object of /dev/shm, which the server or gateway "
                                    "opens; and CUDA shared memory, on a standalone server on "
                                    "a GPU [node file: allow_client_shm].")],
    ]

    environment = {"router": "KCORAL_ROUTER_ENDPOINT", "node-id": "KCORAL_NODE_ID",
                   "node-token": "KCORAL_NODE_TOKEN", "client-token": CLIENT_TOKEN_ENV,
                   **NODE_DEVICES_ENV}
    hidden = frozenset(row[0] for row in SUPERVISOR_OPTIONS)

    def __init__(self):
        super().__init__()
        self["load-model"] = []
        self["allow-custom-call"] = []
        self["worker-env"] = []

    def opt_allow_custom_call(self, target: str) -> None:
        """A custom-call target programs may hold beyond KCoral's allow-list (repeat it)."""
        self["allow-custom-call"].append(target)

    def opt_worker_env(self, name: str) -> None:
        """A variable of this environment every worker gets beyond the allow-list (repeat it)."""
        self["worker-env"].append(name)

    def opt_load_model(self, name: str) -> None:
        """A model to load at start in explicit model control mode (repeat it; '*': all)."""
        self["load-model"].append(name)

    def from_environment(self) -> set[str]:
        filled = super().from_environment()
        if "gpus" in filled:
            # The variable counts GPUs as other node supervisors do; --gpus names them.
            try:
                self["gpus"] = gpus_from_count(self["gpus"])
            except ValueError as e:
                raise usage.UsageError(f"KCORAL_GPUS: {e}") from None
        return filled

    def postOptions(self):
        from_environment = self.from_environment()
        from_file = config.load(self["config"], self, self.named | from_environment) \
            if self["config"] else set()
        self._gateway_ports(self.named | from_environment | from_file)
        self._repository()
        if self["load-model"] and self["model-control-mode"] != "explicit":
            raise usage.UsageError("--load-model is for --model-control-mode explicit (in the "
                                   "other modes every model is loaded)")
        if self["router"]:
            self._no_client_authentication(from_environment)
        check_listen(self)
        if self["listen"] and self["router"]:
            raise usage.UsageError("--listen is for a server without --router; under a Router, "
                                   "workers listen on --host and --port (see --advertise-host)")
        if self["router"] and not NodeConfig(router=self["router"]).routers:
            raise usage.UsageError(f"--router {self['router']!r} names no Router URL")
        if self["router"] and not self["node-id"]:
            raise usage.UsageError("--router needs --node-id (or KCORAL_NODE_ID)")
        if self.given("front-processes") and self["front-processes"] > 1 and (
                self["router"] or self["grpc-port"] is None):
            raise usage.UsageError("--front-processes spreads the gateway's --grpc-port: it needs "
                                   "--grpc-port, and no --router")
        if self["router"] and self["grpc-port"] is not None:
            # Under a Router the workers have no gateway: the Router's own
            # --grpc-port is where gRPC clients go.
            raise usage.UsageError("--grpc-port is for the Router (and a node without --router): "
                                   "under --router, gRPC clients reach the Router's --grpc-port")
        if not 0 <= self["restart-jitter"] <= 0.5:
            raise usage.UsageError(f"--restart-jitter must be within 0-0.5, got {self['restart-jitter']}")
        if not self.supervised:
            given = sorted(o for o in self.hidden if self.given(o))
            if given:
                raise usage.UsageError(f"--{given[0]} requires --router (or several workers)")
        if not self.supervised and (self["worker-wrapper"] or self["worker-env"]):
            option = "worker-wrapper" if self["worker-wrapper"] else "worker-env"
            raise usage.UsageError(f"--{option} is for a node's workers: it requires --router "
                                   "(or several workers)")
        try:
            WorkerEnvironment(tuple(self["worker-env"]))
            wrapper_argv(self["worker-wrapper"])
        except ValueError as e:
            raise SettingError(str(e)) from None
        if self["restart-min-delay-seconds"] > self["restart-max-delay-seconds"]:
            raise usage.UsageError("--restart-min-delay-seconds exceeds --restart-max-delay-seconds")

    def _gateway_ports(self, given: set[str]) -> None:
        """A node whose workers have the ports of C{--base-port} and
        C{--metrics-base-port} gives its gateway the public ports of the
        node supervisors that use those names, unless told otherwise."""
        if self["router"] or (self["base-port"] is None and self["metrics-base-port"] is None):
            return
        if "port" not in given:
            self["port"] = GATEWAY_HTTP_PORT
        if "grpc-port" not in given:
            self["grpc-port"] = GATEWAY_GRPC_PORT

    def _repository(self) -> None:
        """
        The model repository as an absolute path (workers need not share the
        supervisor's working folder), refused at start when it cannot be
        listed: every worker would fail on it, restarted again and again.
        """
        if not self["model-repository"]:
            return
        path = self["model-repository"] = os.path.abspath(os.path.expanduser(self["model-repository"]))
        try:
            with os.scandir(path):
                pass
        except OSError as e:
            raise SettingError(f"model repository {path}: {e.strerror}") from None

    def _no_client_authentication(self, from_environment: set[str]) -> None:
        """
        Under a Router, clients reach the Router, and the node's workers
        only the Router, which sends them no client token: client
        authentication is the Router's. Asked for here, it is a usage error;
        a C{KCORAL_CLIENT_TOKEN} in the environment (one secret shared by a
        deployment's Routers and nodes) is left unused.
        """
        for option in CLIENT_AUTH_OPTIONS:
            if option in from_environment:
                self[option] = None
            elif self[option]:
                raise usage.UsageError(f"--{option} is for the Router (and a server without "
                                       "--router): under --router, the Router checks clients")

    @property
    def supervised(self) -> bool:
        """Whether a supervisor runs the server process(es)."""
        gpus = self["gpus"]
        named = [] if gpus == "none" else [g for g in gpus.split(",") if g.strip()]
        return bool(self["router"]) or self["cpu-workers"] > 1 or gpus == "all" \
            or len(named) > self["devices-per-worker"] or self["base-port"] is not None \
            or self["metrics-base-port"] is not None \
            or (self.given("front-processes") and self["front-processes"] > 1)

    def server_config(self, **overrides) -> ServerConfig:
        # A node's worker never gets the node's token, only the mark that
        # its node has one (kcoral.node.environment).
        secured = bool(self["node-token"]) or os.environ.get(SECURED_ENV) == "1"
        return config_from(ServerConfig, self, secured=secured,
                           load_model=tuple(self["load-model"]),
                           allow_custom_calls=tuple(self["allow-custom-call"]), **overrides)

    def restart_settings(self) -> RestartSettings:
        return config_from(RestartSettings, self)

    def node_config(self) -> NodeConfig:
        return config_from(NodeConfig, self, restart=self.restart_settings(),
                           worker_env=tuple(self["worker-env"]))


#: The name twistd's C{ServiceMaker} looks up in a plugin's module.
Options = NodeOptions


def makeService(options: NodeOptions, reactor=None):
    if reactor is None:
        from twisted.internet import reactor
    if options.supervised:
        return make_supervisor_service(options, reactor)
    return ServerService(options.server_config(), reactor)
