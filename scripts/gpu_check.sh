#!/usr/bin/env bash
# The GPU checks, in one short run on a machine with an NVIDIA GPU (the device tool's H200:
# python3 3.12 with torch, cupy, pytest, psutil, uvloop; no pyzmq or msgspec).
#
# Before the run, on the CPU machine, fetch the two missing wheels into .whl (git-ignored):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0 msgspec==0.23.0
# (the device image has torch, transformers, pytest, psutil, uvloop; not deepspeed or vllm)
# then run it with the device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"]).
# Results land in $OUT (gpu-tests.log, gpu-bench.jsonl).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, zmq, msgspec; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# the GPU tests, then the CPU data-plane tests as a sanity check of this machine's stack
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"
# (with the GPU hidden: those groups have more ranks than the machine has GPUs)
CUDA_VISIBLE_DEVICES= timeout 300 python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_dataplane.py tests/test_units.py 2>&1 | tail -5 | tee -a "$OUT/gpu-tests.log"
timeout 200 python3 benchmarks/data_plane.py --gpu --mib 1024 --repeat 5 2>"$OUT/bench.err" \
  | tee "$OUT/gpu-bench.jsonl"
timeout 200 python3 benchmarks/hybrid_switch.py --repeat 5 2>>"$OUT/bench.err" \
  | tee -a "$OUT/gpu-bench.jsonl"
tail -20 "$OUT/bench.err"
# GRPO end to end on the GPU (one rank per group, all on the one GPU): the hybrid switch,
# training on GPU batches, the reference and the data plane together
timeout 300 python3 -m asyncrl launch examples/grpo_tiny.py --steps 3 --run-dir "$OUT/grpo" \
  actor_procs=1 > "$OUT/grpo.log" 2>&1; echo "grpo exit $?" | tee -a "$OUT/grpo.log"
tail -5 "$OUT/grpo.log"; rm -rf "$OUT/grpo/checkpoints"
