"""
A server's settings: what C{kcoral server} takes for its one process, and
what a node passes on to each worker it starts (and to its gateway).
"""

from __future__ import annotations

import attrs

#: The status a server exits with once a run passed its C{max_run_seconds}:
#: its supervisor (a node's, systemd, a container runtime) starts it again.
RUN_TIMEOUT_EXIT_STATUS = 3
#: C{--sandbox} (kcoral.sandbox): every layer the kernel offers (the
#: missing ones logged), every layer or exit 2, or none.
SANDBOX_MODES = ("auto", "strict", "off")


@attrs.frozen
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    gpus: str = "0"
    #: Devices this server owns: GPUs named by gpus, or host devices on the CPU.
    devices_per_worker: int = 1
    capacity: int = 2
    max_queued_requests: int = 64
    queue_wait_timeout_seconds: float = 1800.0
    max_request_bytes: int = 268435456
    cache_memory_bytes: int = 1 << 30
    cache_dir: str | None = None
    cache_disk_bytes: int = 10 << 30
    compile_cache_entries: int = 64
    device_cache_bytes: int = 1 << 30
    #: Bytes of the arrays runs keep on a worker's devices, and how long one
    #: unused is kept.
    kept_bytes: int = 1 << 30
    kept_idle_seconds: float = 3600.0
    compilation_cache_dir: str | None = None
    secured: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    #: A Twisted server endpoint string, in place of host, port and TLS files.
    listen: str | None = None
    #: Bearer tokens runs need (kcoral.web.auth): a standalone server's, or
    #: its gateway's; never a worker's, which only its node reaches.
    client_token: str | None = None
    client_tokens_file: str | None = None
    #: CA file client certificates must be signed by (mutual TLS).
    tls_client_ca: str | None = None
    log_format: str = "text"
    tracing: str = "none"
    #: A folder of model bundles every worker loads and compiles before it is ready.
    model_repository: str | None = None
    #: Which models are served, and how that changes while the server runs
    #: (kcoral.server.control): none, poll or explicit.
    model_control_mode: str = "none"
    #: The models to load at start in explicit mode ("*": all).
    load_model: tuple[str, ...] = ()
    #: How often poll mode reads the repository again.
    repository_poll_seconds: float = 15.0
    #: The port of the Open Inference Protocol over gRPC (None: gRPC off).
    grpc_port: int | None = None
    #: How long a short batch of a batched model waits for more rows (0: it
    #: takes what is queued and never waits).
    max_batch_delay_microseconds: int = 0
    #: The live sequences each worker holds of each sequence model.
    max_sequences: int = 1024
    #: Whether a batched model's row has the same output bytes whatever else
    #: is in its batch (a flag: its option gives 0 or 1).
    batch_invariant: bool = attrs.field(default=False, converter=bool)
    #: Whether clients on this host may register system shared-memory
    #: regions (a flag: its option gives 0 or 1); the process that accepts
    #: inferences then opens any object of /dev/shm a client names.
    allow_client_shm: bool = attrs.field(default=False, converter=bool)
    #: Custom-call targets a program may hold beyond KCoral's allow-list
    #: (kcoral.server.programcheck): the operator's own additions.
    allow_custom_calls: tuple[str, ...] = ()
    #: A run or inference batch still executing this long after it started
    #: ends the process that runs it (0: no limit).
    max_run_seconds: float = 0.0
    #: How the process that runs programs confines itself (kcoral.sandbox):
    #: auto, strict or off.
    sandbox: str = "auto"
