#!/usr/bin/env bash
# What a session with a lent GPU runs for issue 12, in commands of at most ~9 minutes (the
# device allows 10 per command and 30 per session). Before the first, here:
#   bash bench/gpu_wheels.sh                                         # -> .whl/
#   mkdir -p workdirs/gpu_data && cp -r ../shared/data/{multi30k,ptb} workdirs/gpu_data/
# and carry [".whl", "workdirs/gpu_data"] with each command:
#   bash bench/gpu_session.sh profile  # GPU facts, bf16 matmul and copy ceilings, then
#                                      # gpu_throughput.py --profile on wmt14 (bf16, fused and
#                                      # xla) and wt103_xl (bf16 fused): where the step's time goes
#   bash bench/gpu_session.sh cli      # train.py + eval.py from the command line on the GPU,
#                                      # both families, model.dtype=bfloat16, attention_impl=fused
#   bash bench/gpu_session.sh remat    # wmt14 bf16 fused, model.remat none / full / dots: peak
#                                      # memory and step time
# Logs and JSON go to $OUT (the device's return folder; default workdirs/gpu_session).
# QUICK=1 PY=<python> checks the script on a CPU with tiny sizes; STEPS sets the cli steps.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-workdirs/gpu_session}"
PY="${PY:-python3}"
STEPS="${STEPS:-300}"
mkdir -p "$OUT"
WORK="${WORK:-$(mktemp -d)}"  # workdirs (checkpoints stay here; logs and metrics go to $OUT)
path="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" .whl/*.whl
  path="$WORK/site:$path"
fi
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XFORMER_DATA_DIR="${XFORMER_DATA_DIR:-$PWD/workdirs/gpu_data}"
quick=()
[[ "${QUICK:-0}" == 1 ]] && quick=(--quick)

case "${1:-}" in
  profile)
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version \
      --format=csv 2>&1 | tee "$OUT/gpu.txt" || true
    if [[ "${QUICK:-0}" == 1 ]]; then
      "$PY" bench/matmul_ceiling.py --dtype bfloat16 --n 512 --copy_gib 0.125 | tee "$OUT/ceilings.txt"
    else
      "$PY" bench/matmul_ceiling.py --dtype bfloat16 --n 8192 --inner 10 --copy_gib 4 \
        | tee "$OUT/ceilings.txt"
    fi
    for spec in "wmt14 fused,xla" "wt103_xl fused"; do
      read -r model impls <<<"$spec"
      "$PY" bench/gpu_throughput.py "${quick[@]}" --configs "$model" --dtypes bfloat16 \
        --impls "$impls" --profile 3 --budget-s 200 --out "$OUT/profile_$model.json" \
        >"$OUT/profile_$model.log" 2>&1 || echo "gpu_throughput $model: exit $?"
      grep -E '^\[|^\| |^profile:|^[0-9]+ steps on' "$OUT/profile_$model.log" | head -n 60 || true
    done
    ;;
  cli)
    # attention_dropout 0: jax's fused call has no attention dropout (training would fall back)
    common=(--config.model.dtype=bfloat16 --config.model.attention_impl=fused
      --config.model.attention_dropout=0.0 "--config.train.num_steps=$STEPS"
      --config.train.log_every=50)
    run() {  # name, command...: its output to $OUT/<name>.log; a failure does not stop the rest
      local name="$1"
      shift
      "$@" >"$OUT/$name.log" 2>&1 || echo "$name: exit $?"
    }
    run mt_train "$PY" train.py --config=configs/multi30k_ende.py --workdir="$WORK/mt" "${common[@]}"
    run mt_eval "$PY" eval.py --workdir="$WORK/mt" --split=val
    run ptb_train "$PY" train.py --config=configs/ptb_xl.py --workdir="$WORK/ptb" "${common[@]}"
    run ptb_eval "$PY" eval.py --workdir="$WORK/ptb" --split=test
    for dir in mt ptb; do
      mkdir -p "$OUT/$dir" && cp "$WORK/$dir"/*.json* "$OUT/$dir/" 2>/dev/null || true
    done
    for log in mt_train mt_eval ptb_train ptb_eval; do
      echo "== $log"
      grep -E "attention_impl|step $STEPS/|finished|at step|bleu" "$OUT/$log.log" | cut -c1-300 \
        | tail -n 6 || true
    done
    ;;
  remat)
    for remat in none full dots; do
      "$PY" bench/gpu_throughput.py "${quick[@]}" --configs wmt14 --dtypes bfloat16 \
        --impls fused --set "model.remat=$remat" --budget-s 150 \
        --out "$OUT/remat_$remat.json" >"$OUT/remat_$remat.log" 2>&1 || echo "remat $remat: exit $?"
      echo "== model.remat=$remat"
      grep -E '^\[|^\| wmt14' "$OUT/remat_$remat.log" | head -n 3 || true
    done
    ;;
  *)
    echo "usage: bash bench/gpu_session.sh profile|cli|remat" >&2
    exit 2
    ;;
esac
