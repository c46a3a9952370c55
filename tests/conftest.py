"""Shared pytest fixtures.

* ``golden_dir`` — the external k3-tiny golden data (checkpoint written in the released layout by
  Moonshot's code + fp32 reference outputs), shipped in ``tests/data/k3-tiny-golden``; ``$K3ROCM_GOLDEN``
  may name another copy. Absent, the tests that need it fail (they are never skipped).
* ``golden_ckpt`` — ``golden_dir / "checkpoint"``.
* ``tiny_cfg`` — the ``k3-tiny`` preset config.
* ``tiny_ckpt`` — a k3-tiny checkpoint written once per session by our writer (seed 0) into a temp dir.
  Treat it as read-only: copy it (``shutil.copytree``) before damaging it.
* ``fake_server`` — :class:`tests.helpers.FakeCompletions` on a local port (its ``seen`` list emptied first).

Code shared between test modules (not fixtures) is in ``tests/helpers.py``; test modules import nothing
from each other.
"""

from __future__ import annotations

import os
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.helpers import DEFAULT_GOLDEN, FakeCompletions


# The CI machine has 2 cores and runs 2 pytest workers: one intra-op thread per worker avoids
# threads spinning against each other (a tiny test went from 55 s to 3 s).
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm GPU (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: long CPU test")


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """Directory of the external k3-tiny golden data (``checkpoint/``, ``golden.safetensors``)."""
    p = Path(os.environ.get("K3ROCM_GOLDEN", DEFAULT_GOLDEN))
    if not (p / "checkpoint" / "config.json").is_file():
        pytest.fail(f"k3-tiny golden data not found at {p}: it ships in tests/data/k3-tiny-golden "
                    "(or $K3ROCM_GOLDEN names a copy)")
    return p


@pytest.fixture(scope="session")
def golden_ckpt(golden_dir: Path) -> Path:
    """The golden k3-tiny checkpoint directory (read-only)."""
    return golden_dir / "checkpoint"


@pytest.fixture(scope="session")
def tiny_cfg():
    """The ``k3-tiny`` preset (:class:`k3rocm.config.K3Config`)."""
    from k3rocm.config import preset

    return preset("k3-tiny")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_cfg) -> Path:
    """A k3-tiny checkpoint written by ``write_checkpoint(seed=0)``, once per test session (read-only)."""
    from k3rocm.checkpoint.writer import write_checkpoint

    out = tmp_path_factory.mktemp("k3-tiny") / "checkpoint"
    return write_checkpoint(tiny_cfg, out, seed=0)


@pytest.fixture
def fake_server():
    """A :class:`ThreadingHTTPServer` serving :class:`FakeCompletions` on 127.0.0.1 (``server_address[1]``: port)."""
    FakeCompletions.seen = []
    FakeCompletions.stall_after = None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()
