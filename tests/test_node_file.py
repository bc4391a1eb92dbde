"""
The node file in the shape other node supervisors write (C{base_port},
C{metrics_base_port}, C{global:}, C{workers:}), the environment that sizes a
node (C{KCORAL_GPUS}, C{KCORAL_CPU_WORKERS}), and node-file paths taken from
the node file's folder: options parsed, no process started.
"""

from __future__ import annotations

import pytest
import yaml
from twisted.python import usage

from kcoral.node.devices import gpus_from_count
from kcoral.node.supervisor import worker_argv, worker_grpc_port, worker_port
from kcoral.taps import node as node_tap


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("KCORAL_GPUS", "KCORAL_CPU_WORKERS", "KCORAL_ROUTER_ENDPOINT", "KCORAL_NODE_ID"):
        monkeypatch.delenv(name, raising=False)


def parsed(tmp_path, content: dict, *argv: str) -> node_tap.NodeOptions:
    node_file = tmp_path / "node.yaml"
    node_file.write_text(yaml.safe_dump(content))
    options = node_tap.Options()
    options.parseOptions(["--config", str(node_file), *argv])
    return options


@pytest.mark.parametrize("text, gpus", [
    ("0", "none"), ("1", "0"), ("3", "0,1,2"), ("all", "all"), ("2,5", "2,5"), (" 2 ", "0,1"),
])
def test_kcoral_gpus_counts_gpus(text, gpus):
    """KCORAL_GPUS is a count (0: a CPU node), all, or a comma list naming GPUs."""
    assert gpus_from_count(text) == gpus


@pytest.mark.parametrize("text", ["-1", "two", "0,x", "1.5"])
def test_kcoral_gpus_refuses_what_is_neither(text):
    """A KCORAL_GPUS that is no count, no list and not 'all' is refused."""
    with pytest.raises(ValueError, match="count of GPUs"):
        gpus_from_count(text)


def test_environment_sizes_the_node_and_the_command_line_beats_it(tmp_path, monkeypatch):
    """KCORAL_GPUS and KCORAL_CPU_WORKERS beat the node file; the command line beats both."""
    monkeypatch.setenv("KCORAL_GPUS", "0")
    monkeypatch.setenv("KCORAL_CPU_WORKERS", "3")
    options = parsed(tmp_path, {"global": {"runtime": {"backend": "cuda"}}, "cpu_workers": 5})
    assert (options["gpus"], options["cpu-workers"]) == ("none", 3)
    options = parsed(tmp_path, {}, "--cpu-workers", "4", "--gpus", "1")
    assert (options["gpus"], options["cpu-workers"]) == ("1", 4)


def test_a_bad_kcoral_cpu_workers_names_the_variable(monkeypatch):
    """KCORAL_CPU_WORKERS goes through --cpu-workers' check, and its error names it."""
    monkeypatch.setenv("KCORAL_CPU_WORKERS", "0")
    with pytest.raises(usage.UsageError, match="KCORAL_CPU_WORKERS: must be positive"):
        node_tap.Options().parseOptions([])


def test_workers_of_gpus(tmp_path):
    """A workers: list of GPU groups names the GPUs and the devices of each worker."""
    options = parsed(tmp_path, {"workers": [{"gpus": [0, 1]}, {"gpus": [2, 3]}]})
    assert (options["gpus"], options["devices-per-worker"]) == ("0,1,2,3", 2)


def test_workers_of_the_cpu(tmp_path):
    """A workers: list of {cpu: true} entries is that many CPU workers."""
    options = parsed(tmp_path, {"workers": [{"cpu": True}] * 3})
    assert (options["gpus"], options["cpu-workers"]) == ("none", 3)


@pytest.mark.parametrize("content, message", [
    ({"workers": [{"gpus": [0]}, {"gpus": [1, 2]}]}, "different devices"),
    ({"workers": [{"gpus": [0]}, {"cpu": True}]}, "different devices"),
    ({"workers": [{"tpu": 1}]}, "'workers[0]'"),
    ({"workers": []}, "'workers' must be a list"),
    ({"global": {"runtime": {"backend": "rocm"}}}, "'global.runtime.backend' must be one of"),
    ({"global": {"runtime": {"threads": 4}}}, "unknown node file key 'global.runtime.threads'"),
    ({"global": {"storage": {}}}, "unknown node file key 'global.storage'"),
    ({"global": {"endpoints": "x"}}, "'global.endpoints' must be a mapping"),
])
def test_bad_seed_keys_are_named(tmp_path, content, message):
    """A node file key of the other supervisors' shape that KCoral cannot honour is refused, named."""
    with pytest.raises(usage.UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parsed(tmp_path, content)


def test_ports_given_beat_the_gateway_defaults(tmp_path):
    """grpc_port and port in the node file (or on the command line) keep the gateway off 8001/8002."""
    options = parsed(tmp_path, {"base_port": 7000, "grpc_port": 7100}, "--port", "7200")
    assert (options["grpc-port"], options["port"]) == (7100, 7200)
    assert worker_grpc_port(options, 1) == 7001


def test_base_ports_0_keep_every_port_ephemeral(tmp_path):
    """Base ports of 0 give every worker an ephemeral port."""
    options = parsed(tmp_path, {"base_port": 0, "metrics_base_port": 0})
    assert [worker_port(options, i) for i in range(2)] == [0, 0]
    assert [worker_grpc_port(options, i) for i in range(2)] == [0, 0]


def test_under_a_router_the_workers_keep_their_ports_and_no_gateway_port_is_set(tmp_path):
    """Under a Router there is no gateway: only the workers take the base ports."""
    options = parsed(tmp_path, {"base_port": 7000, "metrics_base_port": 7100},
                     "--router", "http://127.0.0.1:9000", "--node-id", "a")
    assert options["grpc-port"] is None
    assert [worker_port(options, i) for i in range(2)] == [7100, 7101]


def test_a_worker_serves_grpc_on_its_port(tmp_path):
    """A worker given a gRPC port serves gRPC on it."""
    options = parsed(tmp_path, {"base_port": 7000, "gpus": "none", "cpu_workers": 2})
    from kcoral.node.devices import WorkerSpec

    argv = worker_argv(options.server_config(), WorkerSpec("worker1", 1, None), 7101,
                       worker_grpc_port(options, 1))
    assert argv[argv.index("--grpc-port") + 1] == "7001"
    assert argv[argv.index("--port") + 1] == "7101"


def test_relative_paths_are_the_node_files(tmp_path):
    """Relative paths in a node file are taken from the node file's folder."""
    (tmp_path / "models").mkdir()
    options = parsed(tmp_path, {"model_repo": "models", "cache": {"dir": "cache"},
                                "compilation_cache_dir": "/abs/xla"})
    assert options["model-repository"] == str(tmp_path / "models")
    assert options["cache-dir"] == str(tmp_path / "cache")
    assert options["compilation-cache-dir"] == "/abs/xla"


def test_an_unreadable_repository_is_refused_at_start(tmp_path):
    """A model repository that is not a folder is refused when the options are read."""
    (tmp_path / "models").write_text("not a folder")
    with pytest.raises(usage.UsageError, match="model repository .*models: Not a directory"):
        parsed(tmp_path, {"model_repo": "models"})


def test_load_model_repeats_and_reaches_every_worker(tmp_path):
    """--load-model is repeatable (a list in a node file) and every worker is started with it."""
    (tmp_path / "models").mkdir()
    options = parsed(tmp_path, {"model_repo": "models", "model_control_mode": "explicit",
                                "load_model": ["a", "b"], "gpus": "none", "cpu_workers": 2})
    server = options.server_config()
    assert (server.model_control_mode, server.load_model) == ("explicit", ("a", "b"))
    from kcoral.node.devices import WorkerSpec

    argv = worker_argv(server, WorkerSpec("worker0", 0, None), 0)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--load-model"] == ["a", "b"]
    assert argv[argv.index("--model-control-mode") + 1] == "explicit"
    options = node_tap.Options()
    options.parseOptions(["--model-control-mode", "explicit", "--load-model", "a",
                          "--load-model", "*"])
    assert options.server_config().load_model == ("a", "*")


def test_load_model_needs_explicit_control():
    """--load-model in another model control mode is a usage error naming the mode it needs."""
    with pytest.raises(usage.UsageError, match="--model-control-mode explicit"):
        node_tap.Options().parseOptions(["--load-model", "a"])


def test_max_sequences_reaches_every_worker(tmp_path):
    """max_sequences (node file key, or --max-sequences) bounds each worker's
    live sequences: every worker is started with it."""
    from kcoral.node.devices import WorkerSpec

    options = parsed(tmp_path, {"max_sequences": 64, "gpus": "none", "cpu_workers": 2})
    server = options.server_config()
    assert server.max_sequences == 64
    argv = worker_argv(server, WorkerSpec("worker1", 1, None), 0)
    assert argv[argv.index("--max-sequences") + 1] == "64"
    with pytest.raises(usage.UsageError):
        node_tap.Options().parseOptions(["--max-sequences", "0"])
