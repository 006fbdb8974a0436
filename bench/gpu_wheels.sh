#!/usr/bin/env bash
# The wheels bench/gpu_throughput.py needs on the lent GPU machine beyond what its image holds
# (python3.12 with jax, optax, orbax-checkpoint, numpy, absl-py, etils, cloudpickle, protobuf,
# sentencepiece, sacrebleu, regex, tqdm): downloaded here into .whl/ (ignored by git, ~6 MB),
# carried with the run (`carry: [".whl"]`) and installed there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# flax stays the image's own: it must match the image's jax (flax 0.12.8, this project's, fails
# to import under jax 0.11.2; 0.12.12 works).
#
#   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  ml_collections==1.1.0 grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 \
  sacremoses==0.2.0
ls -la .whl
