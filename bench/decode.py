"""
Greedy decoding with the KV cache kept on the worker, side by side with the
same loop in process.

    .venv/bin/python -m bench.decode                # about a minute on two cores
    .venv/bin/python -m bench.decode --layers 4 --ways floor,kept
    .venv/bin/python -m bench.decode --gpus 0       # the worker and the floor on GPU 0

The model: a transformer decoder (d_model 512, 8 heads, an MLP four times
as wide, RMS norms, a vocabulary of 1024 tied to the output), float32, its
layers stacked and scanned. Unless ``--layers`` says how many, their number
is calibrated in process so that one decoding step takes about ``--step-ms``
(10 ms). One program, ``decode_step(params, cache, token, pos) -> (cache,
next_token)``, exported once; the cache holds every layer's keys and values
for the 64 positions of the run. 64 tokens greedy from token 1, three ways:

``floor``
   in process: ``jax.jit(decode_step)``, the parameters and cache on JAX's
   device, each next token read back as the next step's input.
``kept``
   a standalone ``kcoral server --port 0``: parameters and the empty cache
   put once, then each step one request, ``client.run(decode_step, params,
   cache, token, pos, keep=(True, False), free=cache)``: the new cache stays
   on the worker, the next token (four bytes) comes back with the answer,
   and the previous cache is freed once the step succeeded.
``router``
   ``kept`` through a ``kcoral router`` with one node.

The ways take turns of 16 tokens. Tokens per second from the median time
of a token (the mean too, in the JSON: a burst of other work on the shared
machine moves the median less); the bytes each token moved on the client's
connection (request bodies, the client's ``bytes_sent``; and the wire,
heads included, as the kernel counts it). The generated tokens must equal the floor's: otherwise the exit
status is 1 (0 whatever the speed).

Targets: at most 1 KiB of request bodies a token, and at least 0.9x the
floor's tokens per second (0.85x through the Router): about 1.1 ms (1.8 ms)
a token beside a 10 ms step. The time each way spends a token beyond the
floor's is printed too: the service's own share, which the ratio hides
when the floor itself moves with the machine's load. ``doc/benchmarks.rst`` ("Kept arrays: training
and decoding") records a run.
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
from kcoral.common.serverconfig import ServerConfig

D_MODEL = 512
HEADS = 8
VOCAB = 1024
TOKENS = 64
FIRST_TOKEN = 1
WAYS = ("floor", "kept", "router")

TARGET_BYTES = 1024
#: The least tokens/s of each way, as a share of the floor's: through a
#: Router, a hop more.
TARGET_FLOOR_RATIO = {"kept": 0.9, "router": 0.85}


# -- the model ----------------------------------------------------------------------

def initial_params(rng, layers: int) -> dict:
    def dense(*shape):
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-2]))

    d = D_MODEL
    return {"embed": rng.standard_normal((VOCAB, d), dtype=np.float32),
            "position": rng.standard_normal((TOKENS, d), dtype=np.float32),
            "layers": {"norm1": np.ones((layers, d), np.float32), "qkv": dense(layers, d, 3 * d),
                       "out": dense(layers, d, d), "norm2": np.ones((layers, d), np.float32),
                       "up": dense(layers, d, 4 * d), "down": dense(layers, 4 * d, d)},
            "norm": np.ones(d, np.float32)}


def empty_cache(layers: int) -> np.ndarray:
    """Every layer's keys and values, for every position of the run."""
    return np.zeros((layers, 2, TOKENS, D_MODEL), np.float32)


def rms_norm(x, gain):
    import jax.numpy as jnp

    return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x) + 1e-6)) * gain


def decode_step(params, cache, token, pos):
    """The cache with position C{pos} filled in, and the most likely token after C{token}."""
    import jax
    import jax.numpy as jnp

    heads, width = HEADS, D_MODEL // HEADS

    def layer(x, inputs):
        weights, kv = inputs
        q, k, v = jnp.split(rms_norm(x, weights["norm1"]) @ weights["qkv"], 3)
        kv = jax.lax.dynamic_update_slice(kv, jnp.stack([k, v])[:, None, :], (0, pos, 0))
        keys, values = kv.reshape(2, TOKENS, heads, width)
        scores = jnp.einsum("hd,thd->ht", q.reshape(heads, width), keys) / np.sqrt(width)
        scores = jnp.where(jnp.arange(TOKENS) <= pos, scores, -jnp.inf)
        attended = jnp.einsum("ht,thd->hd", jax.nn.softmax(scores, axis=-1), values)
        x = x + attended.reshape(D_MODEL) @ weights["out"]
        x = x + jax.nn.gelu(rms_norm(x, weights["norm2"]) @ weights["up"]) @ weights["down"]
        return x, kv

    x = params["embed"][token] + params["position"][pos]
    x, cache = jax.lax.scan(layer, x, (params["layers"], cache))
    logits = rms_norm(x, params["norm"]) @ params["embed"].T
    return cache, jnp.argmax(logits).astype(jnp.int32)


def step_seconds(layers: int, device) -> float:
    """The median time of one in-process decoding step of a model of C{layers}."""
    import jax

    params = jax.device_put(initial_params(np.random.default_rng(1), layers), device)
    cache = jax.device_put(empty_cache(layers), device)
    jitted = jax.jit(decode_step)
    times = []
    for pos in range(TOKENS // 2):
        started = time.perf_counter()
        cache, token = jitted(params, cache, np.int32(FIRST_TOKEN), np.int32(pos))
        int(token)
        times.append(time.perf_counter() - started)
    return float(np.median(times[2:]))


def calibrate(target: float, device) -> int:
    """The number of layers whose step takes about C{target} seconds. A
    step's time grows with its layers, but not along the line through small
    models: a layer costs more once the parameters outgrow the caches (a
    line through 1 and 3 layers gave steps of 7.4 to 14.2 ms for a target
    of 10). So each guess is timed whole and scaled by how far it missed,
    until one is within 5 %; the closest timed is kept, or more layers where
    a guess ran faster a layer. A guess's time is the fastest of four
    medians: this host runs the same step at 3.7 or 6.9 ms in spells of
    about a second, and a calibration in a slow one gave 12 layers where 21
    take 10 ms, and steps of 6 ms once it had passed."""
    timed: dict[int, float] = {}
    layers = 8
    while layers not in timed and len(timed) < 5:
        timed[layers] = seconds = min(step_seconds(layers, device) for _ in range(4))
        print(f"calibration: {layers} layers, {1000 * seconds:.2f} ms", flush=True)
        if abs(seconds - target) <= 0.05 * target:
            break
        layers = max(1, min(48, round(layers * target / seconds)))
    closest = min(timed, key=lambda n: abs(timed[n] - target))
    fastest = min(timed[n] / n for n in timed)
    layers = max(closest, min(48, round(target / fastest)))
    print(f"calibration: {layers} layers for {1000 * target:.0f} ms", flush=True)
    return layers


# -- the ways -----------------------------------------------------------------------

class Floor(Way):
    """In process: C{jax.jit(decode_step)}, parameters and cache on C{device}."""

    name = "floor"

    def __init__(self, params, cache, device):
        import jax

        super().__init__()
        self._step = jax.jit(decode_step)
        self._params, self._cache = jax.device_put((params, cache), device)
        jax.block_until_ready(self._step(self._params, self._cache, np.int32(0), np.int32(0)))
        self._token = np.int32(FIRST_TOKEN)

    def step(self, pos: int) -> int:
        self._cache, token = self._step(self._params, self._cache, self._token, np.int32(pos))
        self._token = np.int32(token)
        return int(self._token)


class Kept(Way):
    """
    Parameters and cache kept on the worker: each step sends the token and
    its position, and gets the next token back, the new cache kept and the
    previous one freed (as a server of many conversations would have to),
    in one request.
    """

    def __init__(self, name: str, client, program, params, cache):

        super().__init__()
        self.name, self._client, self._program = name, client, program
        started = time.perf_counter()
        self._params = client.put(params)  # one request
        self._cache = client.put(cache)    # beside them
        self.put_seconds = time.perf_counter() - started
        client.delete(client.run(program, self._params, self._cache, np.int32(0), np.int32(0),
                                 keep=(True, False))[0])
        self._token = np.int32(FIRST_TOKEN)
        self.traffic = Traffic(client)

    def step(self, pos: int) -> int:
        self._cache, token = self._client.run(
            self._program, self._params, self._cache, self._token, np.int32(pos),
            keep=(True, False), free=self._cache)
        self._token = np.int32(token)
        return int(self._token)

    def close(self) -> None:
        import jax

        self._client.delete(self._cache, *jax.tree.leaves(self._params))


# -- the run ------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, help="the decoder's layers (default: calibrated)")
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="the in-process step the calibration aims at (default 10)")
    parser.add_argument("--turn", type=int, default=16,
                        help="tokens each way decodes before the next way's turn (default 16)")
    parser.add_argument("--gpus", default="none",
                        help="the worker's --gpus and, unless 'none', the floor's GPU (default: the CPU)")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help=f"which ways to run, of {', '.join(WAYS)} (default: all)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parse_quick(parser, layers=1)
    wanted = args.ways.split(",")
    if unknown := set(wanted) - set(WAYS):
        parser.error(f"no such way: {', '.join(sorted(unknown))}")

    device = start_jax(args.gpus)
    import jax

    from kcoral import Program

    layers = args.layers or calibrate(args.step_ms / 1000, device)
    params = initial_params(np.random.default_rng(0), layers)
    cache = empty_cache(layers)
    results = {"command": command_line(), **machine(),
               "jax": jax.__version__, "device": str(device), "layers": layers, "tokens": TOKENS,
               "param_bytes": sum(a.nbytes for a in jax.tree.leaves(params)),
               "cache_bytes": cache.nbytes}
    print(f"device: {device}; {layers} layers, parameters {results['param_bytes']:,} B, "
          f"cache {cache.nbytes:,} B", flush=True)
    program = Program.from_function(decode_step, params, cache, np.int32(0), np.int32(0))
    # The parameters go in one request: a calibration on a fast host can
    # pass the services' default bound on a request's body (256 MiB).
    bound = ["--max-request-bytes",
             str(max(ServerConfig().max_request_bytes, 2 * results["param_bytes"]))]
    with clients(args.gpus, "kept" in wanted, "router" in wanted, *bound) as (server, router):
        made = {"floor": lambda: Floor(params, cache, device),
                "kept": lambda: Kept("kept", server, program, params, cache),
                "router": lambda: Kept("router", router, program, params, cache)}
        ways = []
        for name in wanted:
            ways.append(made[name]())
            print(f"{name}: ready", flush=True)
        results["outside_cores"] = take_turns(ways, list(range(TOKENS)), args.turn)
        for way in ways:
            if isinstance(way, Kept):
                way.close()
    results["load_after"] = os.getloadavg()
    results["ways"] = {way.name: summary(way) for way in ways}
    same = judge(results)
    write_results(results, args.json)
    return 0 if same else 1


def summary(way: Way) -> dict:
    found = {"seconds": way.seconds, "median_seconds": float(np.median(way.times)),
             "tokens": way.records}
    if way.traffic is not None:
        found.update(sent=way.traffic.sent, received=way.traffic.received, bodies=way.traffic.bodies)
    if isinstance(way, Kept):
        found.update(put_seconds=way.put_seconds)
    return found


def judge(results: dict) -> bool:
    """Print the table and the targets; whether every way's tokens equal the floor's."""
    ways, count = results["ways"], results["tokens"]
    base = ways.get("floor")
    rows, same = [], True
    for name, way in ways.items():
        way["tokens_per_second"] = 1 / way["median_seconds"]
        way["mean_tokens_per_second"] = count / way["seconds"]
        if base is not None and way is not base:
            way["equal"] = way["tokens"] == base["tokens"]
            same = same and way["equal"]
        rows.append(way_row(name, way, count, "tokens_per_second", base, (1, 2)))
    print_context(results)
    print(f"{results['layers']} layers, parameters {results['param_bytes']:,} B, cache "
          f"{results['cache_bytes']:,} B, {count} tokens")
    print(table(["way", "tokens/s", "ms/token", "/ floor", "body B/token", "sent B/token",
                 "received B/token", "= floor"], rows))
    for name, way in ways.items():
        if "put_seconds" in way:
            print(f"{name}: putting the parameters and the cache took {way['put_seconds']:.2f} s, once")
    print()
    results["targets"] = []
    for name in ("kept", "router"):
        if name not in ways:
            continue
        way = ways[name]
        checks = [(f"request bodies <= {TARGET_BYTES:,} B a token", way["bodies"] / count <= TARGET_BYTES,
                   f"{way['bodies'] / count:,.0f} B")]
        if base:
            ratio = way["tokens_per_second"] / base["tokens_per_second"]
            least = TARGET_FLOOR_RATIO[name]
            checks.append((f">= {least}x the floor's tokens/s", ratio >= least, f"{ratio:.2f}x"))
            way["beyond_floor_seconds"] = beyond = way["median_seconds"] - base["median_seconds"]
            print(f"{name}: {1000 * beyond:.2f} ms a token beyond the floor's")
        for what, met, value in checks:
            print(f"{name}: {what}: {value} ({'met' if met else 'NOT met'})")
            results["targets"].append({"way": name, "target": what, "value": value, "met": met})
    verdict = "equal to the floor's" if same else "NOT equal to the floor's"
    print(f"tokens of {', '.join(w for w in ways if w != 'floor') or 'no way'}: {verdict}"
          if base else "no floor to compare with")
    return same


if __name__ == "__main__":
    sys.exit(main())
