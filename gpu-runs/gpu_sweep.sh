#!/usr/bin/env bash
# One GPU sweep of the kernel families: GPU correctness tests and benchmarks, logs and JSON into one directory.
#
#   gpu-runs/gpu_sweep.sh RESULTS_DIR [LANE_A_GPU] [LANE_B_GPU]
#
# Two lanes run side by side, one per GPU (give the same GPU twice on a one-GPU machine: the lanes then
# run one after the other so timings stay clean):
#   lane A: KDA (compile warm-up, GPU grid, timing vs fla when importable), then the MLA / AttnRes GPU tests;
#   lane B: MoE benchmark (64 / 512 / 8192 tokens, A16W4 and A8W4, oracle check), MoE GPU tests, MLA benchmark,
#           engine and loader GPU tests.
# Every step has its own time limit (seconds; the integer SWEEP_SCALE multiplies them) so one hang costs one step;
# the limits are sized for a cold Triton cache on an H200 (compiles dominate: the KDA GPU file needs ~4 min, the
# MLA GPU file more than 2, fla's first-call autotuning of the KDA prefill rows several minutes);
# RESULTS_DIR/steps.tsv lists each step with its exit status and seconds. Needs the package importable
# (pip install -e . or PYTHONPATH) and a CUDA or ROCm GPU.
set -u
R=${1:?usage: gpu-runs/gpu_sweep.sh RESULTS_DIR [LANE_A_GPU] [LANE_B_GPU]}
GA=${2:-0}
GB=${3:-1}
SCALE=${SWEEP_SCALE:-1}
mkdir -p "$R"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

STEP_TAG=sweep
. "$(dirname "$0")/steps.sh"
gstep() {  # gstep NAME LIMIT_S GPU CMD...: a step on one GPU
  local name=$1 limit=$2 STEP_GPU=$3; shift 3  # local: step sees it (dynamic scope), the caller does not
  step "$name" "$limit" "$@"
}

lane_a() {
  ( for i in 0 1 2 3 4 5; do CUDA_VISIBLE_DEVICES=$GA timeout 80 $PY gpu-runs/bench_kda.py --warm $i/6 >/dev/null 2>&1 & done; wait )
  gstep kda_bench 400 "$GA" $PY gpu-runs/bench_kda.py --out "$R/kda"
  KDA_GPU_LOG="$R/kda_gpu.jsonl" gstep kda_tests 300 "$GA" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_kda_gpu.py
  gstep mla_tests 300 "$GA" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_mla_gpu.py tests/kernels/test_mla_triton.py tests/kernels/test_attnres.py
}

lane_b() {
  gstep moe_bench 200 "$GB" $PY gpu-runs/bench_moe.py --tokens 64 512 8192 --modes a16w4 a8w4 --check --candidates \
       --json "$R/moe_bench.json" --md "$R/moe_bench.md"
  K3ROCM_MOE_GPU_LOG="$R/moe_gpu.jsonl" gstep moe_tests 150 "$GB" $PY -m pytest -q -p no:cacheprovider \
       tests/kernels/test_moe_gpu.py tests/kernels/test_moe_triton.py
  gstep mla_bench 100 "$GB" $PY gpu-runs/bench_mla.py --json "$R/mla_bench.json"
  gstep engine_tests 180 "$GB" $PY -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_engine.py tests/runtime/test_load.py
}

{ git rev-parse --short HEAD 2>/dev/null; date -u +%FT%TZ; nvidia-smi --query-gpu=name,clocks.max.sm,memory.total \
  --format=csv,noheader 2>/dev/null || rocm-smi --showproductname 2>/dev/null; $PY -c \
  "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >"$R/env.txt" 2>&1
if [ "$GA" = "$GB" ]; then
  lane_a; lane_b
else
  lane_a & lane_b & wait
fi
cat "$R/steps.tsv"
