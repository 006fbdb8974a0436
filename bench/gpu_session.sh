#!/usr/bin/env bash
# What a session with a lent GPU runs for issue 12: ONE device call, sized for a session's
# 15 device-minutes (a machine's start, ~1-2 min, included). Before it, here:
#   bash bench/gpu_wheels.sh                                         # -> .whl/
#   mkdir -p workdirs/gpu_data && cp -r ../shared/data/{multi30k,ptb} workdirs/gpu_data/
# then the device call, carrying [".whl", "workdirs/gpu_data"], timeout_s 600:
#   bash bench/gpu_session.sh          # = all
# and give the machine back. `all` runs these steps in this order while its time budget
# (BUDGET_S, default 540 s) lasts; a step starts only with at least its estimate left (the
# estimates are guesses until one GPU run times them), runs under `timeout` of what is left,
# and a failing step does not stop the next:
#   facts       nvidia-smi, jax and its devices
#   clean       gpu_throughput.py, wmt14 (Transformer base) bf16 fused, no tracing: the step
#               time and MFU of the 45% goal (21.4% on 2026-11-27)
#   packed      the clean setting with attention_impl=fused_packed (cuDNN's packed mode in the
#               model, 16 segment slots a row: data.max_pairs_per_row=16), right after clean
#               on the same warm card
#   empty_rows  bench/gpu_empty_rows.py: jax's cuDNN call and xformer's fused path when some
#               query rows see no key, at row lengths 64-256 (the suspected cause of the next)
#   mt          train.py + eval.py, Multi30k, model.dtype=bfloat16, attention_impl=fused (Done
#               when; on 2026-11-27 its first step's loss or gradient was not finite, before
#               the fused path kept empty rows from cuDNN)
#   mt_bisect   only after a failed mt: 2 steps under JAX_DEBUG_NANS (jax names the first
#               primitive whose output is NaN), 20 steps with XLA's attention, and
#               bench/gpu_attention.py (cuDNN against XLA) at Multi30k's shapes
#   prof_fused  the clean setting again, traced: where the step's time goes
#   packed_attn bench/gpu_packed_attention.py: wmt14's attention calls with the segment mask as
#               a bias (fused) against cuDNN's packed-sequence mode, xformer's own path to it
#               (fused_packed) and unmasked
#   ptb         train.py + eval.py, PTB Transformer-XL, bf16 fused (passed on 2026-11-27)
#   triton      the clean setting with XLA's Triton GEMM fusions on (XLA's default; train.py
#               and gpu_throughput.py compile without them: train_lib.compile_step)
#   prof_xl     wt103_xl bf16 fused, traced
#   ceilings    bf16 8192^3 matmul and device copy (bench/matmul_ceiling.py)
#   prof_xla    wmt14 bf16 with XLA's attention, traced
#   remat       wmt14 bf16 fused, model.remat=full and dots: step time and peak memory
#   translate   bench/translate_speed.py: eval.py's beam and greedy search, Transformer base,
#               and beam search without cache phases (--one_loop)
#   (mt_ptb runs mt and ptb at once, each process taking GPU memory as it needs it)
# `bash bench/gpu_session.sh STEP...` runs only those steps. Everything is written under
# $WORK/out; $OUT (the device's return folder, at most 8 files; default workdirs/gpu_session)
# receives summary.txt, session.tgz (every log, JSON and metrics file; no checkpoints) and
# trace_<step>.tgz for each profile whose traces pack under 15 MiB. Read them back with
# `tar xzf session.tgz`; the op profiles are also in prof_*.json and their logs.
# QUICK=1 PY=<python> checks the script on a CPU with tiny sizes (give it BUDGET_S=3000);
# STEPS sets the train.py steps (default 200).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-workdirs/gpu_session}"
PY="${PY:-python3}"
STEPS="${STEPS:-200}"
BUDGET_S="${BUDGET_S:-540}"
WORK="${WORK:-$(mktemp -d)}"  # workdirs and checkpoints stay here
LOGS="$WORK/out"
mkdir -p "$OUT" "$LOGS"
path="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" .whl/*.whl || exit 1
  path="$WORK/site:$path"
fi
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XFORMER_DATA_DIR="${XFORMER_DATA_DIR:-$PWD/workdirs/gpu_data}"
# eval.py reuses what train.py compiled
export JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"
quick=() mt_split=val ptb_split=test
if [[ "${QUICK:-0}" == 1 ]]; then  # and evaluation slices: an untrained model decodes to the limit
  quick=(--quick) mt_split='val[:16]' ptb_split='test[:400]'
fi
started=$SECONDS

left() { echo $((BUDGET_S - (SECONDS - started))); }

note() {  # a line of the summary, printed as it goes; $OUT's copy survives a killed call
  echo "$*" | tee -a "$LOGS/summary.txt"
  cp "$LOGS/summary.txt" "$OUT/summary.txt" 2>/dev/null || true
}

run() {  # name, needed seconds, command...: its output to <name>.log, under the time left
  local name="$1" need="$2" rc=0 t0=$SECONDS
  shift 2
  if (($(left) < need)); then
    note "[$name] skipped: $(left) s left of $BUDGET_S, needs ~$need s"
    return 1
  fi
  timeout --kill-after=10 "$(left)" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  note "[$name] exit $rc after $((SECONDS - t0)) s ($(left) s left)"
  return "$rc"
}

show() {  # log name, extended regex: its matching lines in the summary
  grep -E "$2" "$LOGS/$1.log" 2>/dev/null | cut -c1-240 | tail -n 8 | sed "s/^/  $1: /" |
    tee -a "$LOGS/summary.txt"
}

throughput() {  # step name, gpu_throughput.py arguments...: start no setting after the budget
  local name="$1"
  shift
  run "$name" 110 "$PY" bench/gpu_throughput.py "${quick[@]}" --dtypes bfloat16 \
    --budget-s "$(($(left) - 75))" --out "$LOGS/$name.json" --profile-dir "$LOGS/$name" "$@"
  # the status line, the table row, and the op profile's categories (its top ops: in the log)
  awk '/^\[ *[0-9]+s\]|^\| (wmt14|ptb_xl|wt103_xl) |^note|steps on|Error/ {print; next}
       /^\| category/ {cat = 1} cat && /^$/ {cat = 0} cat' "$LOGS/$name.log" 2>/dev/null |
    cut -c1-160 | head -n 20 | tee -a "$LOGS/summary.txt"
}

# attention_dropout 0: jax's fused call has no attention dropout (training would fall back)
cli=(--config.model.dtype=bfloat16 --config.model.attention_impl=fused
  --config.model.attention_dropout=0.0 "--config.train.num_steps=$STEPS" --config.train.log_every=50)

step_facts() {
  timeout 60 nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv \
    2>&1 | tee -a "$LOGS/summary.txt"
  timeout 60 "$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
    2>&1 | tail -n 1 | tee -a "$LOGS/summary.txt"
  # the device's own description, for bench/gpu_compile.py --target on machines without a GPU
  timeout 60 "$PY" -c "import jax, sys; from jax._src.lib import xla_client as xc
try: c = xc.get_topology_for_devices(jax.devices()).target_config; open(sys.argv[1], 'w').write(c)
except Exception as e: print('no target config:', repr(e)[:200])" "$LOGS/target_config.txtpb" \
    2>&1 | tail -n 1 | tee -a "$LOGS/summary.txt"
}

train_and_eval() {  # name, config, eval split during training, eval.py's split, seconds needed
  local name="$1" config="$2" during="$3" split="$4" need="$5"
  run "${name}_train" "$need" "$PY" train.py --config="configs/$config.py" \
    --workdir="$WORK/$name" "${cli[@]}" "--config.data.eval_split=$during" &&
    run "${name}_eval" 30 "$PY" eval.py --workdir="$WORK/$name" "--split=$split"
  show "${name}_train" "attention_impl|fall|train step:|step $STEPS/|finished|at step"
  show "${name}_eval" "attention_impl|fall|BLEU|bleu|ppl|nll"
}

step_mt() { train_and_eval mt multi30k_ende "$mt_split" "$mt_split" 150; }
step_ptb() { train_and_eval ptb ptb_xl "${ptb_split/test/valid}" "$ptb_split" 120; }
step_mt_ptb() {  # both at once; each process takes GPU memory as it needs it
  (export XLA_PYTHON_CLIENT_PREALLOCATE=false; step_mt) &
  (export XLA_PYTHON_CLIENT_PREALLOCATE=false; step_ptb) &
  wait
}

step_mt_bisect() {  # only after a failed mt: which part of the step is not finite
  grep -q "non-finite" "$LOGS/mt_train.log" 2>/dev/null || { note "[mt_bisect] not needed"; return 0; }
  # jax re-runs the failing step op by op and names the first primitive whose output is NaN
  JAX_DEBUG_NANS=True run mt_nan 100 "$PY" train.py --config=configs/multi30k_ende.py \
    --workdir="$WORK/mt_nan" "${cli[@]}" "--config.data.eval_split=$mt_split" \
    --config.train.num_steps=2 --config.train.log_every=1
  grep -E -B2 -A6 "FloatingPointError|[Ii]nvalid value" "$LOGS/mt_nan.log" 2>/dev/null |
    cut -c1-240 | tail -n 30 | tee -a "$LOGS/summary.txt"
  run mt_xla 100 "$PY" train.py --config=configs/multi30k_ende.py --workdir="$WORK/mt_xla" \
    "${cli[@]/attention_impl=fused/attention_impl=xla}" "--config.data.eval_split=$mt_split" \
    --config.train.num_steps=20 --config.train.log_every=5
  show mt_xla "non-finite|step 20/|Error"
  # cuDNN against XLA at Multi30k's model and batch shapes, on random packed rows
  run attn_mt 90 "$PY" bench/gpu_attention.py --sizes multi30k --only "enc-dec sinusoidal" \
    "${quick[@]}"
  show attn_mt "^\| enc-dec|Error"
}

step_empty_rows() {  # NaN gradients from rows that see no key, at 64 mod 128 keys?
  local sizes=()
  [[ "${QUICK:-0}" == 1 ]] && sizes=(--check --rows 2 --lengths 64,128)
  run empty_rows 45 "$PY" bench/gpu_empty_rows.py "${sizes[@]}"
  show empty_rows "^\| [0-9]|fused path|Error"
}

step_clean() { throughput clean --configs wmt14 --impls fused; }
step_packed_attn() {  # cuDNN on packed rows: the mask as a bias against per-segment offsets
  local sizes=()
  [[ "${QUICK:-0}" == 1 ]] && sizes=(--check --rows 2 --length 128)  # (cuDNN: GPU only)
  run packed_attn 95 "$PY" bench/gpu_packed_attention.py "${sizes[@]}"
  show packed_attn "^\| (encoder|decoder|cross)|^check:|Error"
}
step_packed() {
  throughput packed --configs wmt14 --impls fused_packed --set data.max_pairs_per_row=16
}
step_triton() {  # the clean setting as XLA compiles it by default: Triton GEMM fusions too
  (export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_triton_gemm=true"
    throughput triton --configs wmt14 --impls fused)
}

step_prof_fused() { throughput prof_fused --configs wmt14 --impls fused --profile 3; }
step_prof_xla() { throughput prof_xla --configs wmt14 --impls xla --profile 3; }
step_prof_xl() { throughput prof_xl --configs wt103_xl --impls fused --profile 3; }

step_ceilings() {
  local size=(--n 8192 --inner 10 --copy_gib 4)
  [[ "${QUICK:-0}" == 1 ]] && size=(--n 512 --copy_gib 0.125)
  run ceilings 45 "$PY" bench/matmul_ceiling.py --dtype bfloat16 "${size[@]}"
  show ceilings 'GFLOP|GB/s'
}

step_translate() {  # eval.py's beam and greedy search with the base model (random weights)
  local size=(--config=configs/wmt14_ende.py --vocab_size=32000)
  [[ "${QUICK:-0}" == 1 ]] && size=(--config=configs/wmt14_ende.py --vocab_size=1000
    --batch_size 4 --src_len 8 --repeats 1)
  run translate 60 "$PY" bench/translate_speed.py "${size[@]}" --one_loop \
    --output="$LOGS/translate.json"
  show translate "^\| (beam|greedy)|Error"
}

step_remat() {
  local remat
  for remat in full dots; do  # none: the clean step
    throughput "remat_$remat" --configs wmt14 --impls fused --set "model.remat=$remat"
  done
}

steps=("$@")
((${#steps[@]})) && [[ "${steps[0]}" != all ]] ||
  steps=(facts clean packed empty_rows mt mt_bisect prof_fused packed_attn ptb triton prof_xl
    ceilings prof_xla remat translate)
for name in "${steps[@]}"; do
  if ! declare -F "step_$name" >/dev/null; then
    echo "unknown step '$name'; steps: facts clean packed empty_rows mt mt_bisect prof_fused"\
    "packed_attn ptb triton prof_xl ceilings prof_xla remat translate mt_ptb" >&2
    exit 2
  fi
done
note "gpu_session: steps ${steps[*]}; budget $BUDGET_S s; STEPS=$STEPS; QUICK=${QUICK:-0}"
for name in "${steps[@]}"; do
  "step_$name" || true
done

# What comes back: the summary, the logs and JSON in one archive, and small enough traces.
for dir in mt ptb; do
  [[ -d "$WORK/$dir" ]] || continue
  mkdir -p "$LOGS/$dir"
  cp "$WORK/$dir"/*.json* "$LOGS/$dir/" 2>/dev/null || true
done
exclude=()  # the traces travel apart from session.tgz (only prof_* steps trace)
for trace in "$LOGS"/prof_*/; do
  [[ -d "$trace" ]] || continue
  name="$(basename "$trace")"
  exclude+=(--exclude="./$name")
  tar czf "$WORK/trace_$name.tgz" -C "$LOGS" "$name"
  if (($(stat -c %s "$WORK/trace_$name.tgz") < 15 * 2 ** 20)); then
    mv "$WORK/trace_$name.tgz" "$OUT/"
  else
    note "trace_$name.tgz: $(du -h "$WORK/trace_$name.tgz" | cut -f1), too large to come back"
  fi
done
note "gpu_session: done after $((SECONDS - started)) s"
cp "$LOGS/summary.txt" "$OUT/summary.txt"
tar czf "$OUT/session.tgz" "${exclude[@]}" -C "$LOGS" .
ls -la "$OUT"
