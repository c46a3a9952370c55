"""The Triton GLU op (``kernels/moe/mlp.py``) against the fp32 oracle ``k3rocm.model.common.glu``: SiTU and SiLU,
fp32 and bf16 outputs, column views of one gate|up product, odd widths and edge rows; in the Triton interpreter on
CPU (a child process), compiled on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import run_module_in_interpreter

GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CHILD = not GPU and not INTERP


def test_in_interpreter_child_process():
    """On a machine without a GPU: every test below, in a fresh process with TRITON_INTERPRET=1."""
    run_module_in_interpreter(__file__)


@pytest.fixture(scope="module")
def dev():
    if CHILD:
        pytest.skip("run by test_in_interpreter_child_process")
    return "cuda" if GPU else "cpu"


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("T,I", [(1, 1), (3, 37), (5, 1024), (2, 1500), (0, 64)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_glu_matches_oracle(dev, act, T, I, out_dtype):
    from k3rocm.kernels.moe import glu
    from k3rocm.model.common import glu as oracle

    g = torch.Generator().manual_seed(T * 7919 + I)
    gu = torch.randn(T, 2 * I + 3, generator=g) * 8.0  # gate | up | 3 pad columns: the engine's fused product
    gu[:, :4] = torch.tensor([-60.0, 60.0, 0.0, -1e-3])[: min(4, gu.shape[1])] if T else gu[:, :4]
    gate, up = gu[:, :I].to(dev), gu[:, I:2 * I].to(dev)
    got = glu(gate, up, act, 4.0, 25.0, out_dtype=out_dtype)
    ref = oracle(gu[:, :I].double(), gu[:, I:2 * I].double(), act, 4.0, 25.0).double()  # fp64 oracle
    assert got.shape == (T, I) and got.dtype == out_dtype
    if T == 0:
        return
    err = (got.double().cpu() - ref).abs()
    # fp32 math (1e-6 of the |h| <= 100 bound); a bf16 output adds at most one bf16 ulp per element (2^-7 of the
    # value: round-to-nearest compiled, the interpreter's cast may truncate)
    tol = 1e-4 + (0.0 if out_dtype == torch.float32 else 2 ** -7) * ref.abs()
    assert bool((err <= tol).all()), f"{act} T{T} I{I} {out_dtype}: max err {err.max().item():.3g}"


def test_glu_rejects_bad_input(dev):
    from k3rocm.errors import ConfigError
    from k3rocm.kernels.moe import glu

    x = torch.randn(4, 8, device=dev)
    with pytest.raises(ConfigError, match="shape"):
        glu(x, x[:, :4])
    with pytest.raises(ConfigError, match="act"):
        glu(x, x, "gelu")
    with pytest.raises(ConfigError, match="column stride"):
        glu(x.t(), x.t())
