#!/usr/bin/env bash
# The engine at K3 depth on one GPU, with synthetic weights (no checkpoint on disk), in one deadline:
#
#   gpu-runs/gpu_engine.sh RESULTS_DIR [STEPS]
#
# STEPS (default "p4 k3 prof cprof etest"), each with its own time limit, all inside DEADLINE seconds (default
# 540: one call of a 10-minute machine slot):
#   p4     k3rocm bench --synthetic --preset k3-prefix-4 --tp 1 --ep 1 --concurrency 1,8,64 (input 256 / output
#          64, 64 prompts): the decode-step goals of docs/BENCHMARKS.md, every step logged (p4_steps/steps.jsonl)
#   adec   gpu-runs/bench_attnres_decode.py: every AttnRes config at decode sizes as the engine calls it (graphed)
#   p4a    p4 with each dense projection of <= 64 rows on the faster of the vendor and the skinny GEMM (a timed pick
#          per shape: DENSE_GEMM=auto of prof_steps.py), into RESULTS_DIR/p4a
#   k3a    k3 with the per-shape pick between the vendor and the skinny GEMM (DENSE_GEMM=auto), into RESULTS_DIR/k3a
#   p4t    p4 with the engine's dense projections of <= 64 rows on the Triton skinny GEMM (DENSE_GEMM=triton of
#          prof_steps.py), into RESULTS_DIR/p4t
#   k3     the same at the official depth as rank 0 of TP16/EP16 on --profile mi355x-8, concurrency 64 (K3_LIMIT s,
#          default 140)
#   k3g    k3 with the routing's per-expert grouping launch (ROUTER_GROUPING=experts of prof_steps.py), into
#          RESULTS_DIR/k3g
#   prof   the K3 rank again with torch.profiler over steps 75..114 after warm-up (the last chunk steps and the
#          widest decode steps; K3_PROF_AFTER / K3_PROF_N move and size the window): device time per kernel per
#          step kind in prof/kernels_1.txt
#   prof1  the same at concurrency 1 (4 prompts): the one-row decode step kernel by kernel, steps 8..27 (prof1/)
#   cprof  the K3 rank with cProfile of two chunk steps of the bench's warm-up requests (host time per function;
#          CPROF_AFTER / CPROF_N move and size the window, e.g. 75 / 3 for mixed steps of the measured requests)
#   skew   gpu-runs/route_skew.py on the K3 rank (K3_PRESET): how evenly the engine's router spreads a 64-prompt
#          prefill and 3 decode steps over the experts, per MoE layer, against uniform routing (skew.json)
#   host   the K3 rank with the host time of steps CPROF_AFTER.. (default 75, 3 steps) split into graph-piece replays and
#          eager chunk halves, no profiler (host/host.jsonl)
#   syncs  the K3 rank with every host-device synchronising call of steps CPROF_AFTER.. (default 75, 3 steps: mixed
#          steps of the measured requests) counted by call site (syncs/syncs_<i>.txt)
#   rtest  the routing tests compiled (tests/kernels/test_moe_route.py; ROUTE_TESTS: a pytest -k expression)
#   etest  pytest -m gpu tests/runtime/test_engine.py (graph vs eager, padded rows, 0 compiles at random lengths)
#   mtest  the MoE kernels' GPU tests (tests/kernels/test_moe_gpu.py, test_moe_triton.py compiled; MTEST_LIMIT s, default
#          160 (the whole pair needs more on a cold machine); MOE_TESTS: a
#          pytest -k expression)
#   ktest  the KDA GPU tests selected by KDA_TESTS (a pytest -k expression; default: the per-config, tuned-default
#          and fp32-split tests), figures into RESULTS_DIR/kda_gpu.jsonl
#   kda    gpu-runs/bench_kda.py prefill rows with the per-launch and per-kernel tables (ours and fla's chunk_kda
#          where fla is importable; KDA_BENCH_ARGS replaces those arguments; KDA_LIMIT s, default 240), into
#          RESULTS_DIR/kda/
#   ksweep gpu-runs/bench_kda.py --only sweep: every intra / wu / state / out config, the gate per num_warps and the
#          precision variants (time per launch, accuracy), into RESULTS_DIR/ksweep/ (KSWEEP_ARGS: e.g.
#          "--prefill 1x8192x96" for other rows than B1 T8192 H96 and B1 T131072 H12)
#   attn   gpu-runs/sweep_attn.py: MLA decode (configs x split counts), MLA prefill (vs SDPA) and AttnRes config
#          sweeps beyond the shipped tables, into RESULTS_DIR/attn/ (ATTN_PARTS picks parts, default all three;
#          ATTN_LIMIT its seconds, default 330)
#   mla    gpu-runs/bench_mla.py goal tables (MLA decode / prefill vs SDPA, AttnRes, odd head dims; MLA_PARTS picks
#          parts), into RESULTS_DIR/mla/
#   mltest the MLA / AttnRes GPU tests (tests/kernels/test_mla_gpu.py; MLA_TESTS: a pytest -k expression)
#   atest  the AttnRes GPU test alone (every config, 20 x identical), in its own process
#   kchk   gpu-runs/kda_quick_check.py: the candidate gate / intra / w-u / state configs' accuracy (fp16 form, packed
#          batch, both decays), 5 x identical and finite at B1 T8192 H96 (KCHK_ARGS, e.g. "--all --kinds state";
#          KCHK_LIMIT s, default 150), into kchk.log
#   kdec   gpu-runs/bench_kda.py --only decode: every decode config, the default path, graphed, and fla's
#          fused_recurrent_kda where importable, into RESULTS_DIR/kdec/
#   ncu    Nsight Compute (`ncu --set full`, where the machine has it) of the first NCU_COUNT (default 2: w1|w3 and
#          w2 of the served config) decode-path MoE GEMM launches of `bench_moe.py --tokens ${NCU_TOKENS:-64}`: every
#          section's details in ncu.log
#   kncu   Nsight Compute of one KDA decode launch (`bench_kda.py --only decode --decode ${KNCU_ROWS:-64x96}`: the
#          first launch of a kernel matching NCU_KERNEL (default _split_state_kernel, the served config's state grid;
#          _decode_kernel for the fused one) after NCU_SKIP (default 60) warm ones), into kncu.log; KNCU_ARGS replaces
#          the bench arguments (e.g. "--only prefill --no-fla --prefill 1x8192x96" with NCU_KERNEL=_state_kernel and
#          K3ROCM_TUNE=0, so the launch profiled is the table's first config)
#   dense  gpu-runs/bench_dense.py: the skinny GEMM's configs against the vendor GEMM on a K3 rank's dense projections
#          at 1 / 16 / 53 / 64 token rows, graph-replayed (DENSE_ARGS, DENSE_LIMIT s, default 120), into RESULTS_DIR/dense/
#   apend  tests/kernels/test_attnres.py -k "pending or every_config" (ATTNRES_TESTS replaces the selection,
#          ATTNRES_LIMIT the 60 s): the decoder's pending prefix add inside AttnRes, every config, on the GPU
#   mncu   Nsight Compute of the served MoE config's two GEMM launches (w1|w3, w2) on one rank's expert slice
#          (bench_moe_decode.py --served-only, EP${MNCU_EP:-16}, ${MNCU_TOKENS:-512} tokens), into mncu.log
#   moe    gpu-runs/bench_moe.py goal table (one K3 layer at 64 / 512 / 8192 tokens and the EP8 slice) with the
#          per-config sweep and the fp32-oracle check, into RESULTS_DIR/moe/ (MOE_ARGS replaces those arguments,
#          MOE_LIMIT the 200 s)
# BENCH_ARGS (optional) is appended to the p4 / k3 / prof / cprof bench commands (e.g. "--max-num-batched-tokens 1024").
# MDEC_ARGS: bench_moe_decode.py (step mdec: the experts at 1 - 64 tokens on one rank's slice, every decode config
# and split-K of the served tile, graph-replayed). K3_PRESET (default k3) is the preset of the one-rank TP16/EP16 steps (k3, k3a, prof, cprof): k3-prefix-56 fits an
# 80 GB card (~65 GB of weights), the whole k3 (~108 GB) needs a card of >= 100 GB. ROUTE_ARGS: bench_route.py (step route).
# RESULTS_DIR/steps.tsv lists each step's exit status and seconds; the rest (reports, bench step logs, profiles)
# ends up in RESULTS_DIR/results.tgz unless PACK=0. On a copied tree without git metadata, run it as
# `K3ROCM_SOURCE_COMMIT=$(git rev-parse HEAD) gpu-runs/gpu_engine.sh ...` (the sha written out where the copy has
# no git) so the reports name the commit. Uses the installed package, else assembles it
# under /tmp (K3ROCM_PKG_DIR) from this checkout. The profiled runs disturb their own bench figures: quote p4 / k3.
set -u
R=${1:?usage: gpu-runs/gpu_engine.sh RESULTS_DIR [STEPS]}
STEPS=${2:-p4 k3 prof cprof etest}
SCALE=${SWEEP_SCALE:-1}
PY=${PYTHON:-python3}
K3="$PY -m k3rocm.cli.main"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$R"; R=$(cd "$R" && pwd)
# wheels the machine lacks (fla-core for the KDA peers), carried in out/wheels of the checkout
if ls "$HERE"/../out/wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps "$HERE"/../out/wheels/*.whl >"$R/wheels.log" 2>&1 || echo "wheels: install failed (see wheels.log)"
fi
export PYTHONUNBUFFERED=1 COLUMNS=160
if ! $PY -c "import k3rocm.kernels, k3rocm.cli" 2>/dev/null; then
  # not installed: assemble pyproject.toml's package layout (package-dir) under /tmp, with the tests beside it,
  # and run from there (from the repository root, `import k3rocm` would find the bare k3rocm/ first)
  ROOT=$(cd "$HERE/.." && pwd); PK=${K3ROCM_PKG_DIR:-/tmp/k3rocm_pkg}
  rm -rf "$PK"; mkdir -p "$PK"; cp -a "$ROOT/k3rocm" "$ROOT/tests" "$ROOT/gpu-runs" "$ROOT/pyproject.toml" "$PK/"
  for d in kernels cli validation hwprofiles; do rm -rf "$PK/k3rocm/$d"; cp -a "$ROOT/$d" "$PK/k3rocm/$d"; done
  export PYTHONPATH=$PK${PYTHONPATH:+:$PYTHONPATH}
  cd "$PK"; HERE=$PK/gpu-runs
fi
STEP_TAG=engine
. "$HERE/steps.sh"
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
lim() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 5 ? l - 3 : 1 )); }
A="--input-len 256 --output-len 64 --num-prompts 64"
A="$A ${BENCH_ARGS:-}"
RANK="--synthetic --preset ${K3_PRESET:-k3} --profile mi355x-8 --tp 16 --ep 16 --rank 0 --concurrency 64 $A --warmups 4"
for s in $STEPS; do
  if [ "$(left)" -lt 20 ]; then printf '%s\tskipped\t0\n' "$s" >>"$R/steps.tsv"; continue; fi
  case $s in
    p4a) DENSE_GEMM=auto PROF_OUT=$R/p4a_steps PROF_AFTER=1000000 PROF_N=0 step p4a "$(lim 200)" $PY "$HERE/prof_steps.py" \
          bench --synthetic --preset k3-prefix-4 --tp 1 --ep 1 --concurrency 1,8,64 $A --warmups 8 --out "$R/p4a" ;;
    p4t) DENSE_GEMM=triton PROF_OUT=$R/p4t_steps PROF_AFTER=1000000 PROF_N=0 step p4t "$(lim 200)" $PY "$HERE/prof_steps.py" \
          bench --synthetic --preset k3-prefix-4 --tp 1 --ep 1 --concurrency 1,8,64 $A --warmups 8 --out "$R/p4t" ;;
    p4) PROF_OUT=$R/p4_steps PROF_AFTER=1000000 PROF_N=0 step p4 "$(lim 200)" $PY "$HERE/prof_steps.py" bench \
          --synthetic --preset k3-prefix-4 --tp 1 --ep 1 --concurrency 1,8,64 $A --warmups 8 --out "$R/p4" ;;
    k3a) DENSE_GEMM=auto PROF_OUT=$R/k3a_steps PROF_AFTER=1000000 PROF_N=0 step k3a "$(lim "${K3_LIMIT:-140}")" $PY \
          "$HERE/prof_steps.py" bench $RANK --out "$R/k3a" ;;
    k3g) ROUTER_GROUPING=experts PROF_OUT=$R/k3g_steps PROF_AFTER=1000000 PROF_N=0 step k3g "$(lim "${K3_LIMIT:-140}")" \
          $PY "$HERE/prof_steps.py" bench $RANK --out "$R/k3g" ;;
    k3) PROF_OUT=$R/k3_steps PROF_AFTER=1000000 PROF_N=0 step k3 "$(lim "${K3_LIMIT:-140}")" $PY "$HERE/prof_steps.py" bench \
          $RANK --out "$R/k3" ;;
    prof) PROF_OUT=$R/prof PROF_AFTER=${K3_PROF_AFTER:-75} PROF_N=${K3_PROF_N:-40} step prof "$(lim 180)" $PY "$HERE/prof_steps.py" bench \
          $RANK --out "$R/k3_prof" ;;
    prof1) PROF_OUT=$R/prof1 PROF_AFTER=${K3_PROF_AFTER:-8} PROF_N=${K3_PROF_N:-20} step prof1 "$(lim 150)" $PY \
          "$HERE/prof_steps.py" bench $RANK --concurrency 1 --num-prompts 4 --out "$R/k3_prof1" ;;
    cprof) PROF_MODE=cprofile PROF_OUT=$R/cprof PROF_AFTER=${CPROF_AFTER:-1} PROF_N=${CPROF_N:-2} step cprof "$(lim 140)" $PY \
          "$HERE/prof_steps.py" bench $RANK --out "$R/k3_cprof" ;;
    skew) step skew "$(lim "${SKEW_LIMIT:-150}")" $PY "$HERE/route_skew.py" --device cuda --kernels triton --synthetic \
          --preset "${K3_PRESET:-k3}" --profile mi355x-8 --tp 16 --ep 16 --batch 64 --prompt-len 128 --steps 3 \
          --json "$R/skew.json" ;;
    host) PROF_MODE=host PROF_OUT=$R/host PROF_AFTER=${CPROF_AFTER:-75} PROF_N=${CPROF_N:-3} step host "$(lim "${K3_LIMIT:-140}")" $PY \
          "$HERE/prof_steps.py" bench $RANK --out "$R/k3_host" ;;
    syncs) PROF_MODE=syncs PROF_OUT=$R/syncs PROF_AFTER=${CPROF_AFTER:-75} PROF_N=${CPROF_N:-3} step syncs "$(lim 140)" $PY \
          "$HERE/prof_steps.py" bench $RANK --out "$R/k3_syncs" ;;
    rtest) step rtest "$(lim "${RTEST_LIMIT:-120}")" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_moe_route.py \
          ${ROUTE_TESTS:+-k "$ROUTE_TESTS"} ;;
    etest) step etest "$(lim 150)" $PY -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_engine.py ;;
    mtest) K3ROCM_MOE_GPU_LOG="$R/moe_gpu.jsonl" step mtest "$(lim "${MTEST_LIMIT:-160}")" $PY -m pytest -q -p no:cacheprovider \
          tests/kernels/test_moe_gpu.py tests/kernels/test_moe_triton.py ${MOE_TESTS:+-k "$MOE_TESTS"} ;;
    ktest) KDA_GPU_LOG="$R/kda_gpu.jsonl" step ktest "$(lim 170)" $PY -m pytest -q -p no:cacheprovider \
          tests/kernels/test_kda_gpu.py -k "${KDA_TESTS:-every_config or tuned_default or split}" ;;
    kda) step kda "$(lim ${KDA_LIMIT:-240})" $PY "$HERE/bench_kda.py" ${KDA_BENCH_ARGS:---only prefill,accuracy --kernels} --out "$R/kda" ;;
    ksweep) step ksweep "$(lim 200)" $PY "$HERE/bench_kda.py" --only sweep --no-fla ${KSWEEP_ARGS:-} --out "$R/ksweep" ;;
    attn) step attn "$(lim "${ATTN_LIMIT:-330}")" $PY "$HERE/sweep_attn.py" --only "${ATTN_PARTS:-decode,prefill,attnres}" \
          --deadline "$(( $(lim "${ATTN_LIMIT:-330}") - 30 ))" --out "$R/attn" ;;
    mla) step mla "$(lim 150)" $PY "$HERE/bench_mla.py" --no-peers --only "${MLA_PARTS:-decode,prefill,attnres,odd}" \
          --out "$R/mla" ;;
    mltest) step mltest "$(lim 200)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_mla_gpu.py \
          ${MLA_TESTS:+-k "$MLA_TESTS"} ;;
    atest) step atest "$(lim 120)" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_mla_gpu.py -k attnres ;;
    apend) step apend "$(lim ${ATTNRES_LIMIT:-60})" $PY -m pytest -q -p no:cacheprovider tests/kernels/test_attnres.py \
          -k "${ATTNRES_TESTS:-pending or every_config}" ;;
    kchk) step kchk "$(lim ${KCHK_LIMIT:-150})" $PY "$HERE/kda_quick_check.py" ${KCHK_ARGS:-} ;;
    kdec) step kdec "$(lim 150)" $PY "$HERE/bench_kda.py" --only decode ${KDEC_ARGS:-} --out "$R/kdec" ;;
    ncu) step ncu "$(lim 200)" ncu --target-processes all --kernel-name regex:moe_gemm_dq --launch-count "${NCU_COUNT:-2}" \
          --set full $PY "$HERE/bench_moe.py" --tokens "${NCU_TOKENS:-64}" --no-bf16 --out "$R/ncu_moe" ;;
    kncu) step kncu "$(lim 150)" ncu --target-processes all --kernel-name "regex:${NCU_KERNEL:-_split_state_kernel}" \
          --launch-skip "${NCU_SKIP:-60}" --launch-count 1 --set full $PY "$HERE/bench_kda.py" \
          ${KNCU_ARGS:---only decode --no-fla --decode "${KNCU_ROWS:-64x96}"} --out "$R/kncu" ;;
    mncu) step mncu "$(lim 150)" ncu --target-processes all --kernel-name regex:moe_gemm_dq --launch-count 2 \
          --set full $PY "$HERE/bench_moe_decode.py" --served-only --ep-ranks "${MNCU_EP:-16}" \
          --tokens "${MNCU_TOKENS:-512}" --out "$R/mncu_${MNCU_TOKENS:-512}" ;;
    mdec) step mdec "$(lim "${MDEC_LIMIT:-200}")" $PY "$HERE/bench_moe_decode.py" ${MDEC_ARGS:---ep-ranks 16} --out "$R/mdec" ;;
    route) step route "$(lim "${ROUTE_LIMIT:-120}")" $PY "$HERE/bench_route.py" ${ROUTE_ARGS:---tokens 1 4 8 64 256} --out "$R/route" ;;
    adec) step adec "$(lim "${ADEC_LIMIT:-90}")" $PY "$HERE/bench_attnres_decode.py" ${ADEC_ARGS:-} ;;
    dense) step dense "$(lim "${DENSE_LIMIT:-120}")" $PY "$HERE/bench_dense.py" ${DENSE_ARGS:-} --out "$R/dense" ;;
    moe) step moe "$(lim "${MOE_LIMIT:-200}")" $PY "$HERE/bench_moe.py" ${MOE_ARGS:---tokens 64 512 8192 --check} \
          --out "$R/moe" ;;
    *) echo "unknown step $s (p4 k3 skew prof cprof syncs etest mtest ktest kda ksweep attn mla mltest atest apend kchk kdec ncu kncu moe dense p4t p4a adec k3a route prof1 mdec)" >&2 ;;
  esac
done
# The machine hands back only so many files: unless PACK=0, everything but the step logs goes into one archive,
# RESULTS_DIR/results.tgz (reports' JSON / Markdown / HTML, step logs of the benches, profiles), and is removed
# from the folder, so the logs, steps.tsv and the archive all come back
if [ "${PACK:-1}" != 0 ]; then
  ( cd "$R" && find . -mindepth 1 -maxdepth 1 ! -name '*.log' ! -name steps.tsv ! -name results.tgz -print0 \
      | xargs -0 -r tar czf results.tgz --exclude=.report.lock && find . -mindepth 1 -maxdepth 1 ! -name '*.log' \
      ! -name steps.tsv ! -name results.tgz -exec rm -rf {} + ) || echo "pack: could not archive the results"
fi
cat "$R/steps.tsv"
