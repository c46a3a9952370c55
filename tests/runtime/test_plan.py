"""Placement plan (k3rocm.runtime.plan): official K3 numbers, refusals, per-rank slices."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3rocm.checkpoint import layout
from k3rocm.cli.main import cli
from k3rocm.config import preset
from k3rocm.errors import ConfigError, PlanError
from k3rocm.profiles import load_profile
from k3rocm.runtime.plan import PARTS, classify, plan, valid_layouts
from k3rocm.runtime.sizing import StepRoofline

GB = 1e9


@pytest.fixture(scope="module")
def k3():
    return preset("k3")


@pytest.fixture(scope="module")
def mi355(k3):
    return plan(k3, load_profile("mi355x-8"))


def test_official_k3_fits_mi355x_tp8(k3, mi355):
    p = mi355
    assert (p.tp, p.ep, p.world, p.experts_per_rank) == (8, 8, 8, 112)
    assert p.heads_per_rank == {"kda": 12, "mla": 12}
    assert p.fits and p.problem is None
    # K3_FACTS section 7: ~195 GB/GPU of weights (packed MXFP4) = checkpoint / 8. Ours replicates the router
    # and the latent down/up projections on every rank (as the engines do): at least 92 x 2 x 3584 x 7168 x 2 B.
    latent = 92 * 2 * 3584 * 7168 * 2
    router = 92 * (896 * 7168 * 2 + 896 * 4)
    assert p.ranks[0].bytes_by_part["replicated"] >= latent + router
    sharded = (layout.counts(k3)["bytes"] - p.ranks[0].bytes_by_part["replicated"]) / 8
    assert abs(p.weights_bytes - sharded - p.ranks[0].bytes_by_part["replicated"]) < 0.01 * GB
    assert 195 * GB < p.weights_bytes < 206 * GB
    c = layout.counts(k3)
    # experts exactly 1/8 of the routed-expert bytes on every rank
    assert p.bytes_by_part["experts"] * 8 == c["bytes_expert"]
    # split parts sum to the trunk: sum over ranks of split parts + one copy of replicated == trunk bytes
    split = sum(sum(r.bytes_by_part[k] for k in PARTS if k not in ("experts", "replicated")) for r in p.ranks)
    # (A_log is stored [128] but only its first 96 entries — one per head — are placed)
    unused_alog = k3.num_kda_layers * (k3.kda_head_dim - k3.kda_num_heads) * 4
    assert split + p.ranks[0].bytes_by_part["replicated"] + unused_alog == c["bytes_trunk"]
    # cache: 24 MLA layers x 576 values x 2 B = 27,648 B/token; KDA 69 x 12 heads x 128 x 128 x 4 B + conv
    assert p.cache.mla_bytes_per_token == 24 * 576 * 2 == 27648
    assert p.cache.kda_state_bytes_per_seq == 69 * (12 * 128 * 128 * 4 + 3 * 12 * 128 * 3 * 4)
    assert p.cache.budget_bytes == (p.usable_bytes - p.weights_bytes - p.workspace_reserve_bytes
                                    - p.activation_reserve_bytes)
    assert p.cache.budget_bytes > 30 * GB
    assert p.cache.max_tokens == p.cache.budget_bytes // 27648
    per_seq = p.cache.context_len * 27648 + p.cache.kda_state_bytes_per_seq
    assert p.cache.max_sequences == p.cache.budget_bytes // per_seq > 64
    d = p.to_dict()
    assert d["fits"] and d["weights_bytes_per_gpu"] == p.weights_bytes and len(d["ranks"]) == 8
    rows = p.summary()
    assert any(r["item"] == "weights per GPU" and r["bytes"] == p.weights_bytes for r in rows)


def test_official_plan_is_fast(k3):
    t = time.perf_counter()
    p = plan(k3, load_profile("mi355x-8"), max_tokens=4096)
    assert time.perf_counter() - t < 10
    assert p.activation_reserve_bytes > 0


@pytest.mark.parametrize("name", ["h200-8", "mi300x-8", "h100-8"])
def test_official_k3_does_not_fit(k3, name):
    prof = load_profile(name)
    with pytest.raises(PlanError) as ei:
        plan(k3, prof)
    msg = str(ei.value)
    assert "\n" not in msg and "does not fit" in msg and name in msg
    assert f"{prof.usable_bytes / GB:.1f} GB usable" in msg and "try" in msg
    p = plan(k3, prof, strict=False)
    assert not p.fits and p.problem == msg and p.needed_bytes > p.usable_bytes


@pytest.mark.parametrize("gb", [1, 24])
def test_a_profile_that_holds_the_model_in_no_layout_gets_one_line(k3, gb):
    """GPUs too small for any layout (K3 and k3-tiny on 1 GB cards, K3 on 24 GB ones): a one-line PlanError, default
    tp and an explicit one; the hints' trial plans do not plan again (they once recursed without end: the suggestion
    planned a scaled profile whose layout error planned hints of its own)."""
    prof = replace(load_profile("mi355x-8"), memory_bytes=gb * 10**9)
    for cfg in (k3, preset("k3-tiny")) if gb == 1 else (k3,):
        for tp in (None, 3):
            with pytest.raises(PlanError) as ei:
                plan(cfg, prof, tp=tp)
            assert "\n" not in str(ei.value)
            assert ("does not fit" in str(ei.value)) == (tp is None), str(ei.value)


def test_tp4_does_not_fit(k3):
    with pytest.raises(PlanError, match=r"tp=4/ep=4.*does not fit|does not fit.*tp=4/ep=4"):
        plan(k3, load_profile("mi355x-8"), tp=4, ep=4)


def test_no_fp4_hardware_is_noted(k3):
    p = plan(k3, load_profile("mi325x-8"), strict=False)
    assert any("no MXFP4 hardware" in n for n in p.notes)


def test_non_divisible_heads_and_experts():
    cfg = preset("k3-tiny")  # 4 KDA heads, 4 MLA heads, 16 experts
    cpu = load_profile("cpu")
    with pytest.raises(PlanError, match="KDA heads are not divisible by tp=3"):
        plan(cfg, cpu, tp=3, ep=1)
    big = replace(load_profile("mi355x-8"))
    with pytest.raises(PlanError, match="MLA heads"):
        plan(replace(cfg, kda_num_heads=6), big, tp=6, ep=6)
    with pytest.raises(PlanError, match="routed experts are not divisible by ep=8"):
        plan(replace(cfg, num_experts=12, kda_num_heads=8, num_attention_heads=8), big, tp=8, ep=8)
    with pytest.raises(PlanError, match="must divide tp"):
        plan(cfg, cpu, tp=4, ep=3)
    # the suggestion names only layouts that pass every check (tp=3 has none for 4 heads: ep=3 would fail next)
    with pytest.raises(PlanError) as e:
        plan(cfg, cpu, tp=3, ep=2)
    assert "must divide tp" in str(e.value) and "try ep=3" not in str(e.value) and "tp=4/ep=2" in str(e.value)
    with pytest.raises(PlanError, match=r"with tp=4 try ep=2 or ep=4$"):  # ep=1 cuts MXFP4 scale groups
        plan(cfg, cpu, tp=4, ep=3)
    with pytest.raises(PlanError, match="needs 16 GPUs"):
        plan(preset("k3"), big, tp=16, ep=16)


def test_mxfp4_group_split_refused():
    cfg = preset("k3-tiny")  # expert intermediate 64: etp 2 -> 32 ok, etp 4 -> 16 splits a scale group
    cpu = load_profile("cpu")
    p = plan(cfg, cpu, tp=2, ep=1)
    assert p.etp == 2
    with pytest.raises(PlanError, match="MXFP4 scale groups"):
        plan(cfg, cpu, tp=4, ep=1)


def test_tiny_slices_cover_every_tensor_exactly(tiny_cfg):
    """Every checkpoint tensor is covered by the ranks: split ones exactly once, replicated on all."""
    cpu = load_profile("cpu")
    for tp, ep in ((1, 1), (2, 2), (2, 1), (4, 4)):
        p = plan(tiny_cfg, cpu, tp=tp, ep=ep)
        cover: dict[str, list] = {}
        for r in p.ranks:
            total = 0
            for name, sl in r.tensors.items():
                cover.setdefault(name, []).append(sl)
                total += sl.nbytes
            assert total == r.weights_bytes and len(r.tensors) == r.num_tensors
        specs = {s.name: s for s in layout.iter_specs(tiny_cfg)}
        assert set(cover) == set(specs)
        for name, sls in cover.items():
            part, dim, group = classify(name)
            if sls[0].dim is None:
                n_expected = tp if part != "experts" else tp // ep
                assert len(sls) == n_expected, name
                continue
            # the pieces tile the split dimension without gaps or overlaps (within one EP group for experts)
            groups = {}
            for sl in sls:
                groups.setdefault((sl.start, sl.stop), 0)
                groups[(sl.start, sl.stop)] += 1
            ivs = sorted(groups)
            size = sls[0].shape[sls[0].dim] if not name.endswith("A_log") else tiny_cfg.kda_num_heads
            assert ivs[0][0] == 0 and ivs[-1][1] == size, name
            assert all(a[1] == b[0] for a, b in zip(ivs, ivs[1:])), name


def test_slice_byte_ranges(tiny_cfg):
    p = plan(tiny_cfg, load_profile("cpu"), tp=2, ep=2)
    r1 = p.ranks[1]
    o = r1.tensors["language_model.model.layers.0.self_attn.o_proj.weight"]  # [128, 128] bf16, column split
    assert (o.dim, o.start, o.stop, o.local_shape) == (1, 64, 128, (128, 64))
    rng = o.byte_ranges(1000)
    assert len(rng) == 128 and rng[0] == (1000 + 128, 1000 + 256) and rng[1][0] - rng[0][0] == 256
    q = r1.tensors["language_model.model.layers.0.self_attn.q_proj.weight"]  # row split: one run
    assert q.byte_ranges(0) == [(64 * 128 * 2, 128 * 128 * 2)]
    a = r1.tensors["language_model.model.layers.0.self_attn.A_log"]  # [32] stored, 4 heads used
    assert (a.start, a.stop) == (2, 4)
    assert r1.expert_first == 8 and r1.expert_stop == 16
    names = list(r1.tensors.layer(1))
    assert any(".experts.8." in n for n in names) and not any(".experts.7." in n for n in names)
    with pytest.raises(PlanError):
        r1.expert_slices(1, 3)


def test_roofline(k3, mi355):
    rf = mi355.roofline
    s1 = rf.decode(1, 1024)
    s64 = rf.decode(64, 1024)
    assert s1["bound"] == "memory" and s1["floor_s"] == s1["t_memory_s"]
    # batch 1: 16 experts/layer touched node-wide -> 16/8 per rank on average
    assert rf.experts_touched(1) == pytest.approx(16)
    assert rf.experts_touched(10**6) == pytest.approx(896)
    assert s64["bytes"] > s1["bytes"] and s64["flops"] == pytest.approx(64 * s1["flops"])
    one_expert = sum(s.nbytes for s in layout.expert_specs(k3, 1, 0))
    assert one_expert == 17_547_264 and rf.expert_bytes == one_expert
    want = rf.trunk_bytes + rf.embed_row_bytes + 92 * 16 / 8 * one_expert + 1025 * 27_648 + 2 * rf.kda_slot_bytes
    assert s1["bytes"] == int(want)
    act = layout.counts(k3)["params_activated"]
    # node-wide batch-1 weight bytes ~ activated trunk bf16 + 16 packed experts per layer
    node = StepRoofline.from_config(k3, rf.bandwidth, rf.peak_flops)
    assert 0.1 * act < node.trunk_bytes + 92 * node.experts_touched(1) * node.expert_bytes < 2 * act
    assert mi355.to_dict()["roofline"]["step_b1_ctx1k"]["bytes"] == s1["bytes"]


def test_default_tp_falls_back_to_a_divisor(tiny_cfg):
    p = plan(tiny_cfg, load_profile("mi355x-8"))  # 4 heads cannot split 8 ways
    assert (p.tp, p.ep) == (4, 4) and any("tp reduced" in n for n in p.notes)
    with pytest.raises(PlanError, match="not divisible by tp=8"):
        plan(tiny_cfg, load_profile("mi355x-8"), tp=8)


def test_layout_hint_lists_only_layouts_that_work():
    """A refused tp names the (tp, ep) layouts that pass every layout check on that profile and hold the model in
    memory there, and no other."""
    cfg, prof = preset("k3"), load_profile("mi355x-8")
    with pytest.raises(PlanError) as e:
        plan(cfg, prof, tp=7, ep=7)
    named = [(int(t), int(p)) for t, p in re.findall(r"tp=(\d+)/ep=(\d+)", str(e.value))]
    fitting = [(t, p) for t, p in valid_layouts(cfg, prof) if plan(cfg, prof, tp=t, ep=p, strict=False).fits]
    assert named == fitting and (8, 8) in named and all(t == 8 for t, _ in named)


def test_expert_split_refusal_suggests_only_layouts_that_work():
    """tp=3 with the default ep (3): 896 experts do not split 3 ways, and no ep works with tp=3, so the message
    names the working layouts instead of ep values that fail on the next check."""
    cfg, prof = preset("k3"), load_profile("mi355x-8")
    with pytest.raises(PlanError) as e:
        plan(cfg, prof, tp=3)
    msg = str(e.value)
    assert "not divisible by ep=3" in msg and "no ep works with tp=3" in msg and "choose ep from" not in msg
    named = [(int(t), int(p)) for t, p in re.findall(r"tp=(\d+)/ep=(\d+)", msg)]
    assert named == [(t, p) for t, p in valid_layouts(cfg, prof) if plan(cfg, prof, tp=t, ep=p, strict=False).fits]


def test_profile_file_plans_the_multi_node_layout_the_refusal_suggests(tmp_path):
    """A model that does not fit one node is refused with a tp/ep suggestion and how to plan it: a profile
    file (a shipped profile with another device count) given to --profile, which then plans that layout."""
    from k3rocm.runtime.plan import plan

    with pytest.raises(PlanError) as ei:
        plan(preset("k3"), load_profile("mi300x-8"))
    msg = str(ei.value)
    assert "tp=16/ep=16" in msg and "--profile FILE.toml" in msg and "count = 16" in msg
    src = Path(__file__).resolve().parents[2] / "hwprofiles" / "mi300x-8.toml"
    f = tmp_path / "mi300x-16.toml"
    f.write_text(src.read_text().replace("\ncount = 8", "\ncount = 16", 1))
    prof = load_profile(str(f))
    assert prof.device_count == 16 and prof.name == str(f.resolve())  # a file is named by its path
    p = plan(preset("k3"), prof, tp=16, ep=16)
    assert p.fits and p.experts_per_rank == 896 // 16
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(str(tmp_path / "nope.toml"))
    (tmp_path / "bad.toml").write_text("[device\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_profile(str(tmp_path / "bad.toml"))


def test_plan_context_len_beyond_the_model_is_refused():
    """--context-len above max_position_embeddings is one line, exit 2 (it planned a cache the model cannot use)."""
    r = CliRunner().invoke(cli, ["plan", "--preset", "k3-tiny", "--context-len", str(10**8)])
    assert r.exit_code == 2 and "max_position_embeddings" in r.stderr and "Traceback" not in r.output
    ok = CliRunner().invoke(cli, ["plan", "--preset", "k3-tiny", "--context-len", "4096"])
    assert ok.exit_code == 0, ok.output


def test_cpu_ranks_share_the_host_and_a_layout_is_reduced_to_the_largest_that_splits(tmp_path):
    """On a cpu profile the ranks are processes on one host: each plans with its share of the memory. A
    profile layout the config cannot split (k3-tiny's 4 heads at tp 3) falls to the largest that splits, with a
    note (the report's plan.note row), never silently to 1."""
    from k3rocm.config import preset
    from k3rocm.profiles import load_profile
    from k3rocm.runtime.plan import plan

    base = (Path(__file__).resolve().parents[2] / "hwprofiles" / "cpu.toml").read_text()

    def prof(tp):
        p = tmp_path / f"cpu{tp}.toml"
        p.write_text(base.replace("tp = 1", f"tp = {tp}").replace("ep = 1", f"ep = {tp}"))
        return load_profile(str(p))

    cfg = preset("k3-tiny")
    one, four = plan(cfg, prof(1)), plan(cfg, prof(4))
    assert four.world == 4 and four.usable_bytes == one.usable_bytes // 4
    three = plan(cfg, prof(3), ep=None)
    assert three.tp == 2 and any("tp reduced from the profile's 3 to 2" in n for n in three.notes)


def test_the_layouts_suggested_hold_the_model(k3):
    """A layout refused for its split suggests only layouts that also fit in memory: the official K3 splits evenly
    at tp=1 on mi355x-8 but needs 1.58 TB a GPU there (the hint used to offer it, and the next try failed)."""
    prof = load_profile("mi355x-8")
    with pytest.raises(PlanError) as e:
        plan(k3, prof, tp=3)
    msg = str(e.value)
    hint = msg.split(f"layouts that work on {prof.name}: ", 1)[1]
    assert "tp=1/" not in hint and "tp=8/ep=8" in hint, msg
    for part in hint.split(", "):
        t, ep = (int(x.split("=")[1]) for x in part.split("/"))
        assert plan(k3, prof, tp=t, ep=ep).fits


@pytest.mark.parametrize("tp,needle", [(3, "4 KDA heads are not divisible by tp=3"), (0, "tp=0 must be >= 1"),
                                       (-1, "tp=-1 must be >= 1"), (8, "not divisible by tp=8")])
def test_a_tp_no_ep_can_fix_gets_no_note_about_the_default_ep(tiny_cfg, tp, needle):
    """--tp alone, and no ep works with that tp: the error is about tp and names the layouts that work; it does
    not blame the ep that was defaulted."""
    for prof in (load_profile("cpu"), load_profile("mi355x-8")):
        with pytest.raises(PlanError) as e:
            plan(tiny_cfg, prof, tp=tp)
        msg = str(e.value)
        assert needle in msg and f"layouts that work on {prof.name}: tp=1/ep=1" in msg, msg
        assert "ep was not given" not in msg and "ep=1 must" not in msg and "ep=8 must" not in msg, msg
    r = CliRunner().invoke(cli, ["plan", "--tp", str(tp), "--profile", "cpu"])
    assert r.exit_code == 2 and needle in r.stderr and "ep was not given" not in r.stderr, r.stderr


def test_a_tp_the_defaulted_ep_breaks_keeps_the_note(tiny_cfg):
    """tp=4 on the cpu profile works with ep=2 or 4 but not with the defaulted ep=1 (MXFP4 scale groups): the
    message says where ep=1 came from."""
    with pytest.raises(PlanError) as e:
        plan(tiny_cfg, load_profile("cpu"), tp=4)
    msg = str(e.value)
    assert "cuts MXFP4 scale groups" in msg and msg.endswith("(ep was not given and defaults to 1; pass --ep)"), msg
    assert plan(tiny_cfg, load_profile("cpu"), tp=4, ep=2, strict=False).tp == 4


def test_cpu_share_of_the_host_is_per_process_here():
    # on the cpu backend the ranks of a layout are processes sharing the host: each plans with 1/tp of it; a
    # --synthetic run builds one rank alone (host_ranks=1) and plans with the whole host (it was refused a
    # 0.4 GB rank of k3-prefix-1 at tp=16 on a 25 GB host: "1.5 GB usable")
    cfg, cpu = preset("k3-prefix-1"), load_profile("cpu")
    shared = plan(cfg, cpu, tp=16, ep=16, strict=False)
    alone = plan(cfg, cpu, tp=16, ep=16, strict=False, host_ranks=1)
    assert shared.usable_bytes == cpu.usable_bytes // 16 and alone.usable_bytes == cpu.usable_bytes
    assert alone.weights_bytes == shared.weights_bytes
    with pytest.raises(PlanError, match="host_ranks"):
        plan(cfg, cpu, tp=4, ep=4, host_ranks=5)
    gpu = load_profile("mi355x-8")  # GPU profiles: one device per rank, host_ranks has no say
    assert plan(cfg, gpu, tp=8, ep=8, host_ranks=1).usable_bytes == plan(cfg, gpu, tp=8, ep=8).usable_bytes
    # ... and their share of its bandwidth and compute: the step floor of a rank is not that of a rank with the
    # whole host to itself (the plan once gave TP2 on one CPU a lower decode floor than TP1); the table says so
    assert shared.host_shares == 16 and alone.host_shares == 1
    assert shared.roofline.bandwidth == pytest.approx(cpu.hbm_bandwidth / 16)
    assert alone.roofline.bandwidth == pytest.approx(cpu.hbm_bandwidth)
    assert shared.roofline.peak_flops == pytest.approx(cpu.peak("bf16") / 16)
    tp1, tp2 = plan(cfg, cpu, tp=1, ep=1, strict=False), plan(cfg, cpu, tp=2, ep=2, strict=False)
    assert tp2.roofline.decode(1, 1024)["floor_s"] > tp1.roofline.decode(1, 1024)["floor_s"]
    assert "/ 16 processes sharing this host" in json.dumps(shared.summary())
    assert plan(cfg, gpu, tp=8, ep=8).host_shares == 1


@pytest.mark.parametrize("name", ["k3-prefix-1", "k3-prefix-2", "k3-prefix-3"])
def test_a_prefix_without_mla_layers_has_no_token_bound(name):
    """The k3-prefix-N presets have only KDA layers: `plan` once said "MLA cache per token 0 B", "cache capacity
    0 tokens" beside 322,754 sequences and ``"max_tokens": 0``. No MLA layer means no token bound from the MLA
    cache: None in the Placement and null in the JSON, a phrase in the table and the fits line."""
    cfg = preset(name)
    assert cfg.num_mla_layers == 0
    p = plan(cfg, load_profile("mi355x-8"))
    assert p.cache.mla_bytes_per_token == 0 and p.cache.max_tokens is None and p.cache.max_sequences > 0
    assert p.to_dict()["cache"]["max_tokens"] is None
    row = next(r for r in p.summary() if r["item"] == "cache capacity (tokens)")
    phrase = "no MLA layers: not bounded by the MLA cache"
    assert row["count"] is None and row["detail"] == phrase
    r = CliRunner().invoke(cli, ["plan", "--preset", name, "--profile", "mi355x-8", "--json"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert '"max_tokens": null' in r.output
    d = json.loads(r.output)
    assert d["cache"]["max_tokens"] is None and d["cache"]["max_sequences"] == p.cache.max_sequences
    out = " ".join(CliRunner().invoke(cli, ["plan", "--preset", name, "--profile", "mi355x-8"],
                                      env={"COLUMNS": "200"}).output.split())
    assert f"cache capacity (tokens) │ n/a │ {phrase}" in out, out
    assert f"fits: yes; cache capacity ({phrase}) / {p.cache.max_sequences:,} sequences" in out, out
    assert " 0 tokens" not in out and "MLA cache per token │ 0 B │ no MLA layers" in out, out


def test_a_config_with_mla_layers_keeps_its_token_bound(k3, mi355):
    assert isinstance(mi355.cache.max_tokens, int) and mi355.cache.max_tokens == mi355.cache.budget_bytes // 27648
    d = json.loads(CliRunner().invoke(cli, ["plan", "--preset", "k3", "--profile", "mi355x-8", "--json"],
                                      env={"COLUMNS": "200"}).output)
    assert d["cache"]["max_tokens"] == mi355.cache.max_tokens
    out = " ".join(CliRunner().invoke(cli, ["plan", "--preset", "k3", "--profile", "mi355x-8"],
                                      env={"COLUMNS": "200"}).output.split())
    assert f"cache capacity {mi355.cache.max_tokens:,} tokens / {mi355.cache.max_sequences:,} sequences" in out


@pytest.mark.parametrize("name", ["k3-prefix-1", "k3-prefix-2", "k3"])
def test_active_bytes_share_the_active_parameter_count_definition(name):
    """`plan` once printed k3-prefix-1 as "3,519,278,336 parameters (7.039 GB), 2,344,873,216 active per token
    (7.039 GB ...)": the count left out the input embedding, the bytes (all the trunk's) did not. Both leave it
    out now: the inactive parameters and bytes differ by the embedding table plus the unrouted experts."""
    from k3rocm.cli.info import human_bytes, model_size

    cfg = preset(name)
    c, s = layout.counts(cfg), model_size(cfg)
    embed = [sp for sp in layout.model_specs(cfg) if sp.name.endswith("embed_tokens.weight")]
    embed_params, embed_bytes = sum(sp.params for sp in embed), sum(sp.nbytes for sp in embed)
    k, e = cfg.num_experts_per_token, max(cfg.num_experts, 1)
    assert s["params_activated"] < s["params"] and s["bytes_activated"] < s["bytes"]
    # the same tensors counted: the trunk less the input embedding, plus the top-k share of the experts
    assert s["params_activated"] == c["params"] - c["params_expert"] - embed_params + c["params_expert"] * k // e
    assert s["bytes_activated"] == c["bytes_trunk"] - embed_bytes + c["bytes_expert"] * k // e
    if not cfg.num_moe_layers:  # no experts: what is not active is the bf16 embedding table alone
        assert s["params"] - s["params_activated"] == embed_params
        assert s["bytes"] - s["bytes_activated"] == embed_bytes == 2 * embed_params
    if name == "k3":
        # ~104 B active parameters: ~55.6 B bf16 trunk (~111 GB) + ~48.6 B MXFP4 expert parameters (~26 GB)
        assert s["params_activated"] == 104_189_614_848
        assert 135e9 < s["bytes_activated"] < 139e9 and s["bytes_activated"] < 2 * s["params_activated"]
    out = CliRunner().invoke(cli, ["plan", "--preset", name, "--profile", "mi355x-8"], env={"COLUMNS": "200"}).output
    assert (f"{s['params_activated']:,} active per token ({human_bytes(s['bytes_activated'])}: the trunk without "
            "the input embedding table") in " ".join(out.split()), out
