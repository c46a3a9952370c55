"""Code shared by several test modules (fixtures live in ``tests/conftest.py``).

* :data:`REPO` — the repository root (the scripts in ``gpu-runs/``, ``hwprofiles/``, the Makefile).
* :data:`DATA`, :data:`DEFAULT_GOLDEN`, :data:`OFFICIAL_CONFIG` — the reference data shipped in ``tests/data/``
  (its README gives the provenance; ``$K3ROCM_GOLDEN``, read by ``conftest.golden_dir``, may name another copy).
* :func:`load_ckpt` — a checkpoint directory as ``(cfg, {full name: tensor})``.
* :class:`FakeCompletions` — an OpenAI-style streaming ``/v1/completions`` handler (``conftest.fake_server``
  serves it on a local port).
* :func:`random_experts`, :func:`near_tie_router_inputs`, :func:`latent_layer_inputs` — MoE inputs that the
  oracle tests and the Triton kernel tests both use.
* :func:`script_module` — one of the ``gpu-runs/*.py`` scripts imported as a module (by its file path).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from k3rocm.config import K3Config

REPO = Path(__file__).resolve().parents[1]
# shipped with the repository, so that no test depends on anything beside the clone
DATA = REPO / "tests" / "data"
DEFAULT_GOLDEN = DATA / "k3-tiny-golden"
OFFICIAL_CONFIG = DATA / "kimi-k3" / "config.json"


# ------------------------------------------------------------------------------------------------ checkpoints
def load_ckpt(ckpt: Path):
    """``(cfg, {full name: tensor})`` of a checkpoint directory (all shards of its index)."""
    cfg = K3Config.from_file(ckpt / "config.json")
    idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
    w = {}
    for shard in sorted(set(idx["weight_map"].values())):
        w.update(load_file(str(ckpt / shard)))
    return cfg, w


# ------------------------------------------------------------------------------------------------ endpoint
class FakeCompletions(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` text chunks 3 ms apart, then a usage chunk and ``[DONE]``.

    ``seen`` collects ``(path, body)`` of every request; a request whose prompt equals ``stall_after`` stops
    for 3 s after its first token and then closes the stream (a hang for the watchdog to catch).
    """

    seen: list = []
    stall_after = None

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeCompletions.seen.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            if FakeCompletions.stall_after is not None and body["prompt"] == FakeCompletions.stall_after and i == 1:
                time.sleep(3.0)
                return
            time.sleep(0.003)
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": f"t{i}"}]}).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


# ------------------------------------------------------------------------------------------------ MoE inputs
def random_experts(E, D, inter, seed=0, scale_lo=119, scale_hi=122, first=0):
    """Random packed MXFP4 experts: ``E`` experts of hidden ``D`` and intermediate ``inter`` (uint8 codes, E8M0
    scales in ``[scale_lo, scale_hi]``), numbered from ``first``."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        w13_packed=torch.randint(0, 256, (E, 2 * inter, D // 2), dtype=torch.uint8, generator=g),
        w13_scale=torch.randint(scale_lo, scale_hi + 1, (E, 2 * inter, D // 32), dtype=torch.uint8, generator=g),
        w2_packed=torch.randint(0, 256, (E, D, inter // 2), dtype=torch.uint8, generator=g),
        w2_scale=torch.randint(scale_lo, scale_hi + 1, (E, D, inter // 32), dtype=torch.uint8, generator=g),
        num_experts=E, first_expert=first)


def near_tie_router_inputs(T, E, D, k, seed=0):
    """Router inputs where pairs of experts have biased scores closer than bf16 resolution (and one exact tie).

    Experts 2j and 2j+1 share a gate row; the bias of the higher id is larger by ~2^-14 (bf16 resolution at
    scores ~1 is 2^-8), so the higher id must win; experts E-2 and E-1 tie exactly (the lower id must win).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    w = (torch.randn(E // 2, D, generator=g) * D ** -0.5).bfloat16().repeat_interleave(2, 0)
    bias = (torch.rand(E // 2, generator=g) * 0.01).repeat_interleave(2, 0)
    bias[1::2] += 2.0 ** -14
    bias[-1] = bias[-2]
    return x, w, bias.float()


def latent_layer_inputs(seed: int, T: int, expert_seed: int):
    """A small Stable LatentMoE layer (hidden 96, latent 64, 16 experts top-4, shared width 128), bf16
    weights with realistic scales: ``(x, gate, bias, down, normw, up, sg, su, sd, ew, k)``."""
    g = torch.Generator().manual_seed(seed)
    H, L, inter, S, E, k = 96, 64, 64, 128, 16, 4
    x = torch.randn(T, H, generator=g).bfloat16()
    gate = (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    bias = torch.randn(E, generator=g) * 0.01
    down = (torch.randn(L, H, generator=g) * H ** -0.5).bfloat16()
    normw = (1 + 0.1 * torch.randn(L, generator=g)).bfloat16()
    up = (torch.randn(H, L, generator=g) * L ** -0.5).bfloat16()
    sg, su = ((torch.randn(S, H, generator=g) * H ** -0.5).bfloat16() for _ in range(2))
    sd = (torch.randn(H, S, generator=g) * S ** -0.5).bfloat16()
    return x, gate, bias, down, normw, up, sg, su, sd, random_experts(E, L, inter, seed=expert_seed), k


# ------------------------------------------------------------------------------------------------ scripts
def script_module(name: str) -> ModuleType:
    """``gpu-runs/<name>.py`` imported as a module from its file (the folder is scripts, not a package)."""
    path = REPO / "gpu-runs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"script_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------------ interpreter
def run_module_in_interpreter(test_file: str, timeout_s: float = 600) -> None:
    """Run the test module ``test_file`` in a fresh pytest process with ``TRITON_INTERPRET=1`` (for modules whose
    kernels must be interpreted but whose process may already hold compiled-mode Triton); fails with the child's
    output when any of its tests fails. Skips when kernels run in this process anyway (a GPU is present, or
    ``TRITON_INTERPRET=1`` is already set)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("kernels run in this process (GPU present or TRITON_INTERPRET=1 already)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-x"],
                         env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


@contextlib.contextmanager
def interpreter_without_gpu():
    """``TRITON_INTERPRET=1`` for the duration when no GPU is present (kernels are compiled-mode objects that switch
    to the interpreter at launch time), the variable restored after; with a GPU nothing changes. For module-scoped
    kernel fixtures: ``with interpreter_without_gpu(): yield importlib.import_module(...)``."""
    old = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
