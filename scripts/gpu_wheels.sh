#!/usr/bin/env bash
# Fetch, on the CPU machine, what the device machine's python3 3.12 lacks for
# scripts/gpu_check.sh into .whl (git-ignored; carried with run(..., carry=[".whl"])):
# pyzmq, msgspec and setproctitle (asyncrl itself), and DeepSpeed (its source: built there
# without ops) with its pure-Python and cp312 dependencies, for the ZeRO tests on the GPU.
# About 7 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PY=${PY:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0 msgspec==0.23.0 \
  hjson==3.1.0 py-cpuinfo==9.0.0 ninja==1.13.2 einops==0.8.2 msgpack==1.2.4 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 setproctitle==1.3.8
"$PY" -m pip download -q --no-deps -d .whl deepspeed==0.19.8  # a source archive only
ls -la .whl
