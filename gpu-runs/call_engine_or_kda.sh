#!/usr/bin/env bash
# One borrowed-GPU call that adapts to the card it lands on: the engine steps that need the K3 rank's ~100 GB
# (k3, prof) where the card holds them, the KDA prefill rows against fla otherwise.
#
#   gpu-runs/call_engine_or_kda.sh RESULTS_DIR
#
# Always: apend (the AttnRes pending-add tests), p4 (k3-prefix-4 at c1 / c8 / c64), the gate sweep (KSWEEP_ARGS)
# and the skinny GEMM against the vendor one (dense); then k3 + prof on a card of >= 100 GiB, else kda
# (KDA_BENCH_ARGS). BIG_STEPS / SMALL_STEPS replace either list. Everything under RESULTS_DIR; pass
# K3ROCM_SOURCE_COMMIT as for gpu_engine.sh.
set -u
R=${1:?usage: gpu-runs/call_engine_or_kda.sh RESULTS_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/gpu.txt" 2>&1
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')
if [ "${MIB:-0}" -ge 100000 ]; then STEPS=${BIG_STEPS:-apend p4 ksweep dense k3 prof}; else STEPS=${SMALL_STEPS:-apend p4 ksweep dense kda}; fi
echo "steps: $STEPS (${MIB:-?} MiB)" | tee "$R/plan.txt"
DEADLINE=${DEADLINE:-520} PACK=0 bash "$HERE/gpu_engine.sh" "$R" "$STEPS"
