#!/usr/bin/env bash
# The GPU check: one prepared run on a machine with an NVIDIA GPU, under ten
# minutes, from the repository root:
#
#     bash bench/gpu_check.sh            # figures under gpu-check/ (or $OUT)
#
# 1. a virtualenv with CUDA jaxlib: $KCORAL_GPU_VENV if it holds one (a
#    machine without the network needs it made beforehand, on the same
#    Python), else .bench-venv/gpu, made and filled with pip install -e
#    .[jax,test] "jax[cuda12]==<the jax this tree is tested with>";
# 2. a node on GPU 0 (kcoral server --gpus 0): its /health, with the
#    gpu_target it reports, and one run checked against JAX in process;
# 3. the conformance programs against a GPU worker (tests/test_conformance.py
#    with KCORAL_TEST_GPUS=0 and JAX_PLATFORMS=cuda: the suite starts its own
#    server on GPU 0 and compares bitwise with JAX on the same GPU);
# 4. bench/server.py --gpus 0 and bench/router.py --gpus 0, shortened.
#
# Every step has its own time limit; a step that fails is reported and the
# next one runs. The exit status is the number of failed steps.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
RESULTS=${OUT:-$ROOT/gpu-check}
JAX_VERSION=${JAX_VERSION:-0.10.2}
VENV=${KCORAL_GPU_VENV:-$ROOT/.bench-venv/gpu}
PY=$VENV/bin/python
export PYTHONPATH=$ROOT
mkdir -p "$RESULTS"
failed=0

step() {  # step NAME SECONDS COMMAND...: run it with a limit, its output kept
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s)"
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$RESULTS/$name.log"
    echo "== $name: exit $rc after $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    return "$rc"
}

echo "== machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv || {
    echo "no NVIDIA GPU here (nvidia-smi failed): nothing to check"
    exit 1
}
nproc
python3 --version

if ! "$PY" -c "import jax, kcoral" 2>/dev/null; then
    step venv 300 bash -c "python3 -m venv '$VENV' && '$PY' -m pip install -q -e '.[jax,test]' \
        'jax[cuda12]==$JAX_VERSION'" || exit 1
fi
step devices 45 "$PY" -c "import jax; print(jax.__version__, jax.devices())"

step node 90 "$PY" - <<'EOF'
"""A node on GPU 0: its health, and one run against JAX in process."""
import json
import sys
import urllib.request

sys.path.insert(0, "bench")
import numpy as np

from child import SERVER_READY, KCoralChild, start_jax

device = start_jax("0")
import jax

from kcoral import Client, Program

node = KCoralChild(["server", "--port", "0", "--gpus", "0"],
                   {"url": r"kcoral server listening on (http://\S+)", "ready": SERVER_READY},
                   name="node")
try:
    url = node.found["url"]
    with urllib.request.urlopen(url + "/health", timeout=10) as answer:
        health = json.loads(answer.read())
    print("gpu_target:", health["gpu_target"])
    print("health:", json.dumps(health))

    def f(x, w):
        return jax.numpy.tanh(x @ w).sum(axis=0)

    x = np.random.default_rng(0).standard_normal((256, 512), dtype=np.float32)
    w = np.random.default_rng(1).standard_normal((512, 512), dtype=np.float32)
    with Client(url) as client:
        got = np.asarray(client.run(Program.from_function(f, x, w), x, w))
    want = np.asarray(jax.jit(f)(x, w))
    # Bit for bit is the conformance suite's check (against the exported
    # program in process); jax.jit(f) may fuse differently.
    print("one run on", device, "max |difference| to jax.jit(f) in process:",
          float(np.abs(got - want).max()))
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), "the node's answer is not JAX's"
finally:
    node.stop()
EOF

TAIL=8 step conformance 150 env KCORAL_TEST_GPUS=0 JAX_PLATFORMS=cuda \
    "$PY" -m pytest tests/test_conformance.py -x -q -p no:cacheprovider
TAIL=40 step server-bench 120 "$PY" bench/server.py --gpus 0 --count 300 --seconds 3 \
    --json "$RESULTS/server.json"
TAIL=40 step router-bench 150 "$PY" bench/router.py --gpus 0 --clients 1,16 --seconds 2 \
    --rounds 1 --json "$RESULTS/router.json"

echo "== gpu check done: $failed failed step(s); logs and JSON in $RESULTS"
grep -h "^gpu_target:" "$RESULTS/node.log" || echo "gpu_target: (not reported)"
exit "$failed"
