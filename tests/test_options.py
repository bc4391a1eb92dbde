"""
The command-line options of the Router and of a server or node: defaults,
environment fallbacks, precedence, hidden supervisor options, and the
C{kcoral} command's answer to bad options.
"""

from __future__ import annotations

import attrs
import pytest
from twisted.python import usage

from kcoral import cli
from kcoral.node.config import default_front_processes
from kcoral.router.service import RouterConfig
from kcoral.taps import node as node_tap
from kcoral.taps import router as router_tap

ENVIRONMENT = ("KCORAL_NODE_TOKEN", "KCORAL_ROUTER_ENDPOINT", "KCORAL_NODE_ID", "KCORAL_GPUS",
               "KCORAL_CPU_WORKERS")
SUPERVISOR_DEFAULTS = {
    "health-interval-seconds": 2, "health-timeout-seconds": 1, "failure-threshold": 3,
    "startup-grace-seconds": 30, "stable-reset-seconds": 60, "termination-grace-seconds": 5,
    "restart-min-delay-seconds": 1, "restart-max-delay-seconds": 30, "restart-jitter": 0.2,
}
ROUTER = ["--router", "http://127.0.0.1:9000", "--node-id", "gpu-a"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


def router_options(*argv):
    options = router_tap.Options()
    options.parseOptions(list(argv))
    return options


def node_options(*argv):
    options = node_tap.Options()
    options.parseOptions(list(argv))
    return options


def run_cli(capsys, *argv):
    """C{kcoral ARGV} in process: its exit status, stdout and stderr."""
    try:
        status = cli.main(list(argv))
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


# -- defaults ---------------------------------------------------------------------------------

def test_router_defaults_are_the_documented_ones():
    """The Router's options default to the documented values."""
    o = router_options()
    assert o["host"] == "127.0.0.1"
    assert o["port"] == 9000
    assert o["status-check-interval-seconds"] == 1
    assert o["max-status-age-seconds"] == 5
    assert o["unhealthy-threshold"] == 3
    assert o["recovery-threshold"] == 2
    assert o["queue-wait-timeout-seconds"] == 1800
    assert o["max-queued-requests"] == 1024
    assert o["node-retention-seconds"] == 600
    assert o["max-request-bytes"] == 268435456 == 256 * 1024 * 1024
    assert o["node-token"] is None


def test_router_config_carries_every_option():
    """Every Router option reaches its RouterConfig field."""
    config = router_options(
        "--host", "0.0.0.0", "--port", "9100", "--status-check-interval-seconds", "0.5",
        "--max-status-age-seconds", "7", "--unhealthy-threshold", "4", "--recovery-threshold", "5",
        "--queue-wait-timeout-seconds", "60", "--max-queued-requests", "10",
        "--node-retention-seconds", "30", "--max-request-bytes", "1000", "--node-token", "t",
    ).router_config()
    assert (config.host, config.port, config.status_check_interval_seconds,
            config.max_status_age_seconds, config.unhealthy_threshold, config.recovery_threshold,
            config.queue_wait_timeout_seconds, config.max_queued_requests,
            config.node_retention_seconds, config.max_request_bytes, config.node_token) == (
        "0.0.0.0", 9100, 0.5, 7.0, 4, 5, 60.0, 10, 30.0, 1000, "t")


def test_router_config_defaults_match_the_options():
    """The Router options' defaults are RouterConfig's."""
    assert attrs.asdict(router_options().router_config()) == attrs.asdict(RouterConfig())


def test_node_defaults():
    """The node's options default to the documented values."""
    o = node_options()
    assert o["host"] == "127.0.0.1"
    assert o["port"] == 8000
    assert o["gpus"] == "0"
    assert o["cpu-workers"] == 1
    assert o["router"] is None and o["node-id"] is None and o["node-token"] is None
    assert o["advertise-host"] is None
    assert o["max-request-bytes"] == 268435456
    for name, default in SUPERVISOR_DEFAULTS.items():
        assert o[name] == default, name


# -- environment -----------------------------------------------------------------------------

def test_router_token_from_the_environment(monkeypatch):
    """The Router's node token falls back to KCORAL_NODE_TOKEN; the command line wins."""
    monkeypatch.setenv("KCORAL_NODE_TOKEN", "from-env")
    assert router_options()["node-token"] == "from-env"
    assert router_options("--node-token", "from-cli")["node-token"] == "from-cli"


def test_node_settings_from_the_environment(monkeypatch):
    """The node's Router, id and token fall back to their environment variables."""
    monkeypatch.setenv("KCORAL_ROUTER_ENDPOINT", "http://router.example:9000")
    monkeypatch.setenv("KCORAL_NODE_ID", "gpu-env")
    monkeypatch.setenv("KCORAL_NODE_TOKEN", "token-env")
    o = node_options()
    assert o["router"] == "http://router.example:9000"
    assert o["node-id"] == "gpu-env"
    assert o["node-token"] == "token-env"


def test_the_command_line_beats_the_environment(monkeypatch):
    """An option on the command line beats its environment variable."""
    monkeypatch.setenv("KCORAL_ROUTER_ENDPOINT", "http://router.example:9000")
    monkeypatch.setenv("KCORAL_NODE_ID", "gpu-env")
    monkeypatch.setenv("KCORAL_NODE_TOKEN", "token-env")
    o = node_options("--router", "http://other:9001", "--node-id", "gpu-cli",
                     "--node-token", "token-cli")
    assert (o["router"], o["node-id"], o["node-token"]) == ("http://other:9001", "gpu-cli", "token-cli")
    o = node_options("--node-id=gpu-cli")
    assert (o["router"], o["node-id"]) == ("http://router.example:9000", "gpu-cli")


def test_an_empty_environment_variable_is_unset(monkeypatch):
    """An empty environment variable leaves the option unset."""
    monkeypatch.setenv("KCORAL_NODE_TOKEN", "")
    assert router_options()["node-token"] is None


def test_the_node_id_may_come_from_the_environment(monkeypatch):
    """--router takes its node id from KCORAL_NODE_ID."""
    monkeypatch.setenv("KCORAL_NODE_ID", "gpu-env")
    o = node_options("--router", "http://127.0.0.1:9000")
    assert o["node-id"] == "gpu-env"


def test_the_router_may_come_from_the_environment_and_then_needs_a_node_id(monkeypatch):
    """A Router from the environment needs a node id too."""
    monkeypatch.setenv("KCORAL_ROUTER_ENDPOINT", "http://127.0.0.1:9000")
    with pytest.raises(usage.UsageError):
        node_options()


# -- checks ----------------------------------------------------------------------------------

def test_router_without_node_id_is_a_usage_error():
    """--router without --node-id is a usage error naming --node-id."""
    with pytest.raises(usage.UsageError) as e:
        node_options("--router", "http://127.0.0.1:9000")
    assert "--node-id" in str(e.value)


def test_grpc_port_under_a_router_is_a_usage_error():
    """--grpc-port with --router, where no gateway would serve it, is a usage
    error that sends the user to the Router's own option."""
    with pytest.raises(usage.UsageError) as e:
        node_options(*ROUTER, "--grpc-port", "8001")
    assert "--grpc-port" in str(e.value) and "Router" in str(e.value)
    assert node_options("--cpu-workers", "2", "--grpc-port", "8001")["grpc-port"] == 8001


def test_front_processes_need_the_gateways_grpc_port():
    """More than one front process without --grpc-port, or under a Router (whose node has
    no gateway), is a usage error naming the option."""
    for argv in (("--cpu-workers", "2", "--front-processes", "2"),
                 (*ROUTER, "--front-processes", "2")):
        with pytest.raises(usage.UsageError) as e:
            node_options(*argv)
        assert "--front-processes" in str(e.value)


def test_front_processes_put_a_gateway_before_one_worker():
    """--front-processes above one makes even a node of one worker supervised (its gateway
    serves the port with them); one, or the default, leaves a standalone server alone."""
    assert node_options("--grpc-port", "0", "--front-processes", "2").supervised
    assert not node_options("--grpc-port", "0", "--front-processes", "1").supervised
    assert node_options("--grpc-port", "0")["front-processes"] == default_front_processes()


def test_front_processes_follow_the_cores(monkeypatch):
    """One front process for every four cores this process may run on, and at least one."""
    for cores, count in ((1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (64, 16)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, cores=cores: set(range(cores)))
        assert default_front_processes() == count


@pytest.mark.parametrize("jitter", ["-0.01", "0.51", "1", "nan"])
def test_restart_jitter_outside_its_range_is_a_usage_error(jitter):
    """A jitter outside 0-0.5 is a usage error naming the option."""
    with pytest.raises(usage.UsageError) as e:
        node_options(*ROUTER, "--restart-jitter", jitter)
    assert "restart-jitter" in str(e.value)


@pytest.mark.parametrize("jitter", ["0", "0.25", "0.5"])
def test_restart_jitter_within_its_range(jitter):
    """A jitter within 0-0.5, bounds included, is taken."""
    assert node_options(*ROUTER, "--restart-jitter", jitter)["restart-jitter"] == float(jitter)


@pytest.mark.parametrize("argv", [
    ["--port", "-1"], ["--port", "65536"], ["--port", "abc"],
    ["--queue-wait-timeout-seconds", "-5"], ["--queue-wait-timeout-seconds", "nan"],
    ["--status-check-interval-seconds", "0"], ["--status-check-interval-seconds", "nan"],
    ["--max-status-age-seconds", "-1"], ["--unhealthy-threshold", "0"],
    ["--recovery-threshold", "1.5"], ["--max-queued-requests", "-1"],
    ["--node-retention-seconds", "-1"], ["--max-request-bytes", "0"],
])
def test_bad_router_values_are_usage_errors(argv):
    """A refused Router value is a usage error that names its option."""
    with pytest.raises(usage.UsageError) as e:
        router_options(*argv)
    assert argv[0] in str(e.value)  # the message names the option


def test_hidden_supervisor_options_are_accepted():
    """The supervisor options are accepted with --router and carry their values."""
    o = node_options(*ROUTER, "--health-interval-seconds", "0.5", "--health-timeout-seconds", "0.25",
                     "--failure-threshold", "5", "--startup-grace-seconds", "0",
                     "--stable-reset-seconds", "10", "--termination-grace-seconds", "2",
                     "--restart-min-delay-seconds", "0.1", "--restart-max-delay-seconds", "3",
                     "--restart-jitter", "0.1")
    assert (o["health-interval-seconds"], o["health-timeout-seconds"], o["failure-threshold"],
            o["startup-grace-seconds"], o["stable-reset-seconds"], o["termination-grace-seconds"],
            o["restart-min-delay-seconds"], o["restart-max-delay-seconds"], o["restart-jitter"]) == (
        0.5, 0.25, 5, 0.0, 10.0, 2.0, 0.1, 3.0, 0.1)


def test_hidden_supervisor_options_are_left_out_of_help():
    """The supervisor options are left out of --help, and still work after it."""
    text = node_tap.Options().getUsage()
    for name in SUPERVISOR_DEFAULTS:
        assert name not in text
    for name in ("--router", "--node-id", "--node-token", "--gpus", "--cpu-workers",
                 "--advertise-host", "--max-request-bytes", "--port", "--host"):
        assert name in text
    # and they are still there after --help was rendered
    assert node_options(*ROUTER, "--failure-threshold", "7")["failure-threshold"] == 7


def test_router_help_lists_every_option():
    """The Router's --help lists every option and the token's variable."""
    text = router_tap.Options().getUsage()
    for name in ("--host", "--port", "--status-check-interval-seconds", "--max-status-age-seconds",
                 "--unhealthy-threshold", "--recovery-threshold", "--queue-wait-timeout-seconds",
                 "--max-queued-requests", "--node-retention-seconds", "--max-request-bytes",
                 "--node-token", "KCORAL_NODE_TOKEN"):
        assert name in text


def test_the_plugins_use_the_same_options():
    """The twistd plugins use the kcoral command's Options classes."""
    from twisted.plugins import kcoral_plugins

    assert kcoral_plugins.kcoralRouter.options is router_tap.Options
    assert kcoral_plugins.kcoralNode.options is node_tap.Options
    assert kcoral_plugins.kcoralRouter.tapname == "kcoral-router"
    assert kcoral_plugins.kcoralNode.tapname == "kcoral-node"


# -- the kcoral command ------------------------------------------------------------------------

@pytest.mark.parametrize("argv,named", [
    (["router", "--bogus"], "--bogus"),
    (["router", "--port", "-1"], "--port"),
    (["router", "--queue-wait-timeout-seconds", "-5"], "--queue-wait-timeout-seconds"),
    (["server", "--router", "http://127.0.0.1:9000"], "--node-id"),
    (["server", *ROUTER, "--restart-jitter", "0.6"], "--restart-jitter"),
    (["server", "--cpu-workers", "0"], "--cpu-workers"),
    (["server", "--health-interval-seconds", "3"], "--router"),
    (["nonsense"], "nonsense"),
    ([], "command"),
])
def test_bad_options_exit_2_with_a_one_line_error(capsys, argv, named):
    """Bad options exit 2 with one error line that names the problem."""
    status, out, err = run_cli(capsys, *argv)
    assert status == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1, err
    line = errors[0]
    assert line.startswith("kcoral") and named in line
    assert "kcoral :" not in line


def test_help_lists_options_and_exits_0(capsys):
    """--help exits 0 and lists the options, hidden ones left out."""
    status, out, _ = run_cli(capsys, "router", "--help")
    assert status == 0 and "--max-queued-requests" in out and "--front-processes" not in out
    status, out, _ = run_cli(capsys, "server", "--help")
    assert status == 0 and "--node-id" in out and "--restart-jitter" not in out
    status, out, _ = run_cli(capsys, "--help")
    assert status == 0 and "router" in out and "server" in out


def test_version(capsys):
    """--version prints the version and exits 0."""
    from kcoral._version import __version__

    status, out, _ = run_cli(capsys, "--version")
    assert status == 0 and __version__ in out


@pytest.mark.parametrize("argv, ports", [
    (["--cpu-workers", "2"], [8001, 8002]),                             # the gateway holds 8000
    (["--cpu-workers", "2", "--port", "0"], [0, 0]),
    ([*ROUTER, "--cpu-workers", "2", "--port", "9100"], [9100, 9101]),  # no gateway
    (["--cpu-workers", "2", "--listen", "tcp:8001"], [0, 0]),           # not 8001 twice
    (["--cpu-workers", "2", "--listen", "tcp:8443", "--port", "9100"], [9101, 9102]),
])
def test_worker_ports(argv, ports):
    """Each worker's port follows --port, the gateway and --listen."""
    from kcoral.node.supervisor import worker_port

    options = node_options("--gpus", "none", *argv)
    assert [worker_port(options, i) for i in range(2)] == ports


def test_node_options_default_to_the_configs():
    """The node options' defaults are ServerConfig's, NodeConfig's and RestartSettings'."""
    from kcoral.common.serverconfig import ServerConfig
    from kcoral.node.config import NodeConfig
    from kcoral.node.restart import RestartSettings

    o = node_options()
    assert o.server_config() == ServerConfig()
    assert o.node_config() == NodeConfig()
    assert o.restart_settings() == RestartSettings()


def test_node_options_reach_their_configs():
    """A node option given on the command line reaches its config field."""
    o = node_options(*ROUTER, "--capacity", "5", "--advertise-host", "10.0.0.7",
                     "--failure-threshold", "4", "--node-token", "t")
    assert o.server_config().capacity == 5 and o.server_config().secured is True
    assert o.node_config().advertise_host == "10.0.0.7"
    assert o.node_config().restart.failure_threshold == 4


def test_a_node_file_value_is_checked_like_the_option(tmp_path):
    """A node file's value goes through its option's check, and a refusal names the key."""
    path = tmp_path / "node.yaml"
    path.write_text("supervisor:\n  failure_threshold: 0\n")
    with pytest.raises(usage.UsageError) as e:
        node_options(*ROUTER, "--config", str(path))
    assert "supervisor.failure_threshold" in str(e.value) and "positive" in str(e.value)
    path.write_text("capacity: 3\n")
    assert node_options("--config", str(path))["capacity"] == 3


def test_batch_invariant_from_the_command_line_or_the_node_file(tmp_path):
    """--batch-invariant, or the node file's batch_invariant: true, reaches ServerConfig and
    each worker's command line; off by default; a node file value other than true or false
    is refused, naming the key."""
    from kcoral.node.devices import WorkerSpec
    from kcoral.node.supervisor import worker_argv

    def worker(options) -> list[str]:
        return worker_argv(options.server_config(), WorkerSpec("worker0", 0, None), 8001)

    path = tmp_path / "node.yaml"
    assert node_options().server_config().batch_invariant is False
    assert "--batch-invariant" not in worker(node_options("--cpu-workers", "2"))
    assert node_options("--batch-invariant").server_config().batch_invariant is True
    path.write_text("batch_invariant: true\n")
    options = node_options("--cpu-workers", "2", "--config", str(path))
    assert options.server_config().batch_invariant is True
    assert "--batch-invariant" in worker(options)
    path.write_text("batch_invariant: false\n")
    assert node_options("--config", str(path)).server_config().batch_invariant is False
    path.write_text("batch_invariant: 1\n")
    with pytest.raises(usage.UsageError, match="'batch_invariant' must be true or false"):
        node_options("--config", str(path))
