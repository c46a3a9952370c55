"""GPU check aid: the decode kinds dq / dqp / dqw / dqn / dqnp at the test's small shapes and at the served m16
tile, each against the plain kind through the same entry point (_experts_impl): max |diff|, rel. max diff."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.kernels.test_moe_triton import _case, _to  # noqa: E402

import k3rocm.kernels.moe as moe  # noqa: E402
import k3rocm.kernels.moe.configs as C  # noqa: E402

for tiled in (False, True):
    for T, E, D, inter in ((1, 8, 64, 64), (3, 16, 64, 96), (9, 4, 128, 64), (64, 32, 256, 256)):
        x, ids, wts, ew = _case(T, E, D, inter, 4, seed=T + E)
        ewd = _to(ew, "cuda")
        if tiled:
            ewd = dict(ewd, kernel_layout=moe.ops.kernel_layout(ewd, check=True))
        args = (x.cuda(), ids.cuda(), wts.cuda())
        for base, kinds in ((C.gemm_config(16, 32, 64, 4, 1, kind="dq"), ("dq", "dqp", "dqw")),
                            (C.gemm_config(16, 128, 64, 8, 4, kind="dq"), ("dq", "dqp")),
                            (C.gemm_config(32, 64, 32, 4, 1, kind="dqn"), ("dqn", "dqnp"))):
            if base["BLOCK_N"] > 2 * inter:
                continue
            outs = {}
            for kind in kinds:
                cfg = dict(base, kind=kind)
                o, _ = moe.ops._experts_impl(*args, ewd, "situ", "a16w4", 4.0, 25.0, cfg, poison=True, stages={})
                o2, _ = moe.ops._experts_impl(*args, ewd, "situ", "a16w4", 4.0, 25.0, cfg, poison=True, stages={})
                outs[kind] = (o.float(), torch.equal(o, o2))
            ref = moe.moe_experts(*args, ewd, mode="a16w4", config=base).float()
            b = outs[kinds[0]][0]
            row = dict(tiled=tiled, shape=[T, E, D, inter], base=C.gemm_name(base),
                       plain_vs_moe_experts=(b - ref).abs().max().item())
            for kind, (o, rep) in outs.items():
                d = (o - b).abs().max().item()
                row[kind] = dict(max_abs=d, rel=d / max(b.abs().max().item(), 1e-30), repeat_equal=rep,
                                 nan=bool(torch.isnan(o).any()))
            print(json.dumps(row), flush=True)
