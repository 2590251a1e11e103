#!/usr/bin/env bash
# The prepared GPU check: one command for one device call of at most 10 minutes (issues #33, #46).
#
#   OUT=/some/folder PYTHONPATH=src bash benchmarks/gpu_check.sh               # on the GPU machine, from the repo root
#   OUT=/some/folder PYTHONPATH=src bash benchmarks/gpu_check.sh --short       # the 32K check of issue #33
#   OUT=/tmp/x PYTHONPATH=src bash benchmarks/gpu_check.sh --device cpu [--short]  # the harness's smoke test (tiny sizes)
#
# The default check (issue #46) measures the lengths longfit exists for, within 570 s:
#   env        nvidia-smi, versions of torch / transformers / peft / flash-attn / flash-linear-attention / liger, the
#              allocator settings
#   kernels    `pytest -m gpu` on what issue #46 changed: flash-linear-attention against the torch kernel with grouped
#              value heads, packed documents and an entering state (test_gpu_hybrid); a packed step of a tiny Qwen3.5,
#              Gemma 2 and Qwen3-MoE inside torch.cuda.set_sync_debug_mode("error") (test_host_sync); the capped
#              kernels, softcapped blocks under bf16 autocast and the other 2026 families' kernels
#              (test_gpu_families_attention); 120 s: Triton compiles flash-linear-attention's kernels on first use
#   attention  the attention kernels side by side at 131,072 tokens of llama-3.1-8b's heads, forward and backward
#              (longfit.bench.gpu_attention: SDPA's own choice, each SDPA backend forced, flash-attn where installed;
#              softcapped scores at 16,384: longfit's capped block kernel, flash-attn 2's softcap): which kernel the
#              8B row's attention should run
#   long       one `longfit bench gpu --rows` run, in this order: llama-3.1-8b LoRA at 131,072 with whole layers,
#              attention kept through the recompute and recomputed (issue #53: s/step, MFU, HFU, peak against the
#              plan, host bytes moved, side by side), llama-3.1-8b LoRA at 131,072 as the trainer runs it (its plan's
#              placement of the layer inputs, tiled layers), llama-3.2-1b full at 131,072 without offload and with
#              every layer input in host memory (longfit-host: what the offload store costs where it moves them all),
#              then llama-3.1-8b LoRA at 262,144. Each row runs only if its estimate (set-up plus two steps at the
#              rate an earlier row of the model measured) fits what is left; a row that does not is listed with its
#              estimate.
# --short: env, kernels (every -m gpu kernel file), training (`pytest -m gpu` on the trainer and the planner
# against a measured step), prefetch (the offload store's backward order, benchmarks/offload_prefetch_memory.py),
# bench32k (llama-3.2-1b full and llama-3.1-8b LoRA at 32K, longfit with and without offload, then plain
# transformers), within 465 s.
#
# Each step runs under its own `timeout`, cut to what is left of the total, and never stops the ones after it (a
# hung or failed step loses only itself; what it wrote stays). Weights are random (presets; no network:
# HF_HUB_OFFLINE=1). Everything is written under $OUT, nothing in the repository: at most 8 files (what a device
# run brings back): summary.txt (one line per step: pass / FAIL with its exit code, seconds), pytest_<step>.xml,
# gpu_check_<bench step>.md, attention_<device>.md and gpu_check.tar.gz (every log, bench json, versions), the
# archive rewritten after each step.
set -u
DEVICE=cuda
MODE=long
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --short) MODE=short; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (--device cuda|cpu, --short)" >&2; exit 2 ;;
  esac
done
: "${OUT:?set OUT to the folder for the results}"
W=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")/gpu_check  # logs and bench folders, archived into $OUT
mkdir -p "$OUT" "$W"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
STARTED=$(date +%s)
: >"$OUT/summary.txt"

if [ "$DEVICE" = cuda ]; then
  ISSUE46_TESTS="tests/test_gpu_hybrid.py tests/test_host_sync.py tests/test_gpu_families_attention.py"
  KERNEL_TESTS="tests/test_gpu_attention.py tests/test_gpu_memory.py tests/test_gpu_families_attention.py tests/test_gpu_hybrid.py tests/test_host_sync.py"
  TRAIN_TESTS="tests/test_gpu_plan.py tests/test_gpu_train.py"  # the planner first: one module fixture
  SMALL="llama-3.2-1b:full,llama-3.1-8b:lora"; L1=32768; SETS=""; S1=longfit,longfit-no-offload,plain
  ROWS="llama-3.1-8b:lora:longfit-kept:131072,llama-3.1-8b:lora:longfit-recomputed:131072"
  ROWS="$ROWS,llama-3.1-8b:lora:longfit:131072,llama-3.2-1b:full:longfit-no-offload:131072"
  ROWS="$ROWS,llama-3.2-1b:full:longfit-host:131072,llama-3.1-8b:lora:longfit:262144"
  ATTENTION="--length 131072 --capped-length 16384"
  LONG_LIMITS=(env:15 kernels:120 attention:45 long:570); SHORT_LIMITS=(env:15 kernels:70 training:140 prefetch:20 bench32k:215)
  PREFETCH=""
else  # the harness on tiny sizes: the same steps, llama-tiny at 64..256 tokens
  ISSUE46_TESTS="tests/test_gpu_hybrid.py"; KERNEL_TESTS="tests/test_gpu_plan.py"; TRAIN_TESTS="tests/test_gpu_plan.py"
  SMALL="llama-tiny:full"; L1=64; SETS="--set memory.loss_chunk=32"; S1=plain
  # the kept / recomputed pair first, as on CUDA, then the 1B pair's; the trainer's own rows would repeat the recomputed
  # one (on a CPU auto keeps no attention and tiles no layers; tests/test_bench_gpu.py runs them): four rows, whose
  # processes start in 20-140 s each on a 2-core machine at load 3-20
  ROWS="llama-tiny:lora:longfit-kept:128,llama-tiny:lora:longfit-recomputed:128"
  ROWS="$ROWS,llama-tiny:full:longfit-no-offload:128,llama-tiny:full:longfit-host:128"
  ATTENTION="--length 256 --capped-length 128 --heads 4 --kv-heads 2 --head-dim 32"
  LONG_LIMITS=(env:30 kernels:60 attention:60 long:570); SHORT_LIMITS=(env:30 kernels:60 training:60 prefetch:30 bench32k:90)
  PREFETCH="--mib 1 --layers 3"
fi
if [ "$MODE" = long ]; then TOTAL_S=570; LIMITS=("${LONG_LIMITS[@]}"); else TOTAL_S=465; LIMITS=("${SHORT_LIMITS[@]}"); fi

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
for name in ("torch", "transformers", "peft", "accelerate", "flash-attn", "flash_attn_3", "flash-linear-attention",
             "triton", "liger-kernel", "bitsandbytes"):
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

bench() {  # bench STEP MARGIN_S [BENCH ARGS]: `longfit bench gpu`, its time budget MARGIN_S short of the step's limit
  local name=$1 budget=$((STEP_LIMIT - $2))
  shift 2
  [ "$budget" -lt 5 ] && budget=5
  "$PY" -m longfit bench gpu --device "$DEVICE" --longest 0 --steps 1 --time-budget "$budget" --out "$W/$name" \
    $SETS "$@"
  local rc=$? f
  for f in "$W/$name"/gpu_*.md; do [ -e "$f" ] && cp "$f" "$OUT/gpu_check_${name}.md"; done
  return $rc
}

attention() {  # the attention kernels side by side ($ATTENTION: the lengths and head shape)
  "$PY" -m longfit.bench.gpu_attention --device "$DEVICE" $ATTENTION --out "$W/attention"
  local rc=$? f
  for f in "$W/attention"/attention_*.md; do [ -e "$f" ] && cp "$f" "$OUT/"; done
  return $rc
}

gpu_tests() {  # gpu_tests NAME FILES...
  local name=$1; shift
  "$PY" -m pytest -m gpu "$@" -p no:cacheprovider --timeout=100 -o addopts="" -q -rs --durations=15 \
    --junitxml="$OUT/pytest_$name.xml"
}

export -f versions bench attention gpu_tests
export PY DEVICE W OUT SETS ATTENTION
step env versions
if [ "$MODE" = long ]; then
  step kernels gpu_tests kernels $ISSUE46_TESTS
  step attention attention
  # the harness may overrun its budget by its kill grace (10 s) and the traces' end: a margin of 20 s
  step long bench long 20 --rows "$ROWS"
else
  step kernels gpu_tests kernels $KERNEL_TESTS
  step training gpu_tests training $TRAIN_TESTS
  step prefetch "$PY" benchmarks/offload_prefetch_memory.py --device "$DEVICE" $PREFETCH
  step bench32k bench bench32k 20 --models "$SMALL" --lengths "$L1" --systems "$S1"
fi

echo "total: $(($(date +%s) - STARTED)) s" | tee -a "$OUT/summary.txt"
echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
! grep -q -e FAIL -e SKIPPED "$OUT/summary.txt"
