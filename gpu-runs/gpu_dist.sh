#!/usr/bin/env bash
# The three jobs on N GPUs of one node at TPN/EPN with a generated full-width checkpoint, against 1 GPU.
#
#   gpu-runs/gpu_dist.sh RESULTS_DIR NGPU [PRESET] [CKPT_DIR]
#
# PRESET defaults to k3-prefix-4 (57.6 GB; written with --expert-init codes unless CKPT_DIR holds it). A profile
# file RESULTS_DIR/h200-N.toml is hwprofiles/h200-8.toml with count = tp = ep = NGPU. Each step has its own time
# limit (the integer SWEEP_SCALE multiplies them):
#   load       k3rocm load      on N ranks (each rank streams only its slice; bytes per rank vs the plan)
#   validate   k3rocm validate --level performance on N ranks (correctness vs the TP/EP oracle on the same ranks)
#   bench      k3rocm bench --concurrency 1,8,64 on N ranks (input 256 / output 64): the collectives per step
#   bench1     the same load on one GPU (h200-1): throughput 1 -> N GPUs and the served-token digests
#   kill       a bench on N ranks with rank 1 killed after KILL_AFTER s (default 90): one line, exit 3, no orphans
# Reports land in RESULTS_DIR/report-N, report-1 and report-kill; RESULTS_DIR/steps.tsv lists each step's exit
# status and seconds; RESULTS_DIR/digests.txt compares the served tokens of N ranks and 1 GPU per concurrency.
set -u
R=${1:?usage: gpu-runs/gpu_dist.sh RESULTS_DIR NGPU [PRESET] [CKPT_DIR]}
N=${2:?usage: gpu-runs/gpu_dist.sh RESULTS_DIR NGPU [PRESET] [CKPT_DIR]}
P=${3:-k3-prefix-4}
CK=${4:-/tmp/$P}
SCALE=${SWEEP_SCALE:-1}
PY=${PYTHON:-python3}
K3="$PY -m k3rocm.cli"
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$R"
export PYTHONUNBUFFERED=1 COLUMNS=160

STEP_TAG=dist
. "$(dirname "$0")/steps.sh"

sed -e "s/^name = .*/name = \"h200-$N\"/" -e "s/^count = 8/count = $N/" -e "s/^tp = 8/tp = $N/" \
    -e "s/^ep = 8/ep = $N/" "$HERE/hwprofiles/h200-8.toml" >"$R/h200-$N.toml"
PROF="$R/h200-$N.toml"
LOAD=(--concurrency 1,8,64 --input-len 256 --output-len 64 --num-prompts 128 --warmups 16)

if [ ! -f "$CK/model.safetensors.index.json" ]; then
  step make 300 $K3 checkpoint make --preset "$P" --out "$CK" --expert-init codes
fi
step load 300 $K3 load --checkpoint "$CK" --profile "$PROF" --out "$R/report-$N"
step validate 900 $K3 validate --checkpoint "$CK" --profile "$PROF" --level performance --out "$R/report-$N"
step bench 600 $K3 bench --checkpoint "$CK" --profile "$PROF" "${LOAD[@]}" --out "$R/report-$N"
step bench1 600 $K3 bench --checkpoint "$CK" --profile h200-1 "${LOAD[@]}" --out "$R/report-1"
$PY - "$R" "$N" >"$R/digests.txt" 2>&1 <<'EOF'
import json, sys
r, n = sys.argv[1], sys.argv[2]
def rows(d):
    try:
        ev = json.load(open(f"{r}/{d}/report.json"))["stages"]["bench"]["evidence"]
    except (OSError, KeyError, ValueError) as e:
        return {}
    return {e["name"]: e["value"] for e in ev}
a, b = rows(f"report-{n}"), rows("report-1")
for c in (1, 8, 64):
    k = f"c{c}.outputs_sha256"
    print(f"c{c}: tokens {'equal' if a.get(k) and a.get(k) == b.get(k) else 'DIFFER'}; output tok/s "
          f"{a.get(f'c{c}.output_throughput')} on {n} GPUs vs {b.get(f'c{c}.output_throughput')} on 1")
EOF
cat "$R/digests.txt"
# a rank killed mid-bench: the run must end with one line naming the rank, exit 3, and leave no process behind
KILL_AFTER=${KILL_AFTER:-90}
(
  $K3 bench --checkpoint "$CK" --profile "$PROF" --concurrency 64 --input-len 256 --output-len 512 \
      --num-prompts 640 --out "$R/report-kill" >"$R/kill.log" 2>&1 &
  pid=$!
  sleep "$KILL_AFTER"
  victim=$(for t in /proc/$pid/task/*; do cat "$t/children" 2>/dev/null; done | tr ' ' '\n' | \
           while read -r c; do [ -n "$c" ] && grep -q spawn_main "/proc/$c/cmdline" 2>/dev/null && echo "$c"; done | head -1)
  echo "killing rank process $victim of $pid" >>"$R/kill.log"
  [ -n "$victim" ] && kill -9 "$victim"
  t0=$(date +%s); wait "$pid"; rc=$?
  left=$(ps -o pid= --ppid "$pid" 2>/dev/null | wc -l)
  printf 'kill\t%s\t%s\torphans=%s\n' "$rc" "$(( $(date +%s) - t0 ))" "$left" >>"$R/steps.tsv"
)
tail -2 "$R/kill.log"
cat "$R/steps.tsv"
