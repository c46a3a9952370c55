"""Checkpoint writer / reader / manifests / Weights / embedded default, against the golden k3-tiny layout."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3rocm import mx
from k3rocm.checkpoint import embedded, layout, writer
from k3rocm.checkpoint.reader import INDEX_NAME, open_checkpoint, read_shard_header
from k3rocm.checkpoint.verify import MANIFEST_NAME, make_manifest, manifest_extras, shard_fingerprints, verify_manifest
from k3rocm.config import preset
from k3rocm.errors import CheckpointError, ConfigError, HardwareError
from k3rocm.model.weights import ExpertWeights, Weights, load_weights


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _header(p: Path) -> bytes:
    b = p.read_bytes()
    return b[: 8 + int.from_bytes(b[:8], "little")]


# ----------------------------------------------------------------------------------- writer layout
def test_writer_matches_released_layout_of_golden(tiny_ckpt, golden_ckpt):
    ours, gold = sorted(p.name for p in tiny_ckpt.iterdir()), sorted(p.name for p in golden_ckpt.iterdir())
    assert ours == gold == ["config.json", "model-00001-of-000002.safetensors",
                            "model-00002-of-000002.safetensors", INDEX_NAME]
    assert (tiny_ckpt / "config.json").read_bytes() == (golden_ckpt / "config.json").read_bytes()
    assert (tiny_ckpt / INDEX_NAME).read_bytes() == (golden_ckpt / INDEX_NAME).read_bytes()
    for s in ours[1:3]:
        assert _header(tiny_ckpt / s) == _header(golden_ckpt / s), s
        assert (tiny_ckpt / s).stat().st_size == (golden_ckpt / s).stat().st_size
        assert (tiny_ckpt / s).read_bytes() != (golden_ckpt / s).read_bytes()  # different random weights
    assert shard_fingerprints(tiny_ckpt) == shard_fingerprints(golden_ckpt)


def test_writer_stream_equals_safetensors_serialisation(tiny_ckpt, tmp_path):
    for shard in sorted(tiny_ckpt.glob("*.safetensors")):
        tensors = load_file(str(shard))
        save_file(tensors, str(tmp_path / shard.name), metadata={"format": "pt"})
        assert (tmp_path / shard.name).read_bytes() == shard.read_bytes(), shard.name


def test_writer_deterministic_and_seeded(tiny_ckpt, tiny_cfg, tmp_path):
    seen = []
    again = writer.write_checkpoint(tiny_cfg, tmp_path / "a", seed=0, progress=lambda d, t, n: seen.append((d, t, n)))
    assert len(seen) == 1492 and seen[-1][0] == seen[-1][1] == layout.counts(tiny_cfg)["bytes"]
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert _files(again) == _files(tiny_ckpt)
    other = writer.write_checkpoint(tiny_cfg, tmp_path / "b", seed=1)
    for s in ("model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors"):
        assert _header(other / s) == _header(tiny_ckpt / s)
        assert (other / s).read_bytes() != (tiny_ckpt / s).read_bytes()


def test_writer_realistic_scales(tiny_ckpt, tiny_cfg):
    ix = open_checkpoint(tiny_ckpt)
    H, Lt = tiny_cfg.hidden_size, tiny_cfg.expert_in_size
    a_log = ix.read("language_model.model.layers.0.self_attn.A_log")
    e = torch.exp(a_log[: tiny_cfg.kda_num_heads])
    assert ((e >= 1) & (e <= 16)).all() and (a_log[tiny_cfg.kda_num_heads:] == 0).all()
    nw = ix.read("language_model.model.layers.2.input_layernorm.weight").float()
    assert abs(nw.mean().item() - 1) < 0.05
    q = ix.read("language_model.model.layers.0.self_attn.q_proj.weight").float()
    assert abs(q.std().item() * H ** 0.5 - 1) < 0.1
    base = "language_model.model.layers.5.block_sparse_moe.experts.7.w1."
    w = mx.dequantize_mxfp4(ix.read(base + "weight_packed"), ix.read(base + "weight_scale"))
    assert w.shape == (tiny_cfg.moe_intermediate_size, Lt)
    assert abs(w.std().item() * Lt ** 0.5 - 1) < 0.15
    conv = ix.read("language_model.model.layers.1.self_attn.k_conv1d.weight")
    assert conv.dtype == torch.float32 and abs(conv.std().item() * 2 - 1) < 0.15


def test_writer_refuses_nonempty_target_and_leaves_nothing_on_failure(tiny_cfg, tmp_path, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(CheckpointError, match="not empty"):
        writer.write_checkpoint(tiny_cfg, tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep"

    calls = {"n": 0}
    real = writer.random_tensor

    def boom(spec, seed, heads=None):
        calls["n"] += 1
        if calls["n"] > 200:
            raise OSError(28, "No space left on device")
        return real(spec, seed, heads)

    monkeypatch.setattr(writer, "random_tensor", boom)
    with pytest.raises(HardwareError, match="No space left") as ei:  # the environment's: exit 3 (README)
        writer.write_checkpoint(tiny_cfg, tmp_path / "out")
    assert ei.value.exit_code == 3 and ".tmp-" not in str(ei.value)  # names out, not the removed temporary dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no out/, no temp dir


def test_shard_plan_k3_prefix_2_set_logic():
    """k3-prefix-2 at full width (~24 GB): check the writer's plan without writing data."""
    cfg = preset("k3-prefix-2")
    plan = writer.plan_shards(cfg)
    names = [s.name for sh in plan for s in sh]
    assert len(names) == len(set(names)) == layout.counts(cfg)["tensors"] == 5432
    assert set(names) == {s.name for s in layout.iter_specs(cfg)}
    assert sum(s.nbytes for sh in plan for s in sh) == layout.counts(cfg)["bytes"]
    where = {s.name: k for k, sh in enumerate(plan) for s in sh}
    expert_shards = {where[s.name] for s in layout.iter_specs(cfg) if s.part == "expert"}
    assert len(expert_shards) == 1  # one MoE layer's 896 experts in one shard
    assert {where[s.name] for s in layout.model_specs(cfg)} == {len(plan) - 1}  # 2 shards: model-level last
    for sh in plan:  # on-disk order: F32, BF16, U8, then name (expert 0, 1, 10, 100, ...)
        keys = [(writer._DTYPE_ORDER[s.dtype], s.name) for s in sh]
        assert keys == sorted(keys)
    assert writer.shard_name(1, 96) == "model-00001-of-000096.safetensors"
    with pytest.raises(Exception, match="shard count"):
        writer.plan_shards(cfg, 6)


@pytest.mark.parametrize("name", ["k3-prefix-2", "k3"])
def test_reader_accepts_writer_layout_at_full_width(tmp_path, name):
    """Header-only skeleton (sparse shard files of the full size) of a full-width config: the reader's
    validation agrees with the writer's tensor set; for the official config it is_official()."""
    cfg = preset(name)
    plan = writer.plan_shards(cfg, None if name != "k3" else 96)
    root = tmp_path / name
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    wm = {}
    for k, specs in enumerate(plan):
        sn = writer.shard_name(k + 1, len(plan))
        with open(root / sn, "wb") as f:
            f.write(writer.shard_header(specs))
            f.truncate(f.tell() + sum(s.nbytes for s in specs))
        wm.update({s.name: sn for s in specs})
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": sum(s.nbytes for sh in plan for s in sh)},
                                               "weight_map": dict(sorted(wm.items()))}))
    ix = open_checkpoint(root, check_scales=False)
    c = layout.counts(cfg)
    assert len(ix.entries) == c["tensors"]
    parts = ix.nbytes_by_part()
    assert (parts["expert"], parts["trunk"], parts["vision"]) == (c["bytes_expert"], c["bytes_trunk"], 0)
    assert ix.is_official() == (name == "k3")
    if name == "k3":
        assert len(ix.entries) == 497_220 - layout.OFFICIAL_VISION_TENSORS == 497_052
        assert len(ix.shards) == 96 and ix.shards[0] == "model-00001-of-000096.safetensors"
        # our 96 headers hold the text tensors; the release's on-disk bytes minus its data leave exactly
        # that plus ~100 bytes for each of the 168 vision entries (K3_FACTS §2)
        ours = sum(len(writer.shard_header(sh)) for sh in plan)
        release = 1_560_936_091_448 - c["bytes"] - layout.OFFICIAL_VISION_BYTES
        assert 0 < release - ours < layout.OFFICIAL_VISION_TENSORS * 200


# ----------------------------------------------------------------------------------- reader
def test_reader_loads_golden_as_is(golden_ckpt, tiny_cfg):
    ix = open_checkpoint(golden_ckpt)
    c = layout.counts(tiny_cfg)
    assert len(ix) == c["tensors"] == 1492 and ix.total_size == c["bytes"]
    assert ix.config.to_dict() == tiny_cfg.to_dict() and not ix.is_official()
    assert ix.nbytes_by_part() == {"expert": c["bytes_expert"], "trunk": c["bytes_trunk"], "vision": 0,
                                   "total": c["bytes"]}
    ref = {}
    for s in ix.shards:
        ref.update(load_file(str(golden_ckpt / s)))
    assert set(ref) == set(ix.entries)
    for n, t in ix.read_many(ix.entries).items():
        assert t.dtype == ref[n].dtype and t.shape == ref[n].shape and torch.equal(t, ref[n]), n
    # entries are absolute byte ranges: the raw bytes match the tensor
    n = "language_model.model.layers.4.block_sparse_moe.experts.11.w2.weight_scale"
    e = ix.entries[n]
    raw = (golden_ckpt / e.shard).read_bytes()[e.start:e.end]
    assert raw == ref[n].numpy().tobytes() and e.shape == (64, 2) and e.dtype == "U8"


def test_reader_writer_agree_on_tiny_set(tiny_ckpt, tiny_cfg):
    ix = open_checkpoint(tiny_ckpt)
    wm = json.loads((tiny_ckpt / INDEX_NAME).read_text())["weight_map"]
    assert set(ix.entries) == set(wm) == {s.name for s in layout.iter_specs(tiny_cfg)}
    assert Counter(e.shard for e in ix.entries.values()) == Counter(wm.values())
    for s in layout.iter_specs(tiny_cfg):
        assert ix.entries[s.name].dtype == s.dtype and ix.entries[s.name].shape == s.shape


def test_reader_skips_vision_tensors(tiny_ckpt, tmp_path):
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    shard = d / "model-00002-of-000002.safetensors"
    t = load_file(str(shard))
    t["vision_tower.blocks.0.attn.qkv.weight"] = torch.ones(8, 4, dtype=torch.bfloat16)
    t["mm_projector.proj.0.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
    save_file(t, str(shard), metadata={"format": "pt"})
    idx = json.loads((d / INDEX_NAME).read_text())
    for k in ("vision_tower.blocks.0.attn.qkv.weight", "mm_projector.proj.0.weight"):
        idx["weight_map"][k] = shard.name
    (d / INDEX_NAME).write_text(json.dumps(idx))
    ix = open_checkpoint(d)
    assert set(ix.vision) == {"vision_tower.blocks.0.attn.qkv.weight", "mm_projector.proj.0.weight"}
    assert "vision_tower.blocks.0.attn.qkv.weight" not in ix.entries
    assert ix.nbytes_by_part()["vision"] == 8 * 4 * 2 + 4 * 4 * 2


def test_read_is_zero_copy_and_never_writes_the_file(tiny_ckpt, tmp_path):
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    ix = open_checkpoint(d)
    n = "language_model.model.layers.1.self_attn.dt_bias"
    a, b = ix.read(n), ix.read(n)
    assert a.data_ptr() == b.data_ptr()  # both views of the same mapping
    before = (d / ix.entries[n].shard).read_bytes()
    a.fill_(7.0)
    assert (d / ix.entries[n].shard).read_bytes() == before
    assert torch.equal(open_checkpoint(d).read(n), load_file(str(d / ix.entries[n].shard))[n])


# ----------------------------------------------------------------------------------- manifests
def test_manifest_roundtrip_and_mismatches(tiny_ckpt, tmp_path):
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    seen = []
    m = make_manifest(d, progress=lambda done, total, name: seen.append((done, total)))
    assert m.name == MANIFEST_NAME and seen[-1][0] == seen[-1][1] == sum(p.stat().st_size for p in tiny_ckpt.iterdir())
    doc = json.loads(m.read_text())
    assert len(doc["files"]) == 4
    assert verify_manifest(d) == []
    s1, s2 = d / "model-00001-of-000002.safetensors", d / "model-00002-of-000002.safetensors"
    b = bytearray(s1.read_bytes())
    b[-5] ^= 0x01
    s1.write_bytes(bytes(b))
    with open(s2, "r+b") as f:
        f.truncate(s2.stat().st_size - 3)
    (d / "config.json").unlink()
    (d / "notes.txt").write_text("x")
    lines = verify_manifest(d)
    assert len(lines) == 3 and all("\n" not in ln for ln in lines)
    assert any(ln.startswith("model-00001-of-000002.safetensors: sha256") for ln in lines)
    assert any(ln.startswith("model-00002-of-000002.safetensors: size") for ln in lines)
    assert "config.json: missing" in lines
    assert manifest_extras(d) == ["notes.txt"]  # a file added beside the checkpoint is extra, not corruption
    with pytest.raises(CheckpointError, match="no manifest; create one first with `k3rocm checkpoint verify "
                                              "--checkpoint .* --write-manifest`"):
        verify_manifest(tiny_ckpt)


def test_shard_fingerprints(tiny_ckpt, tmp_path):
    fp = shard_fingerprints(tiny_ckpt)
    assert [r["file"] for r in fp] == ["model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors"]
    for rec in fp:
        hdr, start, size = read_shard_header(tiny_ckpt / rec["file"])
        raw = (tiny_ckpt / rec["file"]).read_bytes()
        assert rec["bytes"] == size and rec["header_sha256"] == hashlib.sha256(raw[:start]).hexdigest()
    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    first = bad / fp[0]["file"]
    os.chmod(first, 0o644)
    first.write_bytes(first.read_bytes()[:20])  # the header length now runs past the end
    got = shard_fingerprints(bad)
    assert "truncated" in got[0]["error"] and got[1] == fp[1]


# ----------------------------------------------------------------------------------- Weights
def test_weights_stack_roundtrip(tiny_ckpt, tiny_cfg):
    ix = open_checkpoint(tiny_ckpt)
    w = Weights.from_checkpoint(ix)
    assert w.nbytes() == layout.counts(tiny_cfg)["bytes"]
    I, D = tiny_cfg.moe_intermediate_size, tiny_cfg.expert_in_size
    E = tiny_cfg.num_experts
    for i in range(tiny_cfg.num_hidden_layers):
        if not tiny_cfg.is_moe_layer(i):
            with pytest.raises(CheckpointError):
                w.experts(i)
            continue
        ew = w.experts(i)
        assert isinstance(ew, ExpertWeights) and ew.quantized and ew.num_experts == E and ew.first_expert == 0
        assert ew.w13_packed.shape == (E, 2 * I, D // 2) and ew.w13_scale.shape == (E, 2 * I, D // 32)
        assert ew.w2_packed.shape == (E, D, I // 2) and ew.w2_scale.shape == (E, D, I // 32)
        assert ew.intermediate_size == I and ew.in_features == D
        for e in range(E):
            b = f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}."
            assert torch.equal(ew.w13_packed[e, :I], ix.read(b + "w1.weight_packed"))
            assert torch.equal(ew.w13_packed[e, I:], ix.read(b + "w3.weight_packed"))
            assert torch.equal(ew.w13_scale[e, :I], ix.read(b + "w1.weight_scale"))
            assert torch.equal(ew.w13_scale[e, I:], ix.read(b + "w3.weight_scale"))
            assert torch.equal(ew.w2_packed[e], ix.read(b + "w2.weight_packed"))
            assert torch.equal(ew.w2_scale[e], ix.read(b + "w2.weight_scale"))
            # per-expert names are views into the stacks (memory held once)
            assert w.get(b + "w3.weight_packed").data_ptr() == ew.w13_packed[e, I:].data_ptr()
        assert w.experts(i) is ew  # cached
    lay = w.layer(1)
    assert "self_attn.A_log" in lay and "block_sparse_moe.experts.3.w2.weight_scale" in lay
    assert all(not k.startswith("language_model") for k in lay)
    assert w.get("nope") is None and "nope" not in w
    with pytest.raises(CheckpointError, match="nope"):
        w["nope"]


def test_weights_from_tensors_and_expert_ranges(tiny_ckpt, tiny_cfg):
    ix = open_checkpoint(tiny_ckpt)
    full = Weights.from_checkpoint(ix)
    wt = Weights.from_tensors(tiny_cfg, {n: ix.read(n).clone() for n in ix.entries})
    for k, v in wt.experts(2).tensors().items():
        assert torch.equal(v, full.experts(2).tensors()[k]), k
    sub = wt.experts(2, (4, 9))
    assert sub.first_expert == 4 and sub.num_experts == 5
    assert torch.equal(sub.w2_packed, full.experts(2).w2_packed[4:9])
    ep = Weights.from_checkpoint(ix, expert_range=(8, 16), layers=[0, 1, 2])
    e1 = ep.experts(1)
    assert e1.first_expert == 8 and e1.num_experts == 8
    assert torch.equal(e1.w13_scale, full.experts(1).w13_scale[8:])
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" not in ep
    assert "language_model.model.layers.3.self_attn.q_a_proj.weight" not in ep  # layer not asked for
    assert "language_model.lm_head.weight" in ep
    no_exp = Weights.from_checkpoint(ix, include_experts=False)
    assert no_exp.nbytes() == layout.counts(tiny_cfg)["bytes_trunk"]
    with pytest.raises(CheckpointError):
        Weights.from_checkpoint(ix, expert_range=(3, 99))
    with pytest.raises(CheckpointError):
        Weights.from_checkpoint(ix, layers=[13])


def test_load_weights_dequantizes_golden_experts_like_the_oracle_would(golden_ckpt):
    w = load_weights(golden_ckpt)
    ew = w.experts(7)
    b = "language_model.model.layers.7.block_sparse_moe.experts.13."
    with safe_open(str(golden_ckpt / "model-00002-of-000002.safetensors"), "pt") as f:
        ref = mx.dequantize_mxfp4(f.get_tensor(b + "w3.weight_packed"), f.get_tensor(b + "w3.weight_scale"))
    I = ew.intermediate_size
    assert torch.equal(mx.dequantize_mxfp4(ew.w13_packed[13, I:], ew.w13_scale[13, I:]), ref)


# ----------------------------------------------------------------------------------- embedded default
def test_a_cache_path_that_is_a_file_is_refused_in_one_line(tmp_path, monkeypatch):
    from k3rocm.errors import CheckpointError

    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv("K3ROCM_CACHE", str(f))
    with pytest.raises(CheckpointError, match="must be a directory, and this is a file; set K3ROCM_CACHE") as e:
        embedded.default_checkpoint()
    assert "\n" not in str(e.value) and f.read_text() == "x"


def test_default_checkpoint_cached_atomic_and_reused(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("K3ROCM_CACHE", str(tmp_path / "cache"))
    results, errors = [], []

    def call():
        try:
            results.append(embedded.default_checkpoint())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    p = results[0]
    assert p == tmp_path / "cache" / "k3-tiny-v1"
    from k3rocm.checkpoint.verify import MANIFEST_NAME
    assert (p / MANIFEST_NAME).is_file()  # written with it, checked on every use
    assert {k: v for k, v in _files(p).items() if k != MANIFEST_NAME} == _files(tiny_ckpt)  # k3-tiny, seed 0
    assert sorted(x.name for x in (tmp_path / "cache").iterdir()) == ["k3-tiny-v1"]  # no temp leftovers
    mtime = (p / "model-00001-of-000002.safetensors").stat().st_mtime_ns
    assert embedded.default_checkpoint() == p
    assert (p / "model-00001-of-000002.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    (p / "model-00002-of-000002.safetensors").unlink()  # a broken copy is replaced
    assert embedded.default_checkpoint() == p
    assert {k: v for k, v in _files(p).items() if k != MANIFEST_NAME} == _files(tiny_ckpt)
    shard = p / "model-00001-of-000002.safetensors"  # one flipped bit in the data: caught by the manifest
    b = bytearray(shard.read_bytes())
    b[-10] ^= 0x01
    shard.chmod(0o644)
    shard.write_bytes(bytes(b))
    assert embedded.default_checkpoint() == p
    assert {k: v for k, v in _files(p).items() if k != MANIFEST_NAME} == _files(tiny_ckpt)


@pytest.mark.gpu
def test_weights_on_gpu(tiny_ckpt):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm GPU")
    ix = open_checkpoint(tiny_ckpt)
    cpu = Weights.from_checkpoint(ix)
    gpu = Weights.from_checkpoint(ix, device="cuda", expert_range=(0, 16))
    n = "language_model.model.layers.3.self_attn.kv_b_proj.weight"
    assert gpu[n].is_cuda and torch.equal(gpu[n].cpu(), cpu[n])
    assert ix.read(n, "cuda").is_cuda
    for k, v in gpu.experts(5).tensors().items():
        assert v.is_cuda and torch.equal(v.cpu(), cpu.experts(5).tensors()[k]), k
    assert gpu.nbytes() == cpu.nbytes()


def test_read_falls_back_to_copies_when_private_maps_are_refused(tiny_ckpt, monkeypatch):
    import mmap as mmap_module

    from k3rocm.checkpoint import reader

    real = mmap_module.mmap

    class StrictOvercommit:
        ACCESS_COPY, ACCESS_READ = mmap_module.ACCESS_COPY, mmap_module.ACCESS_READ

        @staticmethod
        def mmap(fd, length, access):
            if access == mmap_module.ACCESS_COPY:
                raise OSError(12, "Cannot allocate memory")
            return real(fd, length, access=access)

    monkeypatch.setattr(reader, "mmap", StrictOvercommit)
    ix = open_checkpoint(tiny_ckpt)
    n = "language_model.model.layers.1.self_attn.A_log"
    t = ix.read(n)
    ref = load_file(str(tiny_ckpt / ix.entries[n].shard))[n]
    assert torch.equal(t, ref)
    t.fill_(0.0)  # a private copy: safe to modify
    assert torch.equal(ix.read(n), ref)


def test_expert_init_codes_is_valid_mxfp4_of_the_right_scale(tiny_cfg, tmp_path):
    """``expert_init="codes"``: a checkpoint the reader accepts (it validates every E8M0 scale), whose experts
    decode to finite values with RMS within 2x of N(0, 1/in) (the gaussian init's scale), every
    E2M1 code present, deterministic per seed, and the trunk identical to the gaussian init's."""
    import torch

    from k3rocm.checkpoint.reader import open_checkpoint
    from k3rocm.mx import dequantize_mxfp4

    a = writer.write_checkpoint(tiny_cfg, tmp_path / "a", seed=3, expert_init="codes")
    b = writer.write_checkpoint(tiny_cfg, tmp_path / "b", seed=3, expert_init="codes")
    g = writer.write_checkpoint(tiny_cfg, tmp_path / "g", seed=3)
    ia, ib, ig = open_checkpoint(a), open_checkpoint(b), open_checkpoint(g)
    packed = [n for n in ia.entries if n.endswith("weight_packed")]
    assert packed
    for n in packed[:12]:
        p, sc = ia.read(n), ia.read(n.replace("weight_packed", "weight_scale"))
        assert torch.equal(p, ib.read(n))
        w = dequantize_mxfp4(p, sc)
        rms, want = float(w.pow(2).mean().sqrt()), w.shape[1] ** -0.5
        assert torch.isfinite(w).all() and 0.5 * want < rms < 2 * want, (n, rms, want)
        codes = torch.cat([p & 15, p >> 4]).unique()
        assert codes.numel() == 16 or p.numel() < 64
    trunk = [n for n in ia.entries if "experts." not in n]
    assert all(torch.equal(ia.read(n), ig.read(n)) for n in trunk)
    with pytest.raises(ConfigError, match="expert_init"):
        writer.write_checkpoint(tiny_cfg, tmp_path / "c", expert_init="uniform")
