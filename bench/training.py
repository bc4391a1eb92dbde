"""
A training loop on kept arrays, side by side with the same loop in process
and with the loop that sends its state every step.

    .venv/bin/python -m bench.training                  # about three minutes on two cores
    .venv/bin/python -m bench.training --steps 5 --ways floor,kept
    .venv/bin/python -m bench.training --gpus 0         # the worker and the floor on GPU 0

The model: an MLP of four 2048x2048 float32 dense layers (64 MiB of weights,
plus 32 KiB of biases), trained with Adam (written here in jax.numpy: its
two moments double the state to 192 MiB) on batches of 128 rows of 2048
float32 inputs (1 MiB) and their int32 labels, new every step. One step
program, ``step(params, opt_state, x, y) -> (params, opt_state, loss)``,
exported once, run four ways from the same start on the same batches:

``floor``
   in process: ``jax.jit(step)``, the state on JAX's device (the CPU, or
   GPU N with ``--gpus N``), the loss read back every step.
``kept``
   a standalone ``kcoral server --port 0`` (one worker): the state put
   once (``Client.put``), then each step ``client.run(step, params,
   opt_state, x, y, keep=True)``, the loss fetched and the previous
   step's arrays deleted, so that only the batch travels.
``resend``
   the same server, as a client without kept arrays does it: the state
   sent and the new state brought back every step. The client's content
   cache spares nothing once the parameters have changed.
``router``
   ``kept`` through a ``kcoral router`` with one node (``kcoral server
   --router URL --node-id bench``), the Router's hop on every request.

Each remote way is warmed first (program uploaded, compiled) by a step
whose results are thrown away; the floor's warm-up compiles. Steps per
second over the timed steps; the bytes each step moved on the client's
connection, as the kernel counts them (``TCP_INFO``: HTTP heads included;
the client's own ``bytes_sent`` counts request bodies only, and it counts
nothing received). The final parameters of every way must equal the
floor's, and so must the losses, bit for bit on the CPU (on a GPU, within
float32 rounding): otherwise the exit status is 1 (0 whatever the speed).

Targets: the kept ways' request bodies (``bytes_sent``) are at most the
batch plus 64 KiB a step; they run
at least 0.8x the floor's steps per second, and at least 5x the ``resend``
way's, through the Router too. ``doc/benchmarks.rst`` ("Kept arrays:
training and decoding") records a run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from bench.support.child import command_line, start_jax, write_results
from bench.support.kept_loops import (
    Traffic,
    Way,
    clients,
    machine,
    print_context,
    table,
    take_turns,
    way_row,
)
from bench.support.quick import parse_quick

LAYERS = 4
WIDTH = 2048  # LAYERS x WIDTH x WIDTH float32: 64 MiB of weights
BATCH = 128  # BATCH x WIDTH float32: 1 MiB of inputs a step
LEARNING_RATE, BETA1, BETA2, EPSILON = 1e-3, 0.9, 0.999, 1e-8
WAYS = ("floor", "kept", "resend", "router")

TARGET_EXTRA_BYTES = 64 * 1024
TARGET_FLOOR_RATIO = 0.8
TARGET_RESEND_RATIO = 5.0


# -- the model ----------------------------------------------------------------------

def initial_state(rng):
    """The parameters and Adam's state, as numpy arrays."""
    params = [{"w": rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) / np.float32(np.sqrt(WIDTH)),
               "b": np.zeros(WIDTH, np.float32)} for _ in range(LAYERS)]
    zeros = [{k: np.zeros_like(a) for k, a in layer.items()} for layer in params]
    opt_state = {"count": np.zeros((), np.int32), "m": zeros,
                 "v": [{k: a.copy() for k, a in layer.items()} for layer in zeros]}
    return params, opt_state


def batches(rng, steps: int):
    """C{steps} batches whose label is the index of the largest input: a
    task the MLP can learn, so that the losses mean something."""
    for _ in range(steps):
        x = rng.standard_normal((BATCH, WIDTH), dtype=np.float32)
        yield x, x.argmax(axis=1).astype(np.int32)


def loss_of(params, x, y):
    import jax
    import jax.numpy as jnp

    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def step(params, opt_state, x, y):
    """One step of Adam on the batch (x, y)."""
    import jax
    import jax.numpy as jnp

    loss, grads = jax.value_and_grad(loss_of)(params, x, y)
    count = opt_state["count"] + 1
    m = jax.tree.map(lambda m, g: BETA1 * m + (1 - BETA1) * g, opt_state["m"], grads)
    v = jax.tree.map(lambda v, g: BETA2 * v + (1 - BETA2) * g * g, opt_state["v"], grads)
    t = count.astype(jnp.float32)
    size = LEARNING_RATE * jnp.sqrt(1 - BETA2 ** t) / (1 - BETA1 ** t)
    params = jax.tree.map(lambda p, m, v: p - size * m / (jnp.sqrt(v) + EPSILON), params, m, v)
    return params, {"count": count, "m": m, "v": v}, loss


# -- the ways -----------------------------------------------------------------------

def stand_in(tree):
    """Ones in C{tree}'s structure, which the loop never sends: a way warmed
    on the loop's own arrays (its first batch, the zero moments) would leave
    them in the server's content cache, and spare its first step."""
    import jax

    return jax.tree.map(np.ones_like, tree)


class Floor(Way):
    """In process: C{jax.jit(step)}, the state on C{device}."""

    name = "floor"

    def __init__(self, params, opt_state, warm, device):
        import jax

        super().__init__()
        self._step = jax.jit(step)
        self._state = jax.device_put((params, opt_state), device)
        jax.block_until_ready(self._step(*self._state, *warm))

    def step(self, batch) -> float:
        params, opt_state, loss = self._step(*self._state, *batch)
        self._state = params, opt_state
        return float(loss)

    def final(self):
        import jax

        return jax.tree.map(np.asarray, self._state[0])


class Kept(Way):
    """
    The state put once and kept on the worker; each step sends the batch,
    fetches the loss (which waits for the step: a kept run answers once its
    outputs are placed, not computed) and frees the previous step's arrays:
    a worker keeps a bounded number of bytes, and 192 MiB a step soon
    passes it.
    """

    def __init__(self, name: str, client, program, params, opt_state, warm):
        import jax

        super().__init__()
        self.name, self._client, self._program = name, client, program
        started = time.perf_counter()
        self._state = jax.tree.map(client.put, (params, opt_state))
        self.put_seconds = time.perf_counter() - started
        client.delete(*jax.tree.leaves(client.run(program, *self._state, *warm, keep=True)))
        self.traffic = Traffic(client)
        self.fetching = self.deleting = 0.0

    def step(self, batch) -> float:
        import jax

        *state, loss = self._client.run(self._program, *self._state, *batch, keep=True)
        fetched = time.perf_counter()
        value = float(loss.fetch())
        deleted = time.perf_counter()
        self._client.delete(*jax.tree.leaves(self._state), loss)
        self.fetching += deleted - fetched
        self.deleting += time.perf_counter() - deleted
        self._state = tuple(state)
        return value

    def final(self):
        import jax

        params = jax.tree.map(np.asarray, self._state[0])
        self._client.delete(*jax.tree.leaves(self._state))
        return params


class Resend(Way):
    """Without kept arrays: the state sent and brought back every step."""

    name = "resend"

    def __init__(self, client, program, params, opt_state, warm):
        super().__init__()
        self._client, self._program = client, program
        client.run(program, *stand_in((params, opt_state)), *warm)
        self._state = params, opt_state
        self.traffic = Traffic(client)

    def step(self, batch) -> float:
        *state, loss = self._client.run(self._program, *self._state, *batch)
        self._state = tuple(state)
        return float(loss)

    def final(self):
        return self._state[0]


# -- the run ------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each way (default 20)")
    parser.add_argument("--turn", type=int, default=5,
                        help="steps each way runs before the next way's turn (default 5)")
    parser.add_argument("--gpus", default="none",
                        help="the worker's --gpus and, unless 'none', the floor's GPU (default: the CPU)")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help=f"which ways to run, of {', '.join(WAYS)} (default: all)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parse_quick(parser, steps=3)
    wanted = args.ways.split(",")
    if unknown := set(wanted) - set(WAYS):
        parser.error(f"no such way: {', '.join(sorted(unknown))}")

    device = start_jax(args.gpus)
    import jax

    from kcoral import Program

    rng = np.random.default_rng(0)
    params, opt_state = initial_state(rng)
    data = list(batches(rng, args.steps))
    warm = stand_in(data[0])
    results = {"command": command_line(), **machine(),
               "jax": jax.__version__, "device": str(device), "steps": args.steps,
               "exact": args.gpus == "none",
               "state_bytes": sum(a.nbytes for a in jax.tree.leaves((params, opt_state))),
               "batch_bytes": sum(a.nbytes for a in data[0])}
    print(f"device: {device}; state {results['state_bytes']:,} B, batch {results['batch_bytes']:,} B, "
          f"{args.steps} steps", flush=True)
    program = Program.from_function(step, params, opt_state, *warm)
    with clients(args.gpus, {"kept", "resend"} & set(wanted), "router" in wanted) as (server, router):
        made = {"floor": lambda: Floor(params, opt_state, warm, device),
                "kept": lambda: Kept("kept", server, program, params, opt_state, warm),
                "resend": lambda: Resend(server, program, params, opt_state, warm),
                "router": lambda: Kept("router", router, program, params, opt_state, warm)}
        ways = []
        for name in wanted:
            ways.append(made[name]())
            print(f"{name}: ready", flush=True)
        results["outside_cores"] = take_turns(ways, data, args.turn)
        finals = {way.name: way.final() for way in ways}
    results["load_after"] = os.getloadavg()
    results["ways"] = {way.name: summary(way) for way in ways}
    same = judge(results, finals)
    write_results(results, args.json)
    return 0 if same else 1


def summary(way: Way) -> dict:
    found = {"seconds": way.seconds, "losses": way.records}
    if way.traffic is not None:
        found.update(sent=way.traffic.sent, received=way.traffic.received, bodies=way.traffic.bodies)
    if isinstance(way, Kept):
        found.update(put_seconds=way.put_seconds, fetch_seconds=way.fetching,
                     delete_seconds=way.deleting)
    return found


def matches(a, b, exact: bool) -> bool:
    """Bit for bit on the CPU; on a GPU, where the worker's compiled program
    and C{jax.jit}'s may fuse differently, within float32 rounding."""
    return np.array_equal(a, b) if exact else np.allclose(a, b, rtol=1e-4, atol=1e-6)


def judge(results: dict, finals: dict) -> bool:
    """Print the table and the targets; whether every way's final
    parameters and losses equal the floor's."""
    import jax

    ways, steps = results["ways"], results["steps"]
    base = ways.get("floor")
    rows, same = [], True
    for name, way in ways.items():
        way["steps_per_second"] = steps / way["seconds"]
        if base is not None and way is not base:
            pairs = zip(jax.tree.leaves((finals[name], way["losses"])),
                        jax.tree.leaves((finals["floor"], base["losses"])), strict=True)
            way["equal"] = all(matches(a, b, results["exact"]) for a, b in pairs)
            same = same and way["equal"]
        rows.append(way_row(name, way, steps, "steps_per_second", base, (2, 1)))
    print_context(results)
    print(f"state {results['state_bytes']:,} B (params and Adam's moments), batch "
          f"{results['batch_bytes']:,} B, {steps} timed steps")
    print(table(["way", "steps/s", "ms/step", "/ floor", "body B/step", "sent B/step",
                 "received B/step", "= floor"], rows))
    for name in ("kept", "router"):
        if name in ways and "fetch_seconds" in ways[name]:
            way = ways[name]
            print(f"{name}: put {way['put_seconds']:.2f} s once; per step "
                  f"{1000 * way['fetch_seconds'] / steps:.1f} ms fetching the loss (it waits for "
                  f"the step), {1000 * way['delete_seconds'] / steps:.1f} ms deleting")
    print()
    limit = results["batch_bytes"] + TARGET_EXTRA_BYTES
    results["targets"] = []
    for name in ("kept", "router"):
        if name not in ways:
            continue
        way = ways[name]
        checks = [(f"request bodies <= batch + 64 KiB ({limit:,} B) a step",
                   way["bodies"] / steps <= limit, f"{way['bodies'] / steps:,.0f} B")]
        if base:
            ratio = way["steps_per_second"] / base["steps_per_second"]
            checks.append((f">= {TARGET_FLOOR_RATIO}x the floor's steps/s", ratio >= TARGET_FLOOR_RATIO,
                           f"{ratio:.2f}x"))
        if "resend" in ways:
            ratio = way["steps_per_second"] / ways["resend"]["steps_per_second"]
            checks.append((f">= {TARGET_RESEND_RATIO:g}x resend's steps/s", ratio >= TARGET_RESEND_RATIO,
                           f"{ratio:.1f}x"))
        for what, met, value in checks:
            print(f"{name}: {what}: {value} ({'met' if met else 'NOT met'})")
            results["targets"].append({"way": name, "target": what, "value": value, "met": met})
    verdict = ("equal to" if results["exact"] else "within float32 rounding of") + " the floor's"
    if not same:
        verdict = "NOT " + verdict
    print(f"final parameters and losses of {', '.join(w for w in ways if w != 'floor') or 'no way'}: "
          f"{verdict}" if base else "no floor to compare with")
    return same


if __name__ == "__main__":
    sys.exit(main())
