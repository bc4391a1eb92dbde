"""
A decoding loop served as a sequence model, its KV cache the state each
worker keeps on its device: the steps of the live sequences batched
together (``oldest``) against each sequence's step run alone (``direct``),
side by side on one standalone server.

    .venv/bin/python -m bench.sequence                   # a few minutes on two cores
    .venv/bin/python -m bench.sequence --live 1,16 --steps 16

The model, the decoding toy: a transformer decoder of 4 layers, width 256,
4 heads, an MLP four times as wide, RMS norms, a vocabulary of 256 tied to
the output, float32, and a context of 128. Its state is one sequence's KV
cache (every layer's keys and values for the 128 positions, 1 MiB) and its
position; each step takes a token (``TOKEN``, INT32 ``[-1, 1]``) and
answers the greedy next one (``NEXT``). It is exported twice, the same
program: ``decode_oldest`` (batches of 1 to ``--max-batch`` rows, its
``max_batch_size``) and ``decode_direct`` (one row). The default of 16 is
this toy's best batch on a small CPU: each row reads and rewrites its own
1 MiB cache, so past 16 rows a batch outgrows the caches and a row costs
twice as much (the floors printed show it), and a server of 64 live
sequences does more work in four executions of 16 than in one of 64, as a
Triton user tunes ``max_batch_size``.

For each count of live sequences (``--live``), each sequence is a client
coroutine of tritonclient's gRPC asyncio client that steps its sequence
``--steps`` times, one request after the other's answer (START on the
first, END on the last), all sequences at once, shared among ``--clients``
client processes (one process's event loop, on a small machine, is slow
enough to issue a batch's next steps that executions take half of them):
steps per second over the whole run, each model in turn, ``--rounds``
times (the median and the spread printed), and the mean steps in each of
``oldest``'s executions (the server's statistics). The same clients call a
bare ``grpc.aio`` server that answers at once (``bench.peers.grpc_echo``):
gRPC's own round trip on this host, side by side; and a sequence model
whose step does almost nothing (``count_direct``: its state a count, its
answer the token plus one), run as ``direct``: a step's own cost in KCoral
beside that round trip, with no model's time to take away. Beside them, the model's
own time for one step in this process (``jax.jit``, at batch 1 and at each
count of live sequences), alone and as a server takes it (the rows' states
gathered out of tables and scattered back): the floor no server beats,
and how much a batch of that many rows can gain. Every sequence's tokens
must be the same both ways: the count of those that differ is printed (a
batched step may round differently from a step alone).
``doc/benchmarks.rst`` ("Sequence models") records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.peers.grpc_echo import READY as ECHO_READY
from bench.support.child import SERVER_READY, KCoralChild, write_results
from bench.support.quick import parse_quick

LAYERS, WIDTH, HEADS, CONTEXT, VOCAB = 4, 256, 4, 128, 256
BATCHES = (1, 2, 4, 8, 16, 32, 64)
GRPC = re.compile(r"serving the inference protocol over gRPC on (\S+)")
#: What the bare gRPC server (bench.peers.grpc_echo) is asked for: its one method answers any model.
ECHO = "echo"
#: The sequence model whose step does almost nothing.
COUNT = "count_direct"
MODELS = ("decode_oldest", "decode_direct", COUNT, ECHO)


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

    pos = state["pos"][:, 0]
    at = jax.nn.one_hot(pos, CONTEXT, dtype=jnp.float32)[:, :, None]       # (B, C, 1)
    caches = []

    def cached(layer, k, v):
        keys = state["cache"][:, layer, 0] * (1 - at) + at * k[:, None, :]
        values = state["cache"][:, layer, 1] * (1 - at) + at * v[:, None, :]
        caches.append(jnp.stack([keys, values], axis=1))
        return keys, values

    next_token = _decode(params, token, pos, cached)
    new_state = {"cache": jnp.stack(caches, axis=1),
                 "pos": jnp.minimum(state["pos"] + 1, CONTEXT - 1)}
    return new_state, next_token


def count_step(state, token):
    """A step that does almost nothing: a count kept, the next token the
    token plus one."""
    return {"count": state["count"] + 1}, (token + 1) % VOCAB


def decode_in_place(params, tables, slots, token):
    """L{decode_step} of the sequences in C{slots} of C{tables} (a state a
    row), each row's keys and values written into its table row at its
    position, nothing else of the tables rewritten: given up to it, they
    are written in place."""
    import jax.numpy as jnp

    pos = tables["pos"][slots, 0]
    cache = tables["cache"]

    def cached(layer, k, v):
        nonlocal cache
        cache = cache.at[slots, layer, 0, pos].set(k).at[slots, layer, 1, pos].set(v)
        return cache[slots, layer, 0], cache[slots, layer, 1]

    next_token = _decode(params, token, pos, cached)
    return {"cache": cache, "pos": tables["pos"].at[slots, 0].set(
        jnp.minimum(pos + 1, CONTEXT - 1))}, next_token


def _decode(params, token, pos, cached):
    """The next token of each row, C{cached(layer, k, v)} keeping a layer's
    keys and values at the rows' positions and giving the layer's keys and
    values of the whole context."""
    import jax
    import jax.numpy as jnp

    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    rows, head = token.shape[0], WIDTH // HEADS
    seen = (jnp.arange(CONTEXT)[None, :] <= pos[:, None])[:, None, :]      # (B, 1, C)
    h = params["embed"][token[:, 0]]
    for layer in range(LAYERS):
        x = norm(h)
        q, k, v = (x @ params[w][layer] for w in ("wq", "wk", "wv"))
        keys, values = cached(layer, k, v)
        scores = jnp.einsum("bhd,bchd->bhc", q.reshape(rows, HEADS, head),
                            keys.reshape(rows, CONTEXT, HEADS, head)) / np.sqrt(head)
        weights = jax.nn.softmax(jnp.where(seen, scores, -1e30), axis=-1)
        attended = jnp.einsum("bhc,bchd->bhd", weights, values.reshape(rows, CONTEXT, HEADS, head))
        h = h + attended.reshape(rows, WIDTH) @ params["wo"][layer]
        h = h + jax.nn.gelu(norm(h) @ params["w1"][layer]) @ params["w2"][layer]
    logits = norm(h) @ params["embed"].T
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]


def export(repository: Path, params: dict, max_batch: int) -> None:
    import kcoral

    token = np.zeros((1, 1), np.int32)
    for name, batching, sizes in (("decode_oldest", "oldest",
                                   tuple(b for b in BATCHES if b <= max_batch)),
                                  ("decode_direct", "direct", (1,))):
        kcoral.export_bundle(decode_step, params, token, dir=repository / name, name=name,
                             batch_sizes=sizes, input_names=["TOKEN"], output_names=["NEXT"],
                             state=initial_state(), sequence_batching=batching,
                             max_sequence_idle_seconds=60.0)
    kcoral.export_bundle(count_step, None, token, dir=repository / COUNT, name=COUNT,
                         batch_sizes=(1,), input_names=["TOKEN"], output_names=["NEXT"],
                         state={"count": np.zeros((1, 1), np.int32)}, sequence_batching="direct",
                         max_sequence_idle_seconds=60.0)


def model_ms(params: dict, rows: int, repeats: int = 30) -> tuple[float, float]:
    """The median milliseconds one step of C{rows} rows takes in this
    process: of wall time, and of CPU (on a machine shared with other work,
    wall time measures the others too; CPU time counts every thread of
    XLA's)."""
    import jax

    step = jax.jit(decode_step)
    state = jax.tree.map(lambda a: np.repeat(a, rows, axis=0), initial_state())
    token = np.ones((rows, 1), np.int32)
    return _timed(lambda: jax.block_until_ready(step(params, state, token)), repeats)


def table_ms(params: dict, rows: int, repeats: int = 30) -> tuple[float, float]:
    """As L{model_ms}, a step taken as a server takes it: the rows' states
    gathered out of tables of every slot's (and one of initial states
    for the rows that start), the step run, its new states scattered back
    into the tables given up to that write, its output brought to the host.
    Moving the states costs each row its whole KV cache, read and written
    twice; the step's own arithmetic is shared by the rows."""
    import jax
    import jax.numpy as jnp

    initial = jax.tree.map(jnp.asarray, initial_state())
    tables = jax.tree.map(lambda a: jnp.zeros((rows + 1, *a.shape[1:]), a.dtype), initial)
    slots, starts = jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, bool)
    token = jnp.ones((rows, 1), jnp.int32)

    @jax.jit
    def step(tables, params):
        state = jax.tree.map(lambda table, first: jnp.where(
            starts.reshape(-1, *[1] * (table.ndim - 1)), first, table[slots]), tables, initial)
        return decode_step(params, state, token)

    write = jax.jit(lambda tables, new: jax.tree.map(
        lambda table, rows: table.at[slots].set(rows), tables, new), donate_argnums=0)

    def once() -> None:
        nonlocal tables
        new, outputs = step(tables, params)
        tables = write(tables, new)
        np.asarray(outputs)

    return _timed(once, repeats)


def in_place_ms(params: dict, rows: int, repeats: int = 30) -> tuple[float, float]:
    """As L{table_ms}, the step written in place (L{decode_in_place}): one
    execution that reads each row's cache once and writes only its new
    keys and values, its output brought to the host."""
    import jax
    import jax.numpy as jnp

    tables = jax.tree.map(lambda a: jnp.zeros((rows + 1, *a.shape[1:]), a.dtype),
                          initial_state())
    slots, token = jnp.arange(rows, dtype=jnp.int32), jnp.ones((rows, 1), jnp.int32)
    step = jax.jit(decode_in_place, donate_argnums=1)

    def once() -> None:
        nonlocal tables
        tables, outputs = step(params, tables, slots, token)
        np.asarray(outputs)

    return _timed(once, repeats)


def _timed(run, repeats: int) -> tuple[float, float]:
    """The median milliseconds of wall time and of CPU C{run()} takes,
    after a first run (its compile)."""
    run()
    wall, cpu = [], []
    for _ in range(repeats):
        started, used = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - used)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def executions(address: str, model: str) -> int:
    """How many executions of C{model} the server ran so far (0 of the echo,
    which counts none)."""
    import tritonclient.grpc as grpcclient

    if model == ECHO:
        return 0
    client = grpcclient.InferenceServerClient(address)
    try:
        return int(client.get_inference_statistics(model).model_stats[0].execution_count)
    finally:
        client.close()


def decode(pool, clients: int, address: str, model: str, live: int, steps: int, first_id: int
           ) -> tuple[float, float, list[list[int]]]:
    """C{live} sequences of C{model}, each stepped C{steps} times, shared
    among the C{clients} processes of C{pool}, all starting at once: steps per
    second, the mean steps an execution (0 of the echo), and each
    sequence's tokens."""
    before = executions(address, model)
    started = time.time() + 0.5
    shares = pool.map(_share, [(address, model, range(live)[n::clients], steps, first_id, started)
                               for n in range(clients)], chunksize=1)
    elapsed = max(finished for _, finished in shares) - started
    ran = executions(address, model) - before
    tokens = [[] for _ in range(live)]
    for n, (share, _) in enumerate(shares):
        tokens[n::clients] = share
    return live * steps / elapsed, live * steps / ran if ran else 0.0, tokens


def _share(task) -> tuple[list[list[int]], float]:
    """One client process's share of a run: its sequences' tokens, and when
    the last ended (wall clock)."""
    return asyncio.run(_sequences(*task))


async def _sequences(address: str, model: str, indexes: range, steps: int, first_id: int,
                     started: float) -> tuple[list[list[int]], float]:
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
        # Every process's sequences start together, whenever each process got its share.
        await asyncio.sleep(max(0.0, started - time.time()))
        tokens = await asyncio.gather(*(one(i) for i in indexes))
        return list(tokens), time.time()
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", default="1,16,64", help="counts of live sequences")
    parser.add_argument("--steps", type=int, default=32, help="steps of each sequence")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, the median kept")
    parser.add_argument("--clients", type=int, default=2,
                        help="client processes the live sequences are shared among")
    parser.add_argument("--max-batch", type=int, default=16, choices=BATCHES,
                        help="decode_oldest's max_batch_size (the most rows an execution takes)")
    parser.add_argument("--json", help="write the results here")
    args = parse_quick(parser, live="1,4", steps=4, rounds=1)
    counts = [int(n) for n in args.live.split(",")]
    rows_measured = sorted({1, args.max_batch, *counts})
    params = init_params()
    floor = {rows: model_ms(params, rows) for rows in rows_measured}
    tabled = {rows: table_ms(params, rows) for rows in rows_measured}
    in_place = {rows: in_place_ms(params, rows) for rows in rows_measured}
    results: dict = {"model_ms": floor, "table_ms": tabled, "in_place_ms": in_place, "live": {},
                     "max_batch": args.max_batch}
    with tempfile.TemporaryDirectory() as folder:
        repository = Path(folder) / "repo"
        export(repository, params, args.max_batch)
        server = KCoralChild(["server", "--port", "0", "--grpc-port", "0", "--gpus", "none",
                              "--model-repository", str(repository)],
                             {"grpc": GRPC, "ready": SERVER_READY}, name="server", timeout=600)
        echo = KCoralChild([], {"grpc": ECHO_READY}, name="echo",
                           program=("-m", "bench.peers.grpc_echo"))
        # Started fresh (spawned), not forked from a process that runs JAX.
        pool = multiprocessing.get_context("spawn").Pool(args.clients)
        try:
            address = dict.fromkeys(MODELS, server.found["grpc"])
            address[ECHO] = echo.found["grpc"]
            for model in MODELS:
                decode(pool, args.clients, address[model], model, 2 * args.clients, 2, 1)  # clients warm
            next_id = 1000
            for live in counts:
                rates: dict = {model: [] for model in MODELS}
                tokens: dict = {}
                batched: list[float] = []
                for _ in range(args.rounds):
                    for model in MODELS:
                        rate, per_execution, tokens[model] = decode(
                            pool, args.clients, address[model], model, live, args.steps, next_id)
                        next_id += live
                        rates[model].append(rate)
                        if model == "decode_oldest":
                            batched.append(per_execution)
                differ = sum(a != b for a, b in zip(tokens["decode_oldest"],
                                                    tokens["decode_direct"]))
                median = {model: statistics.median(rates[model]) for model in MODELS}
                results["live"][live] = {"rates": rates, "median": median, "differ": differ,
                                         "oldest_rows": batched}
                print(f"{live:3d} live: oldest {median['decode_oldest']:8.1f} steps/s "
                      f"({_spread(rates['decode_oldest'])}; {statistics.median(batched):4.1f} an "
                      f"execution), alone {median['decode_direct']:8.1f} steps/s "
                      f"({_spread(rates['decode_direct'])}), "
                      f"{median['decode_oldest'] / median['decode_direct']:5.2f}x; "
                      f"{COUNT} {median[COUNT]:8.1f} steps/s ({_spread(rates[COUNT])}); "
                      f"bare gRPC echo {median[ECHO]:8.1f} calls/s ({_spread(rates[ECHO])}); "
                      f"{differ} of {live} sequences' tokens differ", flush=True)
        finally:
            pool.terminate()
            echo.stop()
            server.stop()
    for rows, (wall, cpu) in floor.items():
        # The most batching can give: the model's own steps per second at
        # this batch against one row at a time (by CPU time); then as a
        # server takes the step, its states moved in and out of their tables.
        print(f"in process at batch {rows:3d}: the step {wall:7.2f} ms ({cpu:7.2f} of CPU), "
              f"{rows * floor[1][1] / cpu:5.2f}x the steps per second of batch 1; with its "
              f"states gathered and scattered {tabled[rows][0]:7.2f} ms "
              f"({tabled[rows][1]:7.2f} of CPU), {rows * tabled[1][1] / tabled[rows][1]:5.2f}x; "
              f"written in place {in_place[rows][0]:7.2f} ms ({in_place[rows][1]:7.2f} of CPU), "
              f"{rows * in_place[1][1] / in_place[rows][1]:5.2f}x", flush=True)
    if 1 in results["live"]:
        # A step alone, less the model's own time, beside a call that does nothing.
        alone = results["live"][1]["median"]
        # The model's CPU time: its wall time in process, on a shared
        # machine, swings more than the difference measured.
        step, call, own = 1e3 / alone["decode_direct"], 1e3 / alone[ECHO], tabled[1][1]
        print(f"one sequence alone: a step {step:.2f} ms, of which the model's as a server "
              f"takes it {own:.2f} ms of CPU; the rest {step - own:.2f} ms against a bare gRPC "
              f"round trip of {call:.2f} ms ({(step - own) / call:.2f}x)")
        # The same, with no model's time to take away.
        counted = 1e3 / alone[COUNT]
        print(f"one sequence alone of a step that does almost nothing ({COUNT}): a step "
              f"{counted:.2f} ms against a bare gRPC round trip of {call:.2f} ms "
              f"({counted / call:.2f}x)")
    write_results(results, args.json)


def _spread(rates: list[float]) -> str:
    return f"{min(rates):.0f} to {max(rates):.0f}"


if __name__ == "__main__":
    main()
