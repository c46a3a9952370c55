"""gpu-runs/peer_ogs.py without a GPU: the EP slice's pairs per token, the one-line ImportError, the table."""

import importlib.util
import json

import pytest

from tests.helpers import script_module

peer_ogs = script_module("peer_ogs")


def test_local_top_k_k3_ep8():
    assert peer_ogs.local_top_k(16, 896, None) == 16
    assert peer_ogs.local_top_k(16, 896, 112) == 2
    assert peer_ogs.local_top_k(16, 896, 8) == 1
    with pytest.raises(ValueError):
        peer_ogs.local_top_k(16, 896, 0)


@pytest.mark.skipif(importlib.util.find_spec("triton_kernels") is not None, reason="peer package present")
def test_absent_peer_one_line_and_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peer_ogs.ENV_VAR, str(tmp_path))
    with pytest.raises(ImportError) as exc:
        peer_ogs.find_triton_kernels()
    assert "\n" not in str(exc.value) and peer_ogs.ENV_VAR in str(exc.value)
    peer_ogs.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("not installed") == len(peer_ogs.ROWS)
    rows = json.loads((tmp_path / "peer_ogs.json").read_text())["rows"]
    assert [(r["tokens"], r["num_local"]) for r in rows] == peer_ogs.ROWS and rows[0]["ms"] is None
