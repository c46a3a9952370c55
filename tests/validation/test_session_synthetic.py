"""The session of a ``--synthetic`` run: the layout on the profile's GPU kind, weights of one rank, a projected
group in the engine, measured-fallback and projected rows."""

from __future__ import annotations

import torch

from k3rocm.runtime.dist import ProjectedGroup
from k3rocm.validation.evidence import Stage
from k3rocm.validation.session import Options, Session

torch.set_num_threads(1)


def test_synthetic_session_rows(tmp_path):
    s = Session(Options(out=str(tmp_path / "r"), profile="mi355x-8", synthetic=True, preset="k3-tiny", tp=4, ep=2,
                        rank=3))
    s.preflight()
    assert s.measured_level == "measured-fallback" and s.world == 4 and s.placement.tp == 4
    rep = s.load().report
    assert rep.ok and rep.bytes_loaded[3] == s.run_placement.ranks[3].weights_bytes
    eng = s.engine_for(max_batch=2, max_model_len=32)
    assert isinstance(eng.par, ProjectedGroup) and eng.par.rank == 3
    eng.generate([[1, 2, 3, 4], [5, 6, 7]], 2)
    stage = Stage(tier="bench")
    s.synthetic_rows(stage, [{"concurrency": 2, "median_tpot_ms": 10.0, "input_len": 4, "output_len": 2}], "bench")
    rows = {e.name: e for e in stage.evidence}
    assert "RANDOM WEIGHTS" in rows["synthetic.weights"].detail
    coll = rows["c2.synthetic.collectives_ms_per_step"]
    assert coll.level == "projected" and coll.value > 0
    assert rows["c2.synthetic.projected_tpot_ms"].level == "projected"
    assert rows["c2.synthetic.step_with_collectives_ms"].value >= 10.0


def test_non_synthetic_session_adds_nothing():
    s = Session(Options())
    stage = Stage(tier="bench")
    s.synthetic_rows(stage, [{"concurrency": 1, "median_tpot_ms": 1.0}], "bench")
    assert not stage.evidence and s.parallel is None


def test_config_from_a_checkpoint_reads_only_its_config(tiny_ckpt, tiny_cfg, tmp_path):
    s = Session(Options(out=str(tmp_path / "r"), profile="cpu", synthetic=True, checkpoint=str(tiny_ckpt)))
    s.preflight()
    assert s.config.config_hash() == tiny_cfg.config_hash()
    assert "synthetic" in str(s.checkpoint_dir) and not s.is_official


def test_synthetic_load_tier_claims_only_what_it_checked(tiny_ckpt, tmp_path):
    """A --synthetic load reads no file: its load stage has no index, manifest, read-checksum or read-rate row (even
    beside a checkpoint directory with a manifest), says what was made and checked instead, and names the one rank."""
    from k3rocm.checkpoint.verify import make_manifest
    from k3rocm.validation.tiers.load import tier_load

    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    make_manifest(ck)
    s = Session(Options(out=str(tmp_path / "r"), profile="cpu", synthetic=True, checkpoint=str(ck), tp=2, ep=2,
                        rank=1))
    s.preflight()
    stage = Stage(tier="load")
    tier_load(s, stage)
    rows = {e.name: e for e in stage.evidence}
    for name in ("index.open", "index.tensors", "manifest.sha256", "load.raw_read_gbps", "load.load_vs_raw"):
        assert name not in rows, name
    assert rows["weights.source"].value == "synthetic" and "rank 1 of TP2/EP2" in rows["weights.source"].detail
    assert "rank 1 of 2" in rows["load.seconds"].detail
    assert "no checksum" in rows["load.tensors_verified"].detail and rows["load.tensors_verified"].passed
    assert "random source" in rows["kernel_layout.layers_differing"].detail
    assert all(e.passed is not False for e in stage.evidence)


def test_synthetic_without_tp_runs_the_profiles_layout(tmp_path):
    """--synthetic --profile P without --tp on other hardware: the rank run here is one of P's layout (as planned
    for P), not the whole model at TP1 with this machine's layout; --tp without --ep takes plan's EP rule."""
    s = Session(Options(out=str(tmp_path / "r"), profile="mi355x-8", synthetic=True, preset="k3-tiny"))
    s.preflight()
    assert not s.hardware_matches
    tp, ep = s.placement.tp, s.placement.ep
    assert tp > 1  # k3-tiny splits 4 ways on the 8-GPU profile (plan reduces tp to what its heads allow)
    assert (s.run_placement.tp, s.run_placement.ep) == (tp, ep) and s.world == tp
    s2 = Session(Options(out=str(tmp_path / "r2"), profile="cpu", synthetic=True, preset="k3-tiny", tp=2))
    s2.preflight()
    assert (s2.placement.tp, s2.placement.ep) == (2, 1) == (s2.run_placement.tp, s2.run_placement.ep)


def test_synthetic_rows_name_the_target_layout_and_an_unprojected_link(tmp_path):
    """On a profile without link bandwidth the collectives of a multi-rank layout are said to be unprojected (not
    left out silently), and the layout the projected TPOT rows are of is its own row."""
    s = Session(Options(out=str(tmp_path / "r"), profile="cpu", synthetic=True, preset="k3-tiny", tp=2, ep=2))
    s.preflight()
    stage = Stage(tier="bench")
    s.synthetic_rows(stage, [{"concurrency": 2, "median_tpot_ms": 10.0, "input_len": 4, "output_len": 2}], "bench")
    rows = {e.name: e for e in stage.evidence}
    assert rows["synthetic.collectives_ms_per_step"].value == "not projected"
    assert "no link bandwidth" in rows["synthetic.collectives_ms_per_step"].detail
    assert rows["synthetic.target_layout"].value == "TP1/EP1" and "TP2/EP2" in rows["synthetic.target_layout"].detail
    assert "c2.synthetic.collectives_ms_per_step" not in rows
