"""
Which workers a node runs: one per GPU named by C{--gpus} (or per
C{--devices-per-worker} of them), CPU workers with C{--gpus none} or on a
host without a GPU, each of C{--devices-per-worker} host devices.
"""

from __future__ import annotations

import os
import stat

import pytest
from twisted.python import usage

from kcoral.common.hostdevices import host_device_flags
from kcoral.node import devices
from kcoral.node.devices import WorkerSpec, detect_gpus, plan_workers
from kcoral.node.supervisor import worker_argv
from kcoral.taps.node import NodeOptions

FOUR = ["0", "1", "2", "3"]


def test_default_gpu_zero():
    """By default a host with GPUs runs one worker on GPU 0."""
    specs, account = plan_workers("0", 1, FOUR)
    assert specs == [WorkerSpec("worker0", 0, "0")]
    assert "GPU 0" in account


def test_all_gpus():
    """--gpus all runs one worker per GPU found."""
    specs, account = plan_workers("all", 1, FOUR)
    assert [(s.name, s.index, s.gpus) for s in specs] == [
        ("worker0", 0, "0"), ("worker1", 1, "1"), ("worker2", 2, "2"), ("worker3", 3, "3")]
    assert account.startswith("4 GPU worker(s)")


def test_a_list_of_gpus():
    """A GPU list runs one worker per listed GPU, in its order."""
    specs, _ = plan_workers("2, 0", 1, FOUR)
    # worker i listens on port + i, in the order given
    assert [(s.name, s.index, s.gpus) for s in specs] == [("worker0", 0, "2"), ("worker1", 1, "0")]


def test_gpus_none_runs_cpu_workers():
    """--gpus none runs --cpu-workers CPU workers, and says why."""
    specs, account = plan_workers("none", 3, FOUR)
    assert [(s.name, s.index, s.gpus) for s in specs] == [
        ("worker0", 0, None), ("worker1", 1, None), ("worker2", 2, None)]
    assert "--gpus none" in account and "3 CPU worker(s)" in account


@pytest.mark.parametrize("gpus", ["4", "0,7", "all,9", "-1"])
def test_an_unknown_gpu_index_is_refused(gpus):
    """A GPU the host lacks is refused, naming the ones it has."""
    with pytest.raises(ValueError) as e:
        plan_workers(gpus, 1, FOUR)
    assert "0, 1, 2, 3" in str(e.value)


@pytest.mark.parametrize("gpus", ["0", "all", "0,1"])
def test_no_gpu_falls_back_to_cpu_workers(gpus):
    """A host without GPUs falls back to CPU workers, said in one line."""
    specs, account = plan_workers(gpus, 2, [])
    assert [s.gpus for s in specs] == [None, None]
    assert "no GPU found" in account and "2 CPU worker(s)" in account
    assert "\n" not in account  # one log line


@pytest.mark.parametrize("gpus", [",", " , ", ""])
def test_an_empty_gpu_list_is_refused(gpus):
    """A GPU list that names no GPU is refused."""
    with pytest.raises(ValueError):
        plan_workers(gpus, 1, FOUR)


def test_the_same_gpu_twice_is_refused():
    """A GPU named twice is refused."""
    with pytest.raises(ValueError) as e:
        plan_workers("1,1", 1, FOUR)
    assert "1" in str(e.value)


def test_worker_environment_isolates_devices(monkeypatch):
    """Each worker sees only its own GPU, a CPU worker none and no host split."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    gpu, cpu = WorkerSpec("worker1", 1, "3"), WorkerSpec("worker0", 0, None)
    assert gpu.env == {"CUDA_VISIBLE_DEVICES": "3"}
    assert gpu.gpus_argument == "0"  # the only device the child sees
    assert cpu.env == {"CUDA_VISIBLE_DEVICES": ""}
    assert cpu.gpus_argument == "none"


# -- several devices per worker ----------------------------------------------------

def test_gpus_are_split_into_workers_of_n():
    """--gpus 0,1,2,3 --devices-per-worker 2: two workers of two GPUs, in the order named."""
    specs, account = plan_workers("0,1,2,3", 1, FOUR, 2)
    assert specs == [WorkerSpec("worker0", 0, "0,1", 2), WorkerSpec("worker1", 1, "2,3", 2)]
    assert account == "2 GPU worker(s) on GPU 0,1; 2,3"
    assert specs[1].env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    # The child numbers the GPUs it sees from 0.
    assert specs[1].gpus_argument == "0,1"


def test_all_gpus_split_in_fours():
    """--gpus all with --devices-per-worker 4 on a four-GPU host: one worker owning them all."""
    specs, _ = plan_workers("all", 1, FOUR, 4)
    assert specs == [WorkerSpec("worker0", 0, "0,1,2,3", 4)]


@pytest.mark.parametrize("gpus, n", [("0,1,2", 2), ("all", 3), ("1", 2)])
def test_a_count_that_does_not_divide_is_refused(gpus, n):
    """A GPU count that --devices-per-worker does not divide is refused, naming both."""
    with pytest.raises(ValueError) as e:
        plan_workers(gpus, 1, FOUR, n)
    assert f"--devices-per-worker {n} does not divide" in str(e.value)


def test_cpu_workers_get_n_host_devices(monkeypatch):
    """On the CPU each worker splits the host into N devices, before JAX starts, keeping other XLA flags."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false "
                       "--xla_force_host_platform_device_count=8")
    specs, account = plan_workers("none", 2, FOUR, 2)
    assert specs == [WorkerSpec("worker0", 0, None, 2), WorkerSpec("worker1", 1, None, 2)]
    assert account == "--gpus none: 2 CPU worker(s) of 2 host devices each"
    assert specs[0].env == {"CUDA_VISIBLE_DEVICES": "", "XLA_FLAGS": (
        "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2")}
    assert specs[0].gpus_argument == "none"


def test_host_device_flags_replace_a_count_and_keep_the_rest():
    """The host device count is set once, whatever count the flags held before."""
    assert host_device_flags("", 3) == "--xla_force_host_platform_device_count=3"
    assert host_device_flags("--a=1 --xla_force_host_platform_device_count=2 --b", 1) == (
        "--a=1 --b --xla_force_host_platform_device_count=1")


# -- detection -------------------------------------------------------------------

def _fake_smi(directory, script: str):
    path = directory / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_detect_gpus_reads_nvidia_smi(tmp_path, monkeypatch):
    """GPUs are found by their nvidia-smi indices."""
    _fake_smi(tmp_path, 'printf "0\\n1\\n\\n 2 \\n"')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus() == ["0", "1", "2"]


def test_detect_gpus_when_nvidia_smi_fails(tmp_path, monkeypatch):
    """A failing nvidia-smi means no GPU."""
    _fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed" ; exit 9')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus() == []


def test_detect_gpus_without_nvidia_smi(tmp_path, monkeypatch):
    """Without nvidia-smi there is no GPU, and PATH is left as it was."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert devices.shutil.which("nvidia-smi") is None
    assert detect_gpus() == []
    assert os.environ["PATH"] == str(tmp_path)


# -- the option ---------------------------------------------------------------------

def options(*argv: str) -> NodeOptions:
    parsed = NodeOptions()
    parsed.parseOptions(list(argv))
    return parsed


def test_devices_per_worker_reaches_each_worker():
    """--devices-per-worker is a server setting: each worker is started with it."""
    parsed = options("--gpus", "0,1,2,3", "--devices-per-worker", "2")
    assert parsed.supervised
    server = parsed.server_config()
    assert server.devices_per_worker == 2
    spec = WorkerSpec("worker1", 1, "2,3", 2)
    argv = worker_argv(server, spec, 8001)
    assert argv[argv.index("--gpus") + 1] == "0,1"
    assert argv[argv.index("--devices-per-worker") + 1] == "2"


@pytest.mark.parametrize("argv, supervised", [
    (("--gpus", "0,1", "--devices-per-worker", "2"), False),  # one worker: a server
    (("--gpus", "0,1"), True),
    (("--gpus", "none", "--devices-per-worker", "4"), False),
    (("--gpus", "none", "--cpu-workers", "2", "--devices-per-worker", "2"), True),
])
def test_one_worker_of_several_devices_is_a_server(argv, supervised):
    """As many GPUs as one worker owns make a standalone server, not a supervisor."""
    assert options(*argv).supervised is supervised


def test_the_node_file_takes_devices_per_worker(tmp_path):
    """A node file's devices_per_worker applies, and the command line beats it."""
    path = tmp_path / "node.yaml"
    path.write_text("gpus: none\ndevices_per_worker: 4\n")
    assert options("--config", str(path)).server_config().devices_per_worker == 4
    assert options("--config", str(path), "--devices-per-worker", "2")["devices-per-worker"] == 2


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_device_count_is_a_usage_error(value):
    """--devices-per-worker is a positive integer."""
    with pytest.raises(usage.UsageError, match="--devices-per-worker"):
        options("--devices-per-worker", value)
