"""Validation tiers on k3-tiny: every tier passes on the real path, and the tiers fail when the path is wrong.

The checkpoint is the external golden k3-tiny (written by Moonshot's layout) and its golden outputs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from k3rocm.runtime import registry
from k3rocm.validation import tiers
from k3rocm.validation.tiers import adapters, correctness, known_answers
from k3rocm.validation.tiers.env import tier_env
from k3rocm.validation.tiers.thresholds import THRESHOLDS
from k3rocm.validation.evidence import TIERS, Stage
from k3rocm.validation.session import Options, Session

torch.set_num_threads(1)  # tiny tensors: threads only oversubscribe the CI cores


def _session(ckpt, **kw) -> Session:
    return Session(Options(checkpoint=str(ckpt), **kw))


def _rows(stages, tier):
    st = next(s for s in stages if s.tier == tier)
    return {e.name: e for e in st.evidence}


@pytest.fixture(scope="module")
def good_run(golden_dir):
    """Every tier up to performance on the golden checkpoint with the golden outputs."""
    s = _session(golden_dir / "checkpoint", golden=str(golden_dir / "golden.safetensors"))
    return s, tiers.run_tiers(s, "performance")


def test_every_tier_passes_on_k3_tiny(good_run):
    s, stages = good_run
    assert [st.tier for st in stages] == list(TIERS)
    for st in stages:
        assert st.status == "passed", (st.tier, st.error, [(e.name, e.value, e.threshold) for e in st.failures])
        assert st.seconds > 0 and st.evidence


def test_evidence_content_and_levels(good_run):
    s, stages = good_run
    env = next(st for st in stages if st.tier == "env")
    # the profile is a setting of the run (what it checks against), not a projected claim
    assert "profile" not in _rows(stages, "env") and [x.name for x in env.settings] == ["profile"]
    assert env.settings[0].value == "cpu"
    load = _rows(stages, "load")
    assert load["index.tensors"].value == 1492 and load["index.tensors"].passed
    assert load["load.tensors_verified"].passed and load["plan.fits"].level == "projected"
    # every MoE layer's experts repacked into the GEMM's kernel layout read back to the checkpoint's bytes
    assert load["kernel_layout.layers_differing"].value == 0 and load["kernel_layout.layers_differing"].passed
    assert load["kernel_layout.bytes"].value > 0
    # the index's own open time (it read ~0 ms: the tier timed a cache lookup of what the pre-flight built)
    assert s.index_open_seconds > 0 and load["index.open"].value == round(s.index_open_seconds * 1e3, 2)
    fwd = _rows(stages, "forward")
    assert fwd["prefill.shape"].value == [2, 16, 512]
    cor = _rows(stages, "correctness")
    # the golden comparison is external evidence and matches the README's tolerance
    g = cor["golden.logits_max_abs"]
    assert g.level == "external" and g.passed and 0 < g.value < 5e-3
    gt = cor["golden.free_running.greedy_tokens"]
    assert gt.value is True and gt.passed is None and gt.level == "external"  # free-running: information
    assert cor["golden.layers.rel_rms.max"].value < 1e-3
    # the serving path (decode kernels + caches) is compared with one forward, and agrees
    assert cor["decode_vs_prefill.max_abs"].value < THRESHOLDS["decode_vs_prefill.max_abs"]
    assert cor["decode_vs_prefill.tokens"].value == 1.0
    # on this CPU with the cpu profile measurements are "measured"
    assert s.measured_level == "measured"
    perf = _rows(stages, "performance")
    assert perf["c2.completed"].value == 4 and perf["c2.failed"].value == 0
    # the load of the point is its settings, not measured rows
    pst = {x.name: x for x in next(st for st in stages if st.tier == "performance").settings}
    assert {f"c2.{k}" for k in ("input_len", "output_len", "range_ratio", "num_prompts", "num_warmups",
                                "max_num_batched_tokens")} == set(pst) and not set(pst) & set(perf)
    assert perf["c2.roofline.floor_s"].level == "projected" and perf["c2.no_hang"].passed and "c2.p99_itl_ms" in perf
    assert 0 < perf["c2.roofline.fraction"].value < 1
    # the layout that ran (one process here) is what the run measured on: its level, never "projected"
    assert perf["dist.layout"].value == "TP1/EP1" and perf["dist.layout"].level == perf["dist.world"].level == "measured"
    assert "alone" not in perf["dist.layout"].detail and _rows(stages, "forward")["dist.world"].level == "measured"
    # plots: per-layer error, activation max |h|, latency
    series = {k for st in stages for k in st.series}
    assert {"layer_error", "absmax", "latency", "throughput"} <= series
    # every plot records the level of each of its series, as the rows it draws carry them
    from k3rocm.validation.evidence import LEVELS
    for st in stages:
        for k, spec in st.series.items():
            assert set(spec["levels"]) == set(spec["y"]) and set(spec["levels"].values()) <= set(LEVELS), (k, spec)
    by = {k: spec["levels"] for st in stages for k, spec in st.series.items()}
    assert by["bytes_per_device"] == {"planned": "projected", "loaded": "measured"}
    assert set(by["roofline"].values()) == {"projected"} and set(by["latency"].values()) == {"measured"}
    golden = {k: v for k, v in by["layer_error"].items() if "golden" in k}
    assert golden and set(golden.values()) == {"external"}
    assert {v for k, v in by["layer_error"].items() if "golden" not in k} == {"measured"}
    absmax = next(st for st in stages if st.tier == "forward").series["absmax"]["y"]["max |h|"]
    assert len(absmax) == 13 and all(0 < a < 1e3 for a in absmax)


@pytest.fixture
def perturbed(request):
    """Register a deliberately wrong ``torch`` implementation of an op for the duration of a test."""
    saved = {}

    def apply(op: str, wrap):
        impls = registry.implementations(op)
        saved[op] = registry._REGISTRY.get(op, {}).get("torch")
        good = impls["torch"].fn
        registry.register(op, "torch", wrap(good), note="deliberately wrong (test)")

    yield apply
    for op, impl in saved.items():
        if impl is None:
            registry._REGISTRY[op].pop("torch", None)
        else:
            registry._REGISTRY[op]["torch"] = impl


def test_correctness_fails_on_a_wrong_expert_kernel(golden_ckpt, perturbed):
    # a kernel that stores its output one latent column off (a misaligned store). (A pure scale error
    # would be invisible here: the routed sum goes through routed_expert_norm, K3_FACTS §5.)
    perturbed("moe_experts", lambda f: (lambda *a, **k: torch.roll(f(*a, **k), 1, dims=-1)))
    s = _session(golden_ckpt)
    stages = tiers.run_tiers(s, "correctness")
    assert [st.tier for st in stages] == ["env", "load", "forward", "correctness"]
    cor = stages[-1]
    assert cor.status == "failed"
    bad = {e.name for e in cor.failures}
    assert "layers.rel_rms.max" in bad
    worst = _rows(stages, "correctness")["layers.rel_rms.max"].value
    assert worst > THRESHOLDS["engine.layer_rel_rms"]


def test_decode_vs_prefill_fails_on_a_wrong_decode_kernel(golden_ckpt, perturbed):
    # the decode kernel forgets part of its output: only the serving path differs, prefill stays right
    perturbed("kda_decode", lambda f: (lambda *a, **k: f(*a, **k) * 0.9))
    s = _session(golden_ckpt)
    st = Stage("correctness")
    correctness.tier_correctness(s, st)
    rows = {e.name: e for e in st.evidence}
    assert rows["layers.rel_rms.max"].passed  # the forward path does not use kda_decode
    assert rows["decode_vs_prefill.max_abs"].passed is False
    assert st.status == "failed"


def test_golden_mismatch_is_external_failure(golden_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    g = load_file(str(golden_dir / "golden.safetensors"))
    g["logits"] = g["logits"] + 0.05 * torch.randn(g["logits"].shape, generator=torch.Generator().manual_seed(1))
    bad = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in g.items()}, str(bad))
    s = _session(golden_dir / "checkpoint", golden=str(bad))
    st = Stage("correctness")
    correctness.golden_checks(s, st)
    rows = {e.name: e for e in st.evidence}
    assert rows["golden.logits_max_abs"].passed is False and rows["golden.logits_max_abs"].level == "external"
    assert rows["golden.free_running.greedy_tokens"].value is True  # greedy still from the real weights


def test_golden_rows_say_what_was_teacher_forced(golden_dir, tmp_path):
    # a golden file with no (or some) sublayer outputs: the logits rows say free-running (or how many were forced)
    # instead of claiming a teacher-forced comparison the file cannot give
    from safetensors.torch import load_file, save_file
    g = load_file(str(golden_dir / "golden.safetensors"))
    subs = sorted(k for k in g if k.startswith("layer"))
    assert subs
    for keep, want in ((0, "free-running: the file holds no sublayer outputs"),
                       (1, f"teacher-forced on the 1 of {len(subs)} sublayer outputs"),
                       (len(subs), "teacher-forced: from the golden's own sublayer outputs")):
        f = tmp_path / f"g{keep}.safetensors"
        save_file({k: v.contiguous() for k, v in g.items() if not k.startswith("layer") or k in subs[:keep]}, str(f))
        st = Stage("correctness")
        correctness.golden_checks(_session(golden_dir / "checkpoint", golden=str(f)), st)
        rows = {e.name: e for e in st.evidence}
        assert want in rows["golden.logits_max_abs"].detail and want in rows["golden.top1_agreement"].detail


def test_stops_at_first_failing_tier(golden_ckpt, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(golden_ckpt, d)
    shard = sorted(d.glob("*.safetensors"))[-1]
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated shard
    s = _session(d)
    stages = tiers.run_tiers(s, "performance")
    assert [st.tier for st in stages] == ["env", "load"]
    assert stages[-1].status == "error" and stages[-1].exit_code == 2
    assert "\n" not in stages[-1].error and shard.name in stages[-1].error


def test_fallback_hardware_is_labelled(golden_ckpt, monkeypatch):
    """A profile naming other hardware than this machine turns measurements into measured-fallback."""
    s = _session(golden_ckpt, profile="h200-1")
    if s.detected.backend != "cpu":
        pytest.skip("needs a machine without a GPU")
    assert s.measured_level == "measured-fallback"
    st = Stage("env")
    tier_env(s, st)
    rows = {e.name: e for e in st.evidence}
    assert rows["hardware.fallback"].level == "measured-fallback" and st.status == "passed"


def test_official_known_answers_are_checked(monkeypatch, golden_ckpt):
    """With the official checkpoint the K3_FACTS §6 answers become external evidence (model stubbed here:
    the real one needs 1.5 TB)."""
    s = _session(golden_ckpt)
    V = 163840
    top, mean = known_answers.OFFICIAL_TOP_LOGIT, known_answers.OFFICIAL_MEAN_LOGIT
    rest = (mean * V - top) / (V - 1)  # so that the row's mean is the published mean
    logits = torch.full((1, 5, V), rest, dtype=torch.float64)
    logits[0, -1, known_answers.OFFICIAL_ARGMAX] = top
    layers = [{"absmax": a} for a in known_answers.OFFICIAL_FIRST_ABSMAX] + \
        [{"absmax": known_answers.OFFICIAL_LAST_ABSMAX}]
    monkeypatch.setattr(correctness, "oracle_forward", lambda m, ids: (logits, layers))
    monkeypatch.setattr(correctness, "greedy_continuation", lambda m, p, n: list(known_answers.OFFICIAL_GREEDY))
    monkeypatch.setitem(s._cache, "oracle", object())
    st = Stage("correctness")
    correctness.official_checks(s, st)
    rows = {e.name: e for e in st.evidence}
    assert all(e.level == "external" for e in st.evidence)
    assert rows["official.argmax"].passed and rows["official.greedy_capital_of_france"].passed
    assert rows["official.top_logit_err"].value < 1e-4 and rows["official.mean_logit_err"].value < 1e-4
    # a wrong answer fails
    monkeypatch.setattr(correctness, "greedy_continuation", lambda m, p, n: [1] * n)
    st2 = Stage("correctness")
    correctness.official_checks(s, st2)
    assert st2.status == "failed"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_every_tier_passes_on_the_gpu(golden_dir):
    """On a GPU the engine runs its GPU kernels (registry: triton / aiter) on bf16 weights; every tier
    must still pass against the fp32 oracle and the golden outputs."""
    s = _session(golden_dir / "checkpoint", golden=str(golden_dir / "golden.safetensors"))
    assert s.device == "cuda"
    stages = tiers.run_tiers(s, "performance")
    for st in stages:
        assert st.status == "passed", (st.tier, st.error, [(e.name, e.value, e.threshold) for e in st.failures])
    cor = _rows(stages, "correctness")
    assert cor["golden.free_running.greedy_tokens"].value is True
    sel = s.kernel_selection()
    assert sel and all(v in ("triton", "aiter", "torch") for v in sel.values())
    # every op that has a GPU kernel must run it: a silent fallback to the oracle would make the
    # correctness tier compare the oracle with itself
    from k3rocm.runtime import registry
    with_kernel = {op for op in registry.ORACLE_OPS if {"triton", "aiter"} & set(registry.implementations(op))}
    assert with_kernel and {op for op in with_kernel if sel.get(op) == "torch"} == set(), sel
    assert not s.engine.describe().get("fallbacks"), s.engine.describe().get("fallbacks")


def test_serving_logits_are_the_engines_recorded_logits(tiny_ckpt):
    """serve_with_logits returns, per sampled token, the whole-vocabulary logits the engine sampled it from
    (Engine.recording), and leaves recording off again."""
    from k3rocm.model.weights import load_weights
    from k3rocm.runtime.engine import Engine

    w = load_weights(tiny_ckpt)
    eng = Engine(w.config, w, device="cpu", max_batch=2, max_num_batched_tokens=3, max_model_len=64)
    toks, logits = adapters.serve_with_logits(eng, [5, 6, 7, 8, 9], 4)  # prefill in two chunks, then decode
    assert len(toks) == 4 and logits.shape == (4, w.config.vocab_size)
    assert logits.argmax(-1).tolist() == toks
    assert eng.record_logits is False


def test_bench_rows_plot_throughput_per_gpu_against_speed_per_user():
    """A sweep gives one trade-off point per concurrency at (1000 / median TPOT, output tok/s/GPU)."""
    from k3rocm.validation.evidence import Stage
    from k3rocm.validation.tiers.performance import bench_rows

    from types import SimpleNamespace as NS

    class S:  # the attributes bench_rows reads from a session
        measured_level = "measured-fallback"
        profile = type("P", (), {"targets": ()})()
        run_placement = NS(world=1, tp=1, ep=1, ranks=[NS(weights_bytes=10)])
        world, device = 1, "cpu"

    res = [{"concurrency": c, "completed": 3, "failed": 0, "hang": None, "median_tpot_ms": tpot,
            "output_throughput_per_gpu": thr} for c, tpot, thr in ((1, 10.0, 100.0), (8, 20.0, 400.0), (64, 50.0, 900.0))]
    st = Stage("bench")
    bench_rows(S(), st, res, tier="bench")
    t = st.series["tradeoff"]
    assert t["x"] == [20.0, 50.0, 100.0] and t["y"]["output tok/s/GPU"] == [900.0, 400.0, 100.0]
    assert t["labels"] == ["c=64", "c=8", "c=1"]
    rows = {e.name: e for e in st.evidence}
    assert rows["c8.tok_s_per_user"].value == 50.0 and rows["c8.tok_s_per_user"].level == "measured-fallback"


@pytest.mark.parametrize("synthetic, world, level", [(False, 1, "measured"), (False, 2, "measured-fallback"),
                                                     (True, 1, "measured-fallback"), (True, 4, "projected")])
def test_layout_rows_are_projected_only_when_one_rank_of_a_larger_layout_ran_alone(synthetic, world, level):
    """dist.world / dist.layout carry the run's level for the layout that ran (one process or all ranks of a
    multi-rank run); only a --synthetic rank of a layout of several ranks, run alone, is projected and says so."""
    from types import SimpleNamespace as NS

    from k3rocm.validation.tiers.performance import bench_rows

    lv = "measured" if world == 1 and not synthetic else "measured-fallback"
    s = NS(measured_level=lv, profile=NS(targets=()), device="cpu", synthetic=synthetic, rank=3 if synthetic else 0,
           world=world, run_placement=NS(world=world, tp=world, ep=world, ranks=[NS(weights_bytes=10)] * world))
    st = Stage("bench")
    bench_rows(s, st, [], tier="bench")
    rows = {e.name: e for e in st.evidence}
    assert rows["dist.world"].value == world and rows["dist.layout"].value == f"TP{world}/EP{world}"
    assert rows["dist.world"].level == rows["dist.layout"].level == level
    alone = "rank 3 alone ran, the others are projected" in rows["dist.layout"].detail
    assert alone == (level == "projected"), rows["dist.layout"].detail


def test_a_kernel_family_that_fails_to_import_is_reported(monkeypatch):
    from k3rocm.runtime import registry

    from types import SimpleNamespace as NS

    from k3rocm.validation.evidence import Stage

    monkeypatch.setattr(registry, "_IMPORT_ERRORS", {"kda": "ImportError: broken"})
    assert registry.import_errors() == {"kda": "ImportError: broken"}
    gpu = NS(name="NVIDIA H200", arch="sm_90")
    det = NS(backend="cuda", torch_version="x", torch_build="cuda", triton_version="3.6", triton_target="cuda:90",
             aiter_version=None, count=1, devices=[gpu], memory_bytes=150e9, env={}, notes=[], arch="sm_90")
    prof = NS(name="h200-1", device_count=1, device_name="H200", arch="sm_90", memory_bytes=150e9, backend="cuda")
    sess = NS(detected=det, profile=prof, measured_level="measured", hardware_matches=True)
    st = Stage("env")
    tier_env(sess, st)
    row = {e.name: e for e in st.evidence}["kernels.import"]
    assert row.passed is False and "kda: ImportError: broken" in row.detail


def test_teacher_forced_layers_localise_a_wrong_layer(golden_ckpt):
    """Each engine layer runs on the oracle's input: a fault in one MoE layer shows in that layer alone (a
    free-running stack would smear it over every later layer); identical ops give exactly zero."""
    from k3rocm.model.layer import resolve_ops
    from k3rocm.model.model import K3Model
    from k3rocm.model.weights import load_weights

    s = _session(golden_ckpt)
    cfg = s.config
    w = load_weights(golden_ckpt)
    orc = K3Model(cfg, w)
    ids = torch.randint(3, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(11))
    same = adapters.teacher_forced_layers(K3Model(cfg, w), orc, ids)
    assert len(same) == cfg.num_hidden_layers and all(v == 0.0 for d in same for v in d.values())

    good = resolve_ops(None)["moe_experts"]
    calls = {"n": 0}

    def third_call_wrong(*a, **k):
        calls["n"] += 1
        y = good(*a, **k)
        return torch.roll(y, 1, dims=-1) if calls["n"] == 3 else y

    bad = adapters.teacher_forced_layers(K3Model(cfg, w, ops={"moe_experts": third_call_wrong}), orc, ids)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    hit = moe_layers[2]
    assert bad[hit]["mlp_out"] > THRESHOLDS["engine.layer_rel_rms"]
    assert all(v == 0.0 for i, d in enumerate(bad) for n, v in d.items() if (i, n) != (hit, "mlp_out"))
    sens = adapters.oracle_sensitivity(orc, ids, adapters.oracle_forward(orc, ids)[0])
    assert sens["finite"] and 0.0 < sens["max_abs"] < float("inf")


def test_teacher_forcing_is_per_sublayer(golden_ckpt):
    """A wrong token mixer shows in that layer's attn_out alone: the same layer's channel mixer runs on the
    oracle's input to it, so its mlp_out (and every other sublayer) stays exactly equal."""
    from k3rocm.model.layer import resolve_ops
    from k3rocm.model.model import K3Model
    from k3rocm.model.weights import load_weights

    cfg = _session(golden_ckpt).config
    w = load_weights(golden_ckpt)
    orc = K3Model(cfg, w)
    ids = torch.randint(3, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, ()))))
    good = resolve_ops(None)["kda_prefill"]
    calls = {"n": 0}

    def second_call_wrong(*a, **k):
        calls["n"] += 1
        o, s = good(*a, **k)
        return (o * 1.5, s) if calls["n"] == 2 else (o, s)

    bad = adapters.teacher_forced_layers(K3Model(cfg, w, ops={"kda_prefill": second_call_wrong}), orc, ids)
    hit = [i for i in range(cfg.num_hidden_layers) if cfg.layer_type(i) == "kda"][1]
    assert bad[hit]["attn_out"] > THRESHOLDS["engine.layer_rel_rms"]
    assert all(v == 0.0 for i, d in enumerate(bad) for n, v in d.items() if (i, n) != (hit, "attn_out"))


def test_sublayer_halves_run_in_order_and_perturb_hook(golden_ckpt):
    """run_attn / run_mlp refuse to run out of order (one-line ConfigError); a state's ``perturb`` hook sees
    every sublayer output (2 per layer), and the identity hook changes nothing."""
    from k3rocm.errors import ConfigError
    from k3rocm.model.model import K3Model
    from k3rocm.model.weights import load_weights

    cfg = _session(golden_ckpt).config
    m = K3Model(cfg, load_weights(golden_ckpt))
    ids = torch.randint(3, cfg.vocab_size, (5,))
    st = m.embed(ids)
    with pytest.raises(ConfigError, match="token mixer is next"):
        m.run_mlp(0, st)
    m.run_attn(0, st)
    with pytest.raises(ConfigError, match="channel mixer is next"):
        m.run_attn(0, st)
    seen = []
    st2 = m.embed(ids)
    st2.perturb = lambda x: (seen.append(x.shape), x)[1]
    ref = m.embed(ids)
    for i in range(cfg.num_hidden_layers):
        m.run_layer(i, st2)
        m.run_layer(i, ref)
    assert len(seen) == 2 * cfg.num_hidden_layers
    assert torch.equal(m.final(st2), m.final(ref))


def test_golden_from_another_checkpoint_says_so(golden_dir):
    """Golden data compared with the wrong weights (the embedded k3-tiny instead of the golden checkpoint) fails
    with a line that names the likely cause and what to pass."""
    sess = Session(Options(golden=str(golden_dir / "golden.safetensors")))
    st = Stage("correctness")
    correctness.golden_checks(sess, st)
    row = {e.name: e for e in st.evidence}["golden.logits_max_abs"]
    assert row.passed is False and "another checkpoint" in row.detail and "--checkpoint" in row.detail
    assert row.detail.index("--checkpoint") < 200  # the advice survives the error line's cut
    ok = Stage("correctness")
    correctness.golden_checks(_session(golden_dir / "checkpoint", golden=str(golden_dir / "golden.safetensors")), ok)
    assert "another checkpoint" not in {e.name: e for e in ok.evidence}["golden.logits_max_abs"].detail


def test_malformed_golden_files_are_one_line_errors(golden_dir, tmp_path):
    """Every malformed golden file is refused before any tier runs: one CheckpointError naming the tensor."""
    from safetensors.torch import load_file, save_file

    from k3rocm.errors import CheckpointError
    from k3rocm.validation.session import check_golden_file

    cfg = _session(golden_dir / "checkpoint").config
    good = load_file(str(golden_dir / "golden.safetensors"))
    check_golden_file(golden_dir / "golden.safetensors", cfg)  # the real one passes
    B, T = good["input_ids"].shape

    def variant(name, **change):
        d = {k: v.clone() for k, v in good.items()}
        for k, v in change.items():
            if v is None:
                d.pop(k)
            else:
                d[k] = v
        f = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in d.items()}, str(f))
        return f

    cases = {
        "flat_ids": (dict(input_ids=good["input_ids"].reshape(-1), logits=good["logits"].reshape(B * T, -1)),
                     "input_ids"),
        "layer_shape": (dict(layer00_attn=None, **{"layer00.attn_out": torch.randn(B, T, 3)}), "layer00.attn_out"),
        "short_logits": (dict(logits=good["logits"][:, : T // 2].clone()), "logits"),
        "empty_ids": (dict(input_ids=torch.zeros(0, 0, dtype=torch.int64),
                           logits=torch.zeros(0, 0, cfg.vocab_size)), "input_ids"),
        "float_ids": (dict(input_ids=good["input_ids"].float()), "input_ids"),
        "ids_out_of_vocab": (dict(input_ids=torch.full((B, T), cfg.vocab_size + int(torch.randint(1, 99, ())),
                                                       dtype=torch.int64)), "outside"),
        "empty_greedy": (dict(greedy_tokens=torch.zeros(0, dtype=torch.int64), greedy_margins=None), "greedy_tokens"),
        "greedy_half": (dict(greedy_tokens=None, greedy_margins=None), "greedy_prompt"),
        "layer_past_end": ({f"layer{cfg.num_hidden_layers + 5:02d}.mlp_out": torch.randn(B, T, cfg.hidden_size)},
                           "past"),
        "unpadded_layer": ({"layer3.attn_out": good["layer03.attn_out"]}, "zero-padded"),
        "unknown_tensor": ({"logits_extra": torch.randn(3)}, "unknown tensor"),
        "nan_logits": (dict(logits=good["logits"].index_put((torch.tensor([0]), torch.tensor([int(torch.randint(T, ()))]),
                                                             torch.tensor([0])), torch.tensor(float("nan")))),
                       "NaN"),
    }
    cases["layer_shape"][0].pop("layer00_attn")
    for name, (change, needle) in cases.items():
        f = variant(name, **change)
        with pytest.raises(CheckpointError) as ei:
            check_golden_file(f, cfg)
        msg = str(ei.value)
        assert needle in msg and "\n" not in msg and str(f) in msg, (name, msg)
    with pytest.raises(CheckpointError, match="is a directory"):
        check_golden_file(tmp_path, cfg)
    with pytest.raises(CheckpointError, match="empty"):
        check_golden_file("", cfg)


def test_the_golden_comparison_is_teacher_forced_so_depth_does_not_amplify_it(golden_dir, tmp_path):
    """Golden outputs of an implementation that differs from the oracle by 3e-5 relative at every sublayer (as
    an independent fp32 one does, in kind): free-running, random weights amplify that to O(1) logit differences
    (near-tied routers flip experts); each sublayer on the golden's own inputs stays at 3e-5, and gates."""
    from safetensors.torch import load_file, save_file

    from k3rocm.validation.tiers.adapters import flat_batch

    g = load_file(str(golden_dir / "golden.safetensors"))
    s = _session(golden_dir / "checkpoint")
    ids = g["input_ids"].long()
    B, T = ids.shape
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        st = s.oracle.embed(ids.reshape(-1), flat_batch(B, T), record=True)
        st.perturb = lambda o: o * (1 + 3e-5 * torch.randn(o.shape, generator=gen))
        for i in range(s.config.num_hidden_layers):
            s.oracle.run_layer(i, st)
        logits = s.oracle.final(st).view(B, T, -1)
    other = {"input_ids": ids, "logits": logits.contiguous(),
             **{k: v.view(B, T, -1).contiguous() for k, v in st.outputs.items()}}
    path = tmp_path / "independent.safetensors"
    save_file(other, str(path))
    stage = Stage("correctness")
    correctness.golden_checks(_session(golden_dir / "checkpoint", golden=str(path)), stage)
    rows = {e.name: e for e in stage.evidence}
    assert stage.status == "passed", [(e.name, e.value) for e in stage.failures]
    assert rows["golden.layers.rel_rms.max"].value < 1e-4 and rows["golden.logits_max_abs"].value < 1e-4
    free = rows["golden.free_running.logits_max_abs"]
    assert free.passed is None and free.value > THRESHOLDS["golden.logits_max_abs"]  # what used to gate
    # where a flip is possible, the router's top-k margin says so
    ref = Stage("correctness")
    correctness.golden_checks(_session(golden_dir / "checkpoint", golden=str(golden_dir / "golden.safetensors")), ref)
    rr = {e.name: e for e in ref.evidence}
    assert 0 < rr["golden.router.topk_margin.min"].value < THRESHOLDS["golden.router_margin"]
    assert rr["golden.router.near_ties"].value >= 1 and "layer" in rr["golden.router.topk_margin.min"].detail
    assert ref.series["router_margin"]["x"] == [i for i in range(s.config.num_hidden_layers) if s.config.is_moe_layer(i)]


def test_a_group_that_did_not_form_is_not_started_again(golden_ckpt, tmp_path, monkeypatch):
    """Every later use of the session's cluster re-raises the first failure instead of starting the group again
    (the report's load table asked a second time: a second wait of K3ROCM_DIST_TIMEOUT)."""
    from k3rocm.runtime import serve
    from k3rocm.runtime.dist import WorkerFailed

    cpu = Path(__file__).resolve().parents[2] / "hwprofiles" / "cpu.toml"
    prof = tmp_path / "cpu-tp2.toml"
    prof.write_text(cpu.read_text().replace("tp = 1", "tp = 2").replace("ep = 1", "ep = 2"))
    calls = []

    def start(spec, world):
        calls.append(world)
        raise WorkerFailed("distributed run on 2 ranks stopped: the 2-rank group did not form: timed out")
    monkeypatch.setattr(serve.Cluster, "start", staticmethod(start))
    s = _session(golden_ckpt, profile=str(prof))
    for _ in range(3):
        with pytest.raises(WorkerFailed, match="did not form"):
            s.cluster
    assert calls == [2]
