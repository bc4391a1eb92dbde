"""
A decoding loop served as a sequence model, its KV cache the state each
worker keeps on its device: the steps of the live sequences batched
together (``oldest``) against each sequence's step run alone (``direct``),
side by side on one standalone server.

    .venv/bin/python bench/sequence.py                   # a few minutes on two cores
    .venv/bin/python bench/sequence.py --live 1,16 --steps 16

The model, the decoding toy: a transformer decoder of 4 layers, width 256,
4 heads, an MLP four times as wide, RMS norms, a vocabulary of 256 tied to
the output, float32, and a context of 128. Its state is one sequence's KV
cache (every layer's keys and values for the 128 positions, 1 MiB) and its
position; each step takes a token (``TOKEN``, INT32 ``[-1, 1]``) and
answers the greedy next one (``NEXT``). It is exported twice, the same
program: ``decode_oldest`` (batches of 1 to 64 rows) and ``decode_direct``
(one row).

For each count of live sequences (``--live``), each sequence is a client
coroutine of tritonclient's gRPC asyncio client that steps its sequence
``--steps`` times, one request after the other's answer (START on the
first, END on the last), all sequences at once; steps per second over the
whole run, each model in turn (``--rounds`` times, the best kept), and
the mean steps in each of ``oldest``'s executions (the server's
statistics). Beside them, the model's own CPU time for one step in this
process (``jax.jit``, at batch 1 and at each count of live sequences): the
floor no server beats, and how much a batch of that many rows can gain.
Every sequence's tokens must be the same both ways: the count of those that
differ is printed (a batched step may round differently from a step alone).
``doc/benchmarks.rst`` ("Sequence models") records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from child import SERVER_READY, KCoralChild, write_results  # noqa: E402

LAYERS, WIDTH, HEADS, CONTEXT, VOCAB = 4, 256, 4, 128, 256
BATCHES = (1, 2, 4, 8, 16, 32, 64)
GRPC = re.compile(r"serving the inference protocol over gRPC on (\S+)")


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def weights(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

    return {"embed": weights(VOCAB, WIDTH), "wq": weights(LAYERS, WIDTH, WIDTH),
            "wk": weights(LAYERS, WIDTH, WIDTH), "wv": weights(LAYERS, WIDTH, WIDTH),
            "wo": weights(LAYERS, WIDTH, WIDTH), "w1": weights(LAYERS, WIDTH, 4 * WIDTH),
            "w2": weights(LAYERS, 4 * WIDTH, WIDTH)}


def initial_state() -> dict:
    """One sequence's state: an empty KV cache, at position 0."""
    return {"cache": np.zeros((1, LAYERS, 2, CONTEXT, WIDTH), np.float32),
            "pos": np.zeros((1, 1), np.int32)}


def decode_step(params, state, token):
    """One greedy step of each row: its token in, the next token out, its
    keys and values written into its cache at its position."""
    import jax
    import jax.numpy as jnp

    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    rows, head = token.shape[0], WIDTH // HEADS
    pos = state["pos"][:, 0]
    at = jax.nn.one_hot(pos, CONTEXT, dtype=jnp.float32)[:, :, None]       # (B, C, 1)
    seen = (jnp.arange(CONTEXT)[None, :] <= pos[:, None])[:, None, :]      # (B, 1, C)
    h = params["embed"][token[:, 0]]
    caches = []
    for layer in range(LAYERS):
        x = norm(h)
        q, k, v = (x @ params[w][layer] for w in ("wq", "wk", "wv"))
        keys = state["cache"][:, layer, 0] * (1 - at) + at * k[:, None, :]
        values = state["cache"][:, layer, 1] * (1 - at) + at * v[:, None, :]
        caches.append(jnp.stack([keys, values], axis=1))
        scores = jnp.einsum("bhd,bchd->bhc", q.reshape(rows, HEADS, head),
                            keys.reshape(rows, CONTEXT, HEADS, head)) / np.sqrt(head)
        weights = jax.nn.softmax(jnp.where(seen, scores, -1e30), axis=-1)
        attended = jnp.einsum("bhc,bchd->bhd", weights, values.reshape(rows, CONTEXT, HEADS, head))
        h = h + attended.reshape(rows, WIDTH) @ params["wo"][layer]
        h = h + jax.nn.gelu(norm(h) @ params["w1"][layer]) @ params["w2"][layer]
    logits = norm(h) @ params["embed"].T
    new_state = {"cache": jnp.stack(caches, axis=1),
                 "pos": jnp.minimum(state["pos"] + 1, CONTEXT - 1)}
    return new_state, jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]


def export(repository: Path, params: dict) -> None:
    import kcoral

    token = np.zeros((1, 1), np.int32)
    for name, batching, sizes in (("decode_oldest", "oldest", BATCHES),
                                  ("decode_direct", "direct", (1,))):
        kcoral.export_bundle(decode_step, params, token, dir=repository / name, name=name,
                             batch_sizes=sizes, input_names=["TOKEN"], output_names=["NEXT"],
                             state=initial_state(), sequence_batching=batching,
                             max_sequence_idle_seconds=60.0)


def model_ms(params: dict, rows: int, repeats: int = 30) -> float:
    """The median milliseconds of CPU one step of C{rows} rows takes in this
    process (CPU time, not wall time: on a machine shared with other work,
    wall time measures the others too)."""
    import jax

    step = jax.jit(decode_step)
    state = jax.tree.map(lambda a: np.repeat(a, rows, axis=0), initial_state())
    token = np.ones((rows, 1), np.int32)
    jax.block_until_ready(step(params, state, token))
    times = []
    for _ in range(repeats):
        started = time.process_time()
        jax.block_until_ready(step(params, state, token))
        times.append(time.process_time() - started)
    return statistics.median(times) * 1e3


async def executions(client, model: str) -> int:
    """How many executions of C{model} the server ran so far."""
    stats = await client.get_inference_statistics(model)
    return int(stats.model_stats[0].execution_count)


async def decode(address: str, model: str, live: int, steps: int, first_id: int
                 ) -> tuple[float, float, list[list[int]]]:
    """C{live} sequences of C{model}, each stepped C{steps} times: steps per
    second, the mean steps an execution, and each sequence's tokens."""
    import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(address)

    async def one(index: int) -> list[int]:
        token, tokens = index % VOCAB, []
        for i in range(steps):
            tensor = aioclient.InferInput("TOKEN", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[token]], np.int32))
            result = await client.infer(model, [tensor], sequence_id=first_id + index,
                                        sequence_start=i == 0, sequence_end=i == steps - 1)
            token = int(result.as_numpy("NEXT")[0, 0])
            tokens.append(token)
        return tokens

    try:
        before = await executions(client, model)
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(live)))
        elapsed = time.perf_counter() - started
        ran = await executions(client, model) - before
        return live * steps / elapsed, live * steps / ran, list(tokens)
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", default="1,16,64", help="counts of live sequences")
    parser.add_argument("--steps", type=int, default=32, help="steps of each sequence")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, the best kept")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    counts = [int(n) for n in args.live.split(",")]
    params = init_params()
    floor = {rows: model_ms(params, rows) for rows in sorted({1, *counts})}
    results: dict = {"model_ms": floor, "live": {}}
    with tempfile.TemporaryDirectory() as folder:
        repository = Path(folder) / "repo"
        export(repository, params)
        server = KCoralChild(["server", "--port", "0", "--grpc-port", "0", "--gpus", "none",
                              "--model-repository", str(repository)],
                             {"grpc": GRPC, "ready": SERVER_READY}, name="server", timeout=600)
        try:
            address = server.found["grpc"]
            asyncio.run(decode(address, "decode_oldest", 2, 2, 1))  # connections warm
            next_id = 1000
            for live in counts:
                best: dict = {}
                tokens: dict = {}
                rows = 0.0
                for _ in range(args.rounds):
                    for model in ("decode_oldest", "decode_direct"):
                        rate, per_execution, tokens[model] = asyncio.run(
                            decode(address, model, live, args.steps, next_id))
                        next_id += live
                        if rate > best.get(model, 0.0):
                            best[model] = rate
                            if model == "decode_oldest":
                                rows = per_execution
                differ = sum(a != b for a, b in zip(tokens["decode_oldest"],
                                                    tokens["decode_direct"]))
                results["live"][live] = {**best, "differ": differ, "oldest_rows": rows}
                print(f"{live:3d} live: oldest {best['decode_oldest']:8.1f} steps/s "
                      f"({rows:4.1f} an execution), "
                      f"alone {best['decode_direct']:8.1f} steps/s, "
                      f"{best['decode_oldest'] / best['decode_direct']:5.2f}x; "
                      f"{differ} of {live} sequences' tokens differ", flush=True)
        finally:
            server.stop()
    for rows, ms in floor.items():
        # The most batching can give: the model's own steps per second at
        # this batch against one row at a time.
        print(f"the model's own step in process at batch {rows:3d}: {ms:7.2f} ms of CPU, "
              f"{rows * floor[1] / ms:5.2f}x the steps per second of batch 1")
    write_results(results, args.json)


if __name__ == "__main__":
    main()
