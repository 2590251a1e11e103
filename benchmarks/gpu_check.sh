#!/usr/bin/env bash
# The prepared GPU check (issue #33): one command for a short device window, at most 8 minutes on one H100.
#
#   OUT=/some/folder PYTHONPATH=src bash benchmarks/gpu_check.sh            # on the GPU machine, from the repo root
#   OUT=/tmp/x PYTHONPATH=src bash benchmarks/gpu_check.sh --device cpu     # the harness's smoke test (tiny sizes)
#   OUT=/some/folder PYTHONPATH=src bash benchmarks/gpu_check.sh --rerun    # the short rerun, within 250 s (below)
#
# --rerun (with or without --device cpu) runs only what the first H200 run left open (issue #33): kernels, prefetch,
# then bench32k1b (llama-3.2-1b full, longfit without offload, 32K: the other half of item 6's pair, whose offload
# row the first run measured) and bench32k8b (llama-3.1-8b LoRA longfit at 32K, which the first run killed at its
# 67 s budget; it gets what is left of the 250 s, about 150 s), both without the traced plan (`--no-trace`: the
# first run checked it, 0.3% off, and an 8B trace takes tens of seconds). $OUT then gets summary.txt,
# pytest_kernels.xml, gpu_check_bench32k1b.md, gpu_check_bench32k8b.md and gpu_check.tar.gz.
#
# Steps, each under its own `timeout` and never stopping the ones after it (a hung or failed step loses
# only itself; what it wrote stays under $OUT):
#   env       nvidia-smi, versions of torch / transformers / peft / flash-attn / liger, the allocator settings
#   kernels   `pytest -m gpu` on the attention kernels and the memory techniques (junit xml, log)
#   training  `pytest -m gpu` on the trainer's GPU tests and the planner against a measured step
#   prefetch  item 6 of the issue, measured: the offload store's backward order on 512 MiB layer inputs, the
#             allocator's reserved minus allocated bytes in layer inputs (benchmarks/offload_prefetch_memory.py);
#             the bench tables add `reserved` vs `peak` with and without offload at full scale
#   bench32k  `longfit bench gpu`: llama-3.2-1b full and llama-3.1-8b LoRA at 32K, longfit with and without
#             offload (item 6's pair) first, then plain transformers; rows that the budget cannot hold are
#             skipped with their estimate
#   bench128k the same models at 128K, longfit with and without offload (plain transformers' 128K x 128K-vocab
#             fp32 logits alone take 64 GiB)
#   bench512k llama-3.1-8b LoRA at 512K, longfit with the offload store (the harness skips it, saying so, when
#             its estimated time exceeds its budget: a 512K step of an 8B model is many minutes on one H100)
# Weights are random (presets; no network: HF_HUB_OFFLINE=1).
# $OUT gets at most 8 files (what a device run brings back): summary.txt (one line per step: pass / FAIL with
# its exit code, seconds), pytest_kernels.xml, pytest_training.xml, gpu_check_<bench step>.md (3) and
# gpu_check.tar.gz (every log, bench json, versions), the archive rewritten after each step. The bench tables
# also go to benchmarks/results/gpu_check_*.
set -u
DEVICE=cuda
RERUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --rerun) RERUN=1; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (--device cuda|cpu, --rerun)" >&2; exit 2 ;;
  esac
done
: "${OUT:?set OUT to the folder for the results}"
RESULTS=${RESULTS:-benchmarks/results}  # where the bench tables are copied (the smoke test gives its own)
W=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")/gpu_check  # logs and bench folders, archived into $OUT
mkdir -p "$OUT" "$W" "$RESULTS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
TOTAL_S=465  # every step's limit is cut to what is left of this, so the whole check ends within it (+ a few s)
STARTED=$(date +%s)
: >"$OUT/summary.txt"

if [ "$DEVICE" = cuda ]; then
  # the attention kernels, the memory techniques, and the kernels of capped, sink and latent attention and of
  # flash-linear-attention (each case skips what the machine lacks)
  KERNEL_TESTS="tests/test_gpu_attention.py tests/test_gpu_memory.py tests/test_gpu_families_attention.py tests/test_gpu_hybrid.py"
  TRAIN_TESTS="tests/test_gpu_plan.py tests/test_gpu_train.py"  # the planner first: item 7, one module fixture
  SMALL="llama-3.2-1b:full,llama-3.1-8b:lora"; BIG="llama-3.1-8b:lora"
  L1=32768; L2=131072; L3=524288; SETS=""; S1=longfit,longfit-no-offload,plain; S2=longfit,longfit-no-offload
  LIMITS=(env:15 kernels:70 training:140 prefetch:20 bench32k:115 bench128k:80 bench512k:30); PREFETCH=""
else  # the harness on tiny sizes: the same steps, llama-tiny at 64..256 tokens
  KERNEL_TESTS="tests/test_gpu_plan.py"; TRAIN_TESTS="tests/test_gpu_plan.py"
  SMALL="llama-tiny:full"; BIG="llama-tiny:lora"
  L1=64; L2=128; L3=128; SETS="--set memory.loss_chunk=32"; S1=plain; S2=longfit
  LIMITS=(env:30 kernels:60 training:60 prefetch:30 bench32k:90 bench128k:90 bench512k:90)
  PREFETCH="--mib 1 --layers 3"
fi
if [ "$RERUN" = 1 ]; then  # the kernels' limit holds their first run (34 s); bench32k8b gets the rest
  TOTAL_S=250
  LIMITS=(kernels:55 prefetch:20 bench32k1b:60 bench32k8b:250)
  [ "$DEVICE" = cuda ] && SMALL="llama-3.2-1b:full"
fi

limit_of() { local item; for item in "${LIMITS[@]}"; do [ "${item%%:*}" = "$1" ] && echo "${item#*:}"; done; }

# step NAME COMMAND...: run under the smaller of its own limit and what is left; log to $W/NAME.log
step() {
  local name=$1; shift
  local left=$((TOTAL_S - ($(date +%s) - STARTED))) limit
  limit=$(limit_of "$name")
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "$name: SKIPPED (no time left of ${TOTAL_S} s)" | tee -a "$OUT/summary.txt"; return
  fi
  echo "== $name (limit ${limit} s): $*"
  local begun rc
  begun=$(date +%s)
  export STEP_LIMIT=$limit
  # SIGINT first: pytest then ends its session as after ^C, writing its junit xml and its summary
  timeout -s INT -k 10 "$limit" bash -c '"$@"' "$name" "$@" >"$W/$name.log" 2>&1  # bash -c: steps may be functions
  rc=$?
  local took=$(($(date +%s) - begun)) verdict=pass
  [ "$rc" -ne 0 ] && verdict="FAIL (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
  echo "$name: $verdict, ${took} s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$W/$name.log"
  cp "$OUT/summary.txt" "$W/"
  tar czf "$OUT/gpu_check.tar.gz" -C "$(dirname "$W")" gpu_check
}

versions() {
  date -u
  nvidia-smi || echo "nvidia-smi: not available"
  "$PY" - <<'EOF'
import importlib.metadata as md, os, torch
from longfit.memory.optim import allocator_settings, configure_cuda_allocator
print("expandable segments set by longfit:", configure_cuda_allocator())  # before CUDA starts, as the trainer
for name in ("torch", "transformers", "peft", "accelerate", "flash-attn", "flash_attn_3", "liger-kernel", "bitsandbytes"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
print("cuda", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), torch.cuda.mem_get_info())
print("allocator:", allocator_settings())
EOF
}

bench() {  # bench STEP MODELS LENGTH SYSTEMS MARGIN_S [BENCH ARGS]: a time budget MARGIN_S short of the step's limit
  local name=$1 models=$2 length=$3 systems=$4 budget=$((STEP_LIMIT - $5))
  shift 5
  [ "$budget" -lt 5 ] && budget=5
  "$PY" -m longfit bench gpu --device "$DEVICE" --models "$models" --lengths "$length" --systems "$systems" \
    --longest 0 --steps 1 --time-budget "$budget" --out "$W/$name" $SETS "$@"
  local rc=$? f
  for f in "$W/$name"/gpu_*; do
    [ -e "$f" ] && cp "$f" "$RESULTS/gpu_check_${name}.${f##*.}"
    [ "${f##*.}" = md ] && cp "$f" "$OUT/gpu_check_${name}.md"
  done
  return $rc
}

export -f versions bench
export PY DEVICE W OUT SETS RESULTS
[ "$RERUN" = 1 ] || step env versions
gpu_tests() {  # gpu_tests NAME FILES...
  local name=$1; shift
  "$PY" -m pytest -m gpu "$@" -p no:cacheprovider --timeout=100 -o addopts="" -q -rs --durations=15 \
    --junitxml="$OUT/pytest_$name.xml"
}
export -f gpu_tests
step kernels gpu_tests kernels $KERNEL_TESTS
[ "$RERUN" = 1 ] || step training gpu_tests training $TRAIN_TESTS
step prefetch "$PY" benchmarks/offload_prefetch_memory.py --device "$DEVICE" $PREFETCH
# the harness may overrun its budget by its kill grace (10 s) and the traces' end: a margin of 20 s
if [ "$RERUN" = 1 ]; then  # no traces: a margin of the kill grace and the report (15 s)
  step bench32k1b bench bench32k1b "$SMALL" "$L1" longfit-no-offload 15 --no-trace
  step bench32k8b bench bench32k8b "$BIG" "$L1" longfit 15 --no-trace
else
  step bench32k bench bench32k "$SMALL" "$L1" "$S1" 20
  step bench128k bench bench128k "$SMALL" "$L2" "$S2" 20
  step bench512k bench bench512k "$BIG" "$L3" longfit 20
fi

echo "total: $(($(date +%s) - STARTED)) s" | tee -a "$OUT/summary.txt"
cp "$OUT/summary.txt" "$RESULTS/gpu_check_summary.txt"
echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
! grep -q -e FAIL -e SKIPPED "$OUT/summary.txt"
