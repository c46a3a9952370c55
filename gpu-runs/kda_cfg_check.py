"""GPU check aid: run the KDA prefill with each state config forced, one subprocess per config (an illegal
address kills the CUDA context), with CUDA_LAUNCH_BLOCKING=1; print one JSON line per (config, case): ok / error,
ms, rel. RMS against the IEEE-products run of the same inputs."""
import json
import os
import subprocess
import sys

import torch


def one(idx: int, case: str) -> dict:
    import triton.testing as tt
    from k3rocm.kernels import tune
    from k3rocm.kernels.kda import configs as C
    from k3rocm.kernels.kda import prefill as P
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_kda import prefill_inputs
    cfgs = tune.configs(C.STATE)
    cfg = cfgs[idx]
    if case == "row":
        a = prefill_inputs(1, 8192, 96)
    else:  # varlen with initial states
        a = prefill_inputs(1, 331, 4)
        a["cu_seqlens"] = torch.tensor([0, 70, 75, 203, 331], dtype=torch.int32, device="cuda")
        a["initial_state"] = torch.randn(4, 4, 128, 128, device="cuda") * 0.1
    run = lambda: P.kda_prefill(**a, out_dtype=torch.float32, config={"state": cfg})  # noqa: E731
    o, ht = run()
    torch.cuda.synchronize()
    ref, rht = P.kda_prefill(**a, out_dtype=torch.float32, products="ieee")
    rel = ((o - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    relh = ((ht - rht).pow(2).mean().sqrt() / rht.pow(2).mean().sqrt()).item()
    ms = tt.do_bench(run, warmup=10, rep=50) if case == "row" else None
    return dict(idx=idx, cfg={k: v for k, v in cfg.items()}, case=case, ok=True, ms=ms, rel_rms=rel, rel_ht=relh)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        print("RESULT " + json.dumps(one(int(sys.argv[1]), sys.argv[2])), flush=True)
        sys.exit(0)
    from k3rocm.kernels import tune
    from k3rocm.kernels.kda import configs as C
    n = len(tune.configs(C.STATE))
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for case in ("varlen", "row"):
        for i in range(n):
            p = subprocess.run([sys.executable, __file__, str(i), case], capture_output=True, text=True, env=env,
                               timeout=120)
            res = [ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if res:
                print(res[0], flush=True)
            else:
                err = (p.stderr.strip().splitlines() or ["?"])[-1]
                tb = [ln for ln in p.stderr.splitlines() if "prefill.py" in ln]
                print(json.dumps(dict(idx=i, case=case, ok=False, error=err[:300], where=tb[-3:])), flush=True)
