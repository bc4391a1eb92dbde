"""
Sequence models served by a real standalone server, driven by tritonclient
as Triton's users drive them (REST, gRPC, gRPC's stream): the models of
examples/triton_models.py --sequences, the answers and words Triton's
clients read, the bound on live sequences, and the live gauge.
"""

from __future__ import annotations

import queue
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
from twisted.internet import threads

from tests.conftest import server_args
from tests.httputil import request
from tests.test_models import start_grpc_front

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "triton_models.py"
SEQUENCE_MODELS = ("simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence")
#: The live sequences the server holds of each model.
MOST = 3


@pytest_twisted.async_fixture(scope="module")
async def front(module_processes, tmp_path_factory):
    """A standalone server of the sequence clients' models, REST and gRPC,
    holding at most MOST sequences a model: its host:port for each."""
    root = tmp_path_factory.mktemp("sequences") / "repo"
    await threads.deferToThread(subprocess.run, [sys.executable, str(EXAMPLES), str(root),
                                                 "--sequences"], check=True, timeout=300)
    await threads.deferToThread(_export_large, root)
    loads = [arg for name in (*SEQUENCE_MODELS, "custom_identity_int32", "large_sum")
             for arg in ("--load-model", name)]
    args = server_args("--model-repository", str(root), "--grpc-port", "0",
                       "--model-control-mode", "explicit", *loads, "--max-sequences", str(MOST))
    address, url, _ = await start_grpc_front(module_processes, "server", args)
    return url.removeprefix("http://"), address


#: large_sum's input: 128 KiB, a request the server reads in a thread.
LARGE = 32768


def _export_large(root: Path) -> None:
    """large_sum: the running sum of its sequence's inputs' sums."""
    import kcoral

    def step(total, x):
        total = total + x.sum(axis=1, keepdims=True)
        return total, total

    kcoral.export_bundle(step, None, np.zeros((1, LARGE), np.float32), dir=root / "large_sum",
                         name="large_sum", state=np.zeros((1, 1), np.float32),
                         input_names=["INPUT"], output_names=["OUTPUT"])


def _input(module, value: int, rows: int = 1):
    tensor = module.InferInput("INPUT", [rows, 1], "INT32")
    tensor.set_data_from_numpy(np.full((rows, 1), value, np.int32))
    return [tensor]


def _steps(module, address: str, model: str, sequences: dict, values: list[int]) -> dict:
    """Each of C{sequences} (id: first value) stepped through C{values}
    interleaved, START on the first step and END on the last: each one's outputs."""
    client = module.InferenceServerClient(address)
    try:
        outputs: dict = {id: [] for id in sequences}
        for i, value in enumerate([None, *values]):
            for id, first in sequences.items():
                result = client.infer(model, _input(module, first if value is None else value),
                                      sequence_id=id, sequence_start=i == 0,
                                      sequence_end=i == len(values))
                outputs[id].append(int(result.as_numpy("OUTPUT")[0, 0]))
        return outputs
    finally:
        client.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
@pytest_twisted.ensureDeferred
async def test_interleaved_sequences(front, module):
    """Two sequences stepped in turn keep their own states: the running sums
    of simple_string_dyna_sequence, each ending with its correlation id (a
    string of digits: its value)."""
    address = front[0] if module is httpclient else front[1]
    got = await threads.deferToThread(_steps, module, address, "simple_string_dyna_sequence",
                                      {3: 10, "4": 20}, [1, 2, 3])
    assert got == {3: [10, 11, 13, 16 + 3], "4": [20, 21, 23, 26 + 4]}


def _stream(address: str) -> list:
    """Two sequences of simple_dyna_sequence sent on one gRPC stream, their
    steps interleaved: each answer (id, output) or error, in order."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for i, value in enumerate([0, 5, 7]):
            for id in (11, 12):
                client.async_stream_infer("simple_dyna_sequence", _input(grpcclient, value),
                                          request_id=f"{id}_{i}", sequence_id=id,
                                          sequence_start=i == 0, sequence_end=i == 2)
        got = [answers.get(timeout=60) for _ in range(6)]
    finally:
        client.stop_stream()
        client.close()
    return [(r.get_response().id.split("_")[0], int(r.as_numpy("OUTPUT")[0, 0])) for r in got]


def _large_stream(address: str, steps: int) -> list:
    """One sequence of large_sum sent on a gRPC stream, its steps not
    waiting for each other's answers: each answer's output, in order."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for i in range(steps):
            tensor = grpcclient.InferInput("INPUT", [1, LARGE], "FP32")
            tensor.set_data_from_numpy(np.full((1, LARGE), i + 1, np.float32))
            client.async_stream_infer("large_sum", [tensor], sequence_id="large",
                                      sequence_start=i == 0, sequence_end=i == steps - 1)
        got = [answers.get(timeout=60) for _ in range(steps)]
    finally:
        client.stop_stream()
        client.close()
    return [float(r.as_numpy("OUTPUT")[0, 0]) for r in got]


@pytest_twisted.ensureDeferred
async def test_large_steps_keep_their_order(front):
    """Steps large enough to be read in threads still run in the order the
    stream sent them: each answer is the running sum up to it."""
    got = await threads.deferToThread(_large_stream, front[1], 8)
    assert got == [LARGE * sum(range(1, i + 2)) for i in range(8)]


#: A request parameter that makes a message large enough to be read in a thread.
PADDING = {"padding": "x" * 96 * 1024}


def _mixed_stream(address: str, values: list[int], headers: dict | None = None) -> list:
    """One sequence of simple_string_dyna_sequence sent on a gRPC stream,
    its steps not waiting for each other's answers, every other one (the
    first among them) padded past 64 KiB, with C{headers}: each answer's
    output, or its error, in order."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result),
                            headers=headers)
        for i, value in enumerate(values):
            client.async_stream_infer("simple_string_dyna_sequence", _input(grpcclient, value),
                                      sequence_id=21, sequence_start=i == 0,
                                      sequence_end=i == len(values) - 1,
                                      parameters=PADDING if i % 2 == 0 else None)
        got = [answers.get(timeout=60) for _ in values]
    finally:
        client.stop_stream()
        client.close()
    return [r if isinstance(r, InferenceServerException) else int(r.as_numpy("OUTPUT")[0, 0])
            for r in got]


@pytest_twisted.ensureDeferred
async def test_large_and_small_steps_keep_their_order(front):
    """A stream's small step sent after a large one (read in a thread)
    does not overtake it: every step is answered, in order, with the
    running sum up to it (the last one plus the sequence's id)."""
    values = list(range(1, 11))
    got = await threads.deferToThread(_mixed_stream, front[1], values)
    assert got == [sum(values[:i + 1]) for i in range(len(values) - 1)] + [sum(values) + 21]


@pytest_twisted.ensureDeferred
async def test_stream_carries_the_controls(front):
    """gRPC's stream carries each request's sequence controls: a first step
    answers its input plus one, the last its input plus the sequence's id."""
    got = await threads.deferToThread(_stream, front[1])
    assert got == [("11", 1), ("12", 1), ("11", 5), ("12", 5), ("11", 7 + 11), ("12", 7 + 12)]


def _refusals(module, address: str) -> list[str]:
    client = module.InferenceServerClient(address)
    messages = []
    try:
        for call in (
                lambda: client.infer("simple_sequence", _input(module, 1)),
                lambda: client.infer("simple_sequence", _input(module, 1), sequence_id=77),
                lambda: client.infer("simple_sequence", _input(module, 1, rows=2), sequence_id=77,
                                     sequence_start=True)):
            with pytest.raises(InferenceServerException) as refused:
                call()
            messages.append(refused.value.message())
        # A sequence id on a model without sequence batching is ignored.
        tensor = module.InferInput("INPUT0", [2, 16], "INT32")
        tensor.set_data_from_numpy(np.arange(32, dtype=np.int32).reshape(2, 16))
        result = client.infer("custom_identity_int32", [tensor], sequence_id=78)
        assert result.as_numpy("OUTPUT0").tolist() == np.arange(32).reshape(2, 16).tolist()
    finally:
        client.close()
    return messages


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
@pytest_twisted.ensureDeferred
async def test_tritons_words(front, module):
    """No id, a sequence never started, a batch of two: refused in Triton's
    words; an id sent to a model without sequence batching is ignored."""
    address = front[0] if module is httpclient else front[1]
    messages = await threads.deferToThread(_refusals, module, address)
    assert ("inference request to model 'simple_sequence' must specify a non-zero or non-empty "
            "correlation ID") in messages[0]
    assert ("inference request for sequence 77 to model 'simple_sequence' must specify the "
            "START flag on the first request of the sequence") in messages[1]
    assert "must specify batch-size 1 due to requirements of sequence batcher" in messages[2]


def _fill(address: str) -> tuple[str, int]:
    """Start MOST + 1 sequences of simple_sequence: the last one's refusal
    and status; then end them all."""
    client = httpclient.InferenceServerClient(address)
    try:
        for id in range(1, MOST + 1):
            client.infer("simple_sequence", _input(httpclient, 0), sequence_id=100 + id,
                         sequence_start=True)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("simple_sequence", _input(httpclient, 0), sequence_id=200,
                         sequence_start=True)
        for id in range(1, MOST + 1):
            client.infer("simple_sequence", _input(httpclient, 0), sequence_id=100 + id,
                         sequence_end=True)
        return refused.value.message(), int(refused.value.status())
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_sequences_full_and_the_gauge(front):
    """Past --max-sequences live sequences of a model, a new one is 503
    sequences_full; kcoral_sequences_live counts them, and ended ones are freed."""
    message, status = await threads.deferToThread(_fill, front[0])
    assert status == 503 and "sequences_full" in message
    metrics = (await request("GET", f"http://{front[0]}/metrics")).body.decode()
    assert 'kcoral_sequences_live{model="simple_sequence"} 0.0' in metrics


@pytest_twisted.ensureDeferred
async def test_config_over_grpc(front):
    """gRPC's config carries sequence_batching as Triton's message."""
    def config():
        client = grpcclient.InferenceServerClient(front[1])
        try:
            return client.get_model_config("simple_dyna_sequence", as_json=True)["config"]
        finally:
            client.close()
    got = (await threads.deferToThread(config))["sequence_batching"]
    assert "oldest" in got
    assert [c["name"] for c in got["control_input"]] == ["START", "END", "READY", "CORRID"]
