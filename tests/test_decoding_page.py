"""
The page "Serving a decoding loop" (doc/decoding.rst), run as written: its
export of bench.sequence's decoder, its two commands (a Router, and a node
behind it), and its tritonclient loop against the Router's gRPC port, with
real processes and real JAX. The page's ports may be taken on a test
machine: the commands run with ephemeral ones, and the client's address is
the Router's. Its tokens must be the decoder's own, stepped in process.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from tests.conftest import server_env
from tests.harness import kcoral_argv
from tests.test_models import grpc_address
from tests.test_routed import FAST_NODE, until_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

jax = pytest.importorskip("jax")
pytest.importorskip("tritonclient.grpc")

PAGE = Path(__file__).parent.parent / "doc" / "decoding.rst"
START_TIMEOUT = 180.0


def literal_blocks(text: str) -> list[str]:
    """The literal blocks of an reStructuredText page (those after a
    paragraph ending in C{::}), dedented."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        block = []
        for following in lines[i + 1:]:
            if following.strip() and not following.startswith("    "):
                break
            block.append(following[4:])
        blocks.append("\n".join(block).strip("\n"))
    return blocks


def block(blocks: list[str], holding: str) -> str:
    """The one block that holds C{holding}."""
    [found] = [b for b in blocks if holding in b]
    return found


def argv_of(command: str, values: dict[str, str]) -> list[str]:
    """The page's C{kcoral ...} command line, each option of C{values} given
    that value instead of the page's."""
    words = shlex.split(command)
    assert words[0] == "kcoral", command
    for i, word in enumerate(words):
        if word in values:
            words[i + 1] = values[word]
    return words[1:]


def in_process(params, steps: int, first: int) -> list[int]:
    """The decoder's tokens from C{first}, stepped with C{jax.jit}."""
    from bench.sequence import decode_step, initial_state

    step = jax.jit(decode_step)
    state, token, tokens = initial_state(), first, []
    for _ in range(steps):
        state, out = step(params, state, np.array([[token]], np.int32))
        token = int(out[0, 0])
        tokens.append(token)
    return tokens


@pytest_twisted.ensureDeferred
async def test_the_decoding_page_runs_as_written(processes, tmp_path):
    """The page's bundle, served by its node behind its Router, answers its
    client's 32 steps of one sequence with the decoder's own tokens."""
    import kcoral
    from bench.sequence import decode_step, init_params, initial_state

    blocks = literal_blocks(PAGE.read_text())
    repository = tmp_path / "repo"
    params = init_params()
    export = block(blocks, "kcoral.export_bundle(decode_step").replace(
        '"repo/decoder"', repr(str(repository / "decoder")))
    exec(export, {"kcoral": kcoral, "np": np, "decode_step": decode_step, "params": params,
                  "initial_state": initial_state})

    router_line, node_line = block(blocks, "kcoral router").splitlines()
    router = await processes.start_service(argv_of(router_line, {"--port": "0",
                                                                 "--grpc-port": "0"}),
                                           name="router")
    address = await grpc_address(router.process)
    node = argv_of(node_line, {"--router": router.url, "--model-repository": str(repository)})
    processes.spawn(kcoral_argv(*node, "--port", "0", "--gpus", "none", *FAST_NODE),
                    name="decoder-a", env=server_env())
    await until_ready(router, "decoder-a", timeout=START_TIMEOUT)

    client = block(blocks, "grpcclient.InferenceServerClient")
    assert '"localhost:8001"' in client and re.search(r"--grpc-port 8001\b", router_line)
    namespace: dict = {}
    await deferToThread(exec, client.replace('"localhost:8001"', repr(address)), namespace)
    assert namespace["tokens"] == in_process(params, 32, 1)
