# Sourced by the gpu-runs/*.sh scripts: run one step with its own time limit and log its exit status.
#   step NAME LIMIT_S CMD...   -> CMD under `timeout LIMIT_S * SWEEP_SCALE`, output in $R/NAME.log, a line
#                                 "NAME<TAB>rc<TAB>seconds" in $R/steps.tsv. Needs R (results dir) and SCALE set;
#                                 STEP_TAG (the script's name) prefixes the console line, STEP_GPU (optional) sets
#                                 CUDA_VISIBLE_DEVICES for the step.
step() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  if [ -n "${STEP_GPU:-}" ]; then
    CUDA_VISIBLE_DEVICES=$STEP_GPU timeout -k 5 $((limit * SCALE)) "$@" >"$R/$name.log" 2>&1
  else
    timeout -k 5 $((limit * SCALE)) "$@" >"$R/$name.log" 2>&1
  fi
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >>"$R/steps.tsv"
  echo "[${STEP_TAG:-run}] $name rc=$rc"
}
