#!/usr/bin/env bash
# The GPU checks, in one short run on a machine with an NVIDIA GPU (the device tool's H200:
# python3 3.12 with torch, cupy, pytest, psutil, uvloop; no pyzmq, msgspec or deepspeed).
#
# Before the run, on the CPU machine, fetch what it lacks into .whl (git-ignored, ~7 MB):
#   bash scripts/gpu_wheels.sh
# then run it with the device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"]).
# Results land in $OUT (gpu-tests.log, gpu-bench.jsonl, grpo.log). Without DeepSpeed the ZeRO
# GPU test fails (ASYNCRL_REQUIRE_GPU_DEPS below); without .whl nothing past torch/CuPy runs.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  if ls .whl/deepspeed-*.tar.gz > /dev/null 2>&1; then  # its source, built without ops
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
      --no-compile --no-cache-dir --target /tmp/site .whl/deepspeed-*.tar.gz \
      || echo "deepspeed did not install: the ZeRO GPU test will fail"
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, zmq, msgspec; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
# Budget: the device tool allows 600 s a call and 15 min a session, start-up included, so
# the steps below add up to 540 s at most (run it with timeout_s=600). The CPU tests are not
# rerun here: CI runs them.
export ASYNCRL_REQUIRE_GPU_DEPS=1  # a missing NCCL or DeepSpeed fails its test, not skips it
export NCCL_DEBUG=WARN
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 \
  | tail -40 | tee "$OUT/gpu-tests.log"
timeout 80 python3 benchmarks/data_plane.py --gpu --mib 1024 --repeat 3 2>"$OUT/bench.err" \
  | tee "$OUT/gpu-bench.jsonl"
timeout 80 python3 benchmarks/hybrid_switch.py --repeat 3 2>>"$OUT/bench.err" \
  | tee -a "$OUT/gpu-bench.jsonl"
tail -20 "$OUT/bench.err"
# GRPO end to end on the GPU (one rank per group, all on the one GPU): the hybrid switch,
# training on GPU batches, the reference and the data plane together; its run directory in
# /tmp (checkpoints under $OUT would crowd out the logs), its log's tail in $OUT
timeout 140 python3 -m asyncrl launch examples/grpo_tiny.py --steps 3 --run-dir /tmp/grpo \
  actor_procs=1 > /tmp/grpo.log 2>&1; echo "grpo exit $?" >> /tmp/grpo.log
tail -40 /tmp/grpo.log | tee "$OUT/grpo.log"
