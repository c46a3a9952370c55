#!/usr/bin/env bash
# The three jobs on a GPU node with a generated full-width checkpoint: make it, load, validate, bench.
#
#   gpu-runs/gpu_runtime.sh RESULTS_DIR [PRESET] [CKPT_DIR]
#
# PRESET defaults to k3-prefix-4 (layers 0-3 of K3 at full width: the dense layer, two KDA + LatentMoE
# layers and the first MLA layer; 57.6 GB), written with --expert-init codes (disk-bound) unless CKPT_DIR
# already holds it. Then, each step with its own time limit (the integer SWEEP_SCALE multiplies them):
#   validate  k3rocm validate --level performance (env, load: plan, stream, checksum every tensor, GB/s vs
#             raw read; forward; correctness vs the fp32 oracle; a short benchmark)
#   bench64   k3rocm bench --concurrency 64   (input 256 / output 64 tokens)
#   bench1_8  k3rocm bench --concurrency 1,8  (fewer prompts) into a second report
#   dist      the TP2/EP2 GPU tests (nccl, one GPU per rank) when two GPUs are visible
# Reports land in RESULTS_DIR/report (report.json/.md/.html) and RESULTS_DIR/report-c1-8; RESULTS_DIR/steps.tsv
# lists each step's exit status and seconds. Needs the package importable (pip install -e . or PYTHONPATH).
# A full-width validate outran 240 s on an H200 (load + verification of 24 GB, cold compiles, the oracle
# passes), so the limits here are generous; the log shows `k3rocm: tier ...` lines as it goes.
set -u
R=${1:?usage: gpu-runs/gpu_runtime.sh RESULTS_DIR [PRESET] [CKPT_DIR]}
P=${2:-k3-prefix-4}
CK=${3:-/tmp/$P}
SCALE=${SWEEP_SCALE:-1}
PY=${PYTHON:-python3}
K3="$PY -m k3rocm.cli.main"
mkdir -p "$R"
export PYTHONUNBUFFERED=1 COLUMNS=160

STEP_TAG=runtime
. "$(dirname "$0")/steps.sh"

if [ ! -f "$CK/model.safetensors.index.json" ]; then
  step make 240 $K3 checkpoint make --preset "$P" --out "$CK" --expert-init codes
fi
step validate 900 $K3 validate --checkpoint "$CK" --level performance --out "$R/report"
step bench64 600 $K3 bench --checkpoint "$CK" --concurrency 64 --input-len 256 --output-len 64 \
     --num-prompts 256 --warmups 64 --out "$R/report"
step bench1_8 300 $K3 bench --checkpoint "$CK" --concurrency 1,8 --input-len 256 --output-len 64 \
     --num-prompts 16 --warmups 2 --out "$R/report-c1-8"
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" -ge 2 ] 2>/dev/null; then
  step dist 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_dist.py
fi
cat "$R/steps.tsv"
