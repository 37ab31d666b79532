#!/usr/bin/env bash
# The GPU checks, in one short run on a machine with an NVIDIA GPU (the device tool's H100 or
# H200, said in gpu.txt: compare figures only between runs on the same kind; python3 3.12 with torch, cupy, pytest, psutil, uvloop; no pyzmq, msgspec or deepspeed).
#
# Before the run, on the CPU machine, fetch what it lacks into .whl (git-ignored, ~7 MB):
#   bash scripts/gpu_wheels.sh
# then run it with the device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"]).
# Results land in $OUT (gpu.txt, gpu-tests.log, gpu-bench.jsonl, bench.err, grpo.log).
# Without DeepSpeed the ZeRO GPU test fails (ASYNCRL_REQUIRE_GPU_DEPS below); without .whl
# nothing past torch/CuPy runs.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! ls .whl/*.whl > /dev/null 2>&1; then  # (every step would fail on `import zmq`)
  echo "no wheels in .whl: run 'bash scripts/gpu_wheels.sh' here first, and the device" \
    "tool with carry=[\".whl\"]" | tee "$OUT/gpu.txt"
  exit 2
fi
if [ -d .whl ]; then
  # (setup bounded too: a hang here would take the call's whole limit, gpu.txt unwritten)
  timeout -k 5 120 python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  if [ -d /tmp/site/deepspeed ]; then  # a warm machine's second run: built already
    :
  elif ls .whl/deepspeed-*.tar.gz > /dev/null 2>&1; then  # its source, built without ops
    DS_BUILD_OPS=0 timeout -k 5 120 python3 -m pip install -q --no-index --no-deps \
      --no-build-isolation \
      --no-compile --no-cache-dir --target /tmp/site .whl/deepspeed-*.tar.gz \
      || echo "deepspeed did not install: the ZeRO GPU test will fail"
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
  | tee "$OUT/gpu.txt"
# (a warm machine's earlier run killed at its cap may have left processes holding memory)
timeout 30 nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee -a "$OUT/gpu.txt"
timeout 60 python3 - 2>&1 <<'EOF' | tee -a "$OUT/gpu.txt"
import importlib.metadata as m
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, "devices", torch.cuda.device_count())
for d in ("torch", "transformers", "cupy-cuda13x", "pyzmq", "msgspec", "deepspeed", "uvloop"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "missing")
EOF
# Budget: the device tool allows 600 s a call and 15 min a session, start-up included. Every
# step below gets what is left of DEADLINE seconds (run it with timeout_s=600), so a hang in
# one step costs the later steps their time but never the call's output. Logs go straight
# to $OUT: a step killed at its limit still returns what it printed. The CPU tests are not
# rerun here: CI runs them.
DEADLINE=${DEADLINE:-420}  # (with the machine's start, room for a targeted rerun at once,
# on the warm machine: `DEADLINE=150 ONLY=failed bash scripts/gpu_check.sh`, the GPU tests
# not passed since the last full run (failed, or not reached before a step's cap) alone; or
# ONLY="a -k expression")
FAILED=0  # the script's exit status: the device tool's rc then says whether a step failed
SKIPPED=0  # steps with no time left: not failures (a test rerun would not help them)
PASSED=/tmp/gpu-passed-tests  # the GPU tests passed since the last full run (warm machine)
step() {  # step SECONDS LOG COMMAND...: COMMAND for SECONDS at most, or what is left
  local cap=$1 log=$2 rc; shift 2
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 15 ]; then
    echo "skipped (no time left): $*" | tee -a "$log"; SKIPPED=1; return
  fi
  echo "== $* (at ${SECONDS}s, ${cap}s at most)" >> "$log"
  # (a step killed at its limit takes its own process group; asyncrl's agents and ranks,
  # in sessions of their own, end on their parent's death: PR_SET_PDEATHSIG)
  timeout -k 5 "$cap" "$@" >> "$log" 2>&1
  rc=$?
  echo "== exit $rc at ${SECONDS}s" >> "$log"
  [ "$rc" -eq 0 ] || FAILED=1
}
export ASYNCRL_REQUIRE_GPU_DEPS=1  # a missing NCCL or DeepSpeed fails its test, not skips it
export NCCL_DEBUG=WARN
passed() {  # the ids of the tests the last test step passed
  grep -oE '^tests/test_gpu.py::[^ ]+ PASSED' "$OUT/gpu-tests.log" | cut -d' ' -f1
}
# warnings are errors in the suite (pyproject); here the image's own library versions may
# warn where CI's do not, and a figure matters more than a deprecation: shown, not raised.
# -v: each test's name and result as it ends (a step killed at its cap never prints -q's
# summary)
PYTEST=(python3 -m pytest -v -rA -p no:cacheprovider -W default --durations=0 --timeout 100
        -o faulthandler_timeout=90 -m gpu)
if [ -n "${ONLY:-}" ]; then  # a rerun of some GPU tests alone, on a warm machine
  if [ "$ONLY" = failed ]; then  # all but those passed since the last full run
    [ -f "$PASSED" ] || { echo "ONLY=failed: no earlier run's record ($PASSED) here" \
      | tee "$OUT/gpu-tests.log"; exit 2; }
    args=()
    for id in $(sort -u "$PASSED"); do
      args+=(--deselect "$id")
    done
    step "$DEADLINE" "$OUT/gpu-tests.log" "${PYTEST[@]}" "${args[@]}" tests/test_gpu.py
  else
    step "$DEADLINE" "$OUT/gpu-tests.log" "${PYTEST[@]}" -k "$ONLY" tests/test_gpu.py
  fi
  passed >> "$PASSED"
  exit "$FAILED"
fi
step 200 "$OUT/gpu-tests.log" "${PYTEST[@]}" tests/test_gpu.py
passed > "$PASSED"  # (a full run starts the record anew)
B="$OUT/gpu-bench.jsonl"
bench() {  # bench SECONDS SCRIPT ARGS...: its JSON lines to $B, its stderr to bench.err
  local cap=$1; shift
  step "$cap" "$OUT/bench.err" sh -c 'out=$1; shift; exec python3 "$@" >> "$out"' _ "$B" "$@"
}
bench 60 benchmarks/data_plane.py --gpu --mib 1024 --repeat 3
bench 60 benchmarks/hybrid_switch.py --repeat 3
bench 50 benchmarks/pipeline.py --sync-only --repeat 3
bench 60 benchmarks/hybrid_switch.py --backend zero3 --presets llama-100m --repeat 3
# GRPO end to end on the GPU (one rank per group, all on the one GPU): the hybrid switch,
# training on GPU batches, the reference and the data plane together; its run directory in
# /tmp (checkpoints under $OUT would crowd out the logs)
step 120 "$OUT/grpo.log" python3 -m asyncrl launch examples/grpo_tiny.py --steps 3 \
  --run-dir /tmp/grpo actor_procs=1
echo "done at ${SECONDS}s, a step failed: $FAILED, a step skipped for time: $SKIPPED" \
  | tee -a "$OUT/gpu.txt"
exit "$FAILED"
