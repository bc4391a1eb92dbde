#!/usr/bin/env bash
# The GPU check: one prepared run on a machine with an NVIDIA GPU and JAX with
# its CUDA plugin already installed, which reaches no package index. Here,
# beforehand: `make gpu-carry` (the wheels of what that machine lacks, in
# .whl/); there, from the repository root, with .whl/ beside the tree:
#
#     bash bench/gpu_check.sh            # logs and summary.txt under $OUT (or gpu-check/)
#
# The machine's own python3 and its JAX run everything (PYTHON overrides it):
# no virtualenv, which would hide them. The steps, each with its own limit,
# all of them together within ten minutes (a device call's limit):
#
# 1. install: the carried wheels, with no index and nothing resolved, into a
#    throwaway folder put first on PYTHONPATH; then every requirement of the
#    project followed through what that Python finds (bench.gpu_carry check);
# 2. devices: nvidia-smi and the devices JAX sees, which must be GPUs; then
#    CUDA shared memory as Triton's clients share it: a region exported by
#    this process, opened by KCoral's opener in another, read into JAX and
#    written back, then an inference through two regions on a server on the
#    same GPU, over REST and gRPC (bench.cudashm_check);
# 3. node: a node of one worker on GPU 0 (a supervisor, its gateway and the
#    worker, confined as by default), its /health (the gpu_target, and the
#    sandbox the worker says it runs in, the same as the worker's own), no
#    node token in the worker's environment, and one run through the gateway
#    checked against JAX in process;
# 4. conformance: the quick conformance set against a server on GPU 0, bit for
#    bit against JAX on the same GPU (tests/test_conformance.py);
# 5. two-devices: a program exported for two devices, refused by a worker of
#    one GPU with not_enough_devices;
# 6. serving, training: the named models' serving benchmark over gRPC (KCoral
#    and the in-process floor only, concurrency 1, 16, 64 and 256) and the
#    training loop on kept arrays, each
#    skipped with a line saying why until the tree holds the feature and its
#    benchmark module.
#
# A failed step is reported and the next one runs (except after a failed
# install: nothing else could). The exit status is the number of failed steps;
# the summary table comes last. KCORAL_GPU_CHECK_PLATFORM=cpu rehearses the
# same run on the CPU of a machine without a GPU (host devices, nproc for
# nvidia-smi), KCORAL_GPU_CHECK_SHORT=1 shortens the long steps, and
# KCORAL_GPU_WHEELS names another folder of wheels (tests/test_gpu_check.py
# does all three).
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
MODE=${KCORAL_GPU_CHECK_PLATFORM:-gpu}
WHEELS=${KCORAL_GPU_WHEELS:-$ROOT/.whl}
RESULTS=${OUT:-$ROOT/gpu-check}
case "$MODE" in
    gpu) GPUS=0 ;;
    cpu) GPUS=none; export JAX_PLATFORMS=cpu ;;
    *) echo "KCORAL_GPU_CHECK_PLATFORM is gpu or cpu, not '$MODE'" >&2; exit 2 ;;
esac
export GPUS PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"
SITE=$(mktemp -d)
# The carried wheels come before anything of the same name that Python has.
export PYTHONPATH=$SITE:$ROOT

# Servers run in sessions of their own, out of reach of timeout's signals: every
# process this run starts carries this mark in its environment, and whatever
# still carries it when the run ends is killed.
export KCORAL_GPU_CHECK_RUN=${KCORAL_GPU_CHECK_RUN:-gpu-check-$$-$RANDOM}
finish() {
    local environ pid
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}
        pid=${pid%/environ}
        [ "$pid" = $$ ] && continue
        if tr '\0' '\n' 2>/dev/null < "$environ" | grep -qx "KCORAL_GPU_CHECK_RUN=$KCORAL_GPU_CHECK_RUN"; then
            kill -9 "$pid" 2>/dev/null
        fi
    done
    rm -rf "$SITE"
}
trap finish EXIT
trap 'exit 143' TERM INT

failed=0
rows=()

record() {  # record NAME RESULT SECONDS NOTE: one row of the summary
    rows+=("$(printf '%-12s %-8s %5s s  %s' "$1" "$2" "$3" "$4")")
}

step() {  # step NAME SECONDS COMMAND...: run it with a limit, its output kept
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s)"
    local started=$SECONDS
    # In the background: bash runs a trap (a TERM at the outer limit) only
    # once the command in the foreground has ended; a wait it interrupts.
    # Standard input stays the step's (a script on it), not /dev/null.
    timeout --kill-after=10 "$limit" "$@" <&0 > "$RESULTS/$name.log" 2>&1 &
    wait $!
    local rc=$?
    tail -n "${TAIL:-25}" "$RESULTS/$name.log"
    echo "== $name: exit $rc after $((SECONDS - started)) s"
    # Each step ends its output with the line that says what it found.
    local last
    last=$(grep -v '^[[:space:]]*$' "$RESULTS/$name.log" | tail -n 1 | cut -c1-90)
    if [ "$rc" -eq 0 ]; then
        record "$name" ok "$((SECONDS - started))" "$last"
    else
        [ "$rc" -eq 124 ] && last="over its ${limit} s limit"
        record "$name" FAILED "$((SECONDS - started))" "$last"
        failed=$((failed + 1))
    fi
    return "$rc"
}

hook() {  # hook NAME SECONDS PROBE MODULE ARGS...: a step for a feature the tree may not hold yet
    local name=$1 limit=$2 probe=$3 module=$4
    shift 4
    local why=
    if [ ! -f "${module//.//}.py" ]; then
        why="no $module in this tree"
    elif ! "$PY" -c "$probe" > /dev/null 2>&1; then
        why="'$probe' fails: the feature is not in this tree"
    fi
    if [ -n "$why" ]; then
        echo "== $name: skipped, $why" | tee "$RESULTS/$name.log"
        record "$name" skipped 0 "$why"
        return 0
    fi
    TAIL=40 step "$name" "$limit" "$PY" -m "$module" "$@"
}

summary() {
    {
        echo "== gpu check ($MODE, $PY): $failed failed step(s); logs in $RESULTS"
        printf '%s\n' "${rows[@]}"
    } | tee "$RESULTS/summary.txt"
}

step install 60 bash -c '[ -f "$2/requirements.txt" ] || { echo "no wheels in $2: make gpu-carry here first"; exit 1; }
    "$0" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$1" "$2"/*.whl && "$0" -m bench.gpu_carry check "$2"' "$PY" "$SITE" "$WHEELS" || {
    summary
    exit "$failed"
}

if [ "$MODE" = gpu ]; then
    step devices 90 bash -c 'nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv \
        && "$0" -c "import jax; print(jax.__version__, jax.devices()); assert jax.devices()[0].platform == \"gpu\"" \
        && "$0" -m bench.cudashm_check --gpus 0' "$PY"
else
    step devices 45 bash -c 'echo "$(nproc) cores, no GPU: the CPU rehearsal" \
        && "$0" -c "import jax; print(jax.__version__, jax.devices()); assert jax.devices()[0].platform == \"cpu\""' "$PY"
fi

step node 75 "$PY" - <<'EOF'
"""A node on the device under check, its worker confined as by default: the
sandbox it reports, its environment, and one run against JAX in process."""
import json
import os
import signal
import sys
import urllib.request

# The node's finally below must run when the step's limit is reached.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
import numpy as np

from bench.support.child import KCoralChild, start_jax

gpus = os.environ["GPUS"]
device = start_jax(gpus)
import jax

from kcoral import Client, Program


def health(url):
    with urllib.request.urlopen(url + "/health", timeout=10) as answer:
        return json.loads(answer.read())


# A supervisor (--metrics-base-port: one worker behind the node's gateway),
# given a node token that its worker must not inherit.
token = "gpu-check-node-token"
node = KCoralChild(["server", "--port", "0", "--grpc-port", "0", "--metrics-base-port", "0",
                    "--gpus", gpus],
                   {"url": r"kcoral gateway listening on (http://\S+)",
                    "pid": r"worker0 started \(pid (\d+)\)",
                    "worker": r"worker0 is ready at (http://\S+)"},
                   name="node", env={"KCORAL_NODE_TOKEN": token})
try:
    url = node.found["url"]
    gateway = health(url)
    print("health:", json.dumps(gateway))
    sandbox = gateway["workers"][0]["sandbox"]
    assert sandbox == health(node.found["worker"])["sandbox"], "the node's listing is not the worker's"
    assert sandbox["mode"] == "auto" and sandbox["no_new_privs"] is True, sandbox
    with open(f"/proc/{node.found['pid']}/environ", "rb") as environ:
        assert token.encode() not in environ.read(), "the worker inherited the node token"

    def f(x, w):
        return jax.numpy.tanh(x @ w).sum(axis=0)

    x = np.random.default_rng(0).standard_normal((256, 512), dtype=np.float32)
    w = np.random.default_rng(1).standard_normal((512, 512), dtype=np.float32)
    with Client(url) as client:
        got = np.asarray(client.run(Program.from_function(f, x, w), x, w))
    want = np.asarray(jax.jit(f)(x, w))
    # Bit for bit is the conformance step's check (against the exported
    # program in process); jax.jit(f) may fuse differently.
    difference = float(np.abs(got - want).max())
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), f"the node's answer is not JAX's ({difference})"
    layers = f"seccomp {sandbox['seccomp']}, landlock {sandbox['landlock_abi']}"
    print(f"{gateway['gpu_target']} on {device}, confined ({layers}); a run within {difference:.2g}")
finally:
    node.stop()
EOF

conformance=(tests/test_conformance.py -q -p no:cacheprovider --maxfail=10)
[ -n "${KCORAL_GPU_CHECK_SHORT:-}" ] && conformance+=(-k "identity or pytree")
if [ "$MODE" = gpu ]; then
    # JAX_PLATFORMS=cuda: the in-process reference on the same GPU as the
    # server, where JAX would otherwise take most of the memory up front.
    TAIL=8 step conformance 150 env KCORAL_TEST_GPUS=0 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
        "$PY" -m pytest "${conformance[@]}"
else
    TAIL=8 step conformance 150 "$PY" -m pytest "${conformance[@]}"
fi

step two-devices 60 "$PY" - <<'EOF'
"""A program exported for two devices, refused by a worker that owns one."""
import os
import signal
import sys

signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
from kcoral.node.devices import host_device_flags

# Two host devices to export over, in this process only: the server owns
# what --gpus gives it, one device a worker.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), 2)
from bench.support.child import SERVER_READY, KCoralChild

from kcoral import Client, ProgramRejected
from tests import conformance

gpus = os.environ["GPUS"]
case = next(c for c in conformance.cases(False) if c.name == "sharded.matmul")
program = conformance.export(case)
print(f"{case.name}: exported for {program.nr_devices} devices on {', '.join(program.platforms)}")
server = KCoralChild(["server", "--port", "0", "--gpus", gpus],
                     {"url": r"kcoral server listening on (http://\S+)", "ready": SERVER_READY},
                     name="server",
                     # A server on the GPU keeps none of this process's host settings.
                     env={"XLA_FLAGS": None, **({} if gpus == "none" else {"JAX_PLATFORMS": None})})
try:
    with Client(server.found["url"], busy_timeout=0, timeout=60) as client:
        try:
            client.run(program, *case.calls[0].args)
        except ProgramRejected as e:
            assert e.reason == "not_enough_devices", f"refused, but as {e.reason}: {e}"
            print(f"refused as it should be: {e.status} {e.reason}: {e}")
        else:
            raise AssertionError("a worker of one device ran a program for two")
finally:
    server.stop()
EOF

# The hooks' scripts take --gpus (a device index, or none for the CPU) and
# say what they measured in their last line of output.
# On the device: no peer can be installed there and no perf_analyzer fetched,
# so KCoral (its node, and the same node behind a Router) and the in-process
# floor, under the benchmark's own tritonclient load.
# gRPC at 64 and 256 concurrent calls too: the load that a machine of many
# cores can put on its front (the rehearsal, on two cores, keeps 1 and 16),
# by one process on the gRPC port (the server, "gateway") and by eight
# ("gateway-f8": a gateway and seven front processes before the one worker;
# the rehearsal keeps two).
serving_concurrency=1,16,64,256
front_processes=8
[ -n "${KCORAL_GPU_CHECK_SHORT:-}" ] && serving_concurrency=1,16 && front_processes=2
hook serving 135 "import kcoral.models.bundle" bench.serving --fronts kcoral,floor --load loop \
    --quick --concurrency "$serving_concurrency" --protocols grpc --gpus "$GPUS" \
    --front-processes "$front_processes"
# The floor and the kept loop only: the loop that resends its state moves
# 400 MB a step. Its CPU rehearsal trains the same 64 MiB model on two cores.
training_steps=50
[ -n "${KCORAL_GPU_CHECK_SHORT:-}" ] && training_steps=3
hook training 30 "from kcoral import RemoteArray" bench.training --gpus "$GPUS" --ways floor,kept \
    --steps "$training_steps"

summary
exit "$failed"
