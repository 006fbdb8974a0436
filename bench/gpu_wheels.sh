#!/usr/bin/env bash
# The wheels that bench/gpu_throughput.py, train.py and eval.py need on the lent GPU machine
# beyond what its image holds (python3.12 with jax, flax, optax, orbax-checkpoint, numpy,
# absl-py, etils, cloudpickle, protobuf, sentencepiece, sacrebleu, regex, tqdm, joblib, click,
# six, ...): downloaded here into .whl/ (ignored by git, ~12 MB), carried with the run
# (`carry: [".whl"]`) and installed there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (bench/gpu_session.sh does that). flax stays the image's own: it must match the image's jax
# (flax 0.12.8, this project's, fails to import under jax 0.11.2; 0.12.12 works). The set was
# checked on CPU in a venv holding only the image's packages (its cp311 twins): train.py and
# eval.py ran both families from it. promise has no wheel on PyPI: built here (pure Python).
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
  sacremoses==0.2.0 tensorflow-datasets==4.9.10 tensorboardX==2.6.5 importlib_resources==7.1.0 \
  dm-tree==0.1.10 immutabledict==4.3.1 simple_parsing==0.1.9 docstring_parser==0.18.0 \
  tensorflow-metadata==1.21.0 googleapis-common-protos==1.76.0 termcolor==3.3.0 toml==0.10.2 \
  more-itertools==11.2.1
python3 -m pip wheel -q --no-deps -w .whl promise==2.3  # sdist only; pure Python
ls -la .whl
