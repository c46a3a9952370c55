"""Each kind of broken checkpoint is refused before any device work with one clear line.

Every case copies a freshly written k3-tiny checkpoint (the session's ``tiny_ckpt``) and damages it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3rocm.checkpoint.reader import INDEX_NAME, open_checkpoint
from k3rocm.errors import CheckpointError, ConfigError, K3Error

S1 = "model-00001-of-000002.safetensors"
S2 = "model-00002-of-000002.safetensors"
A_LOG = "language_model.model.layers.1.self_attn.A_log"
SCALE = "language_model.model.layers.2.block_sparse_moe.experts.10.w2.weight_scale"


@pytest.fixture
def ck(tiny_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))


def _refused(path: Path, kind: type[K3Error], *needles: str, max_len: int = 400, **kw) -> str:
    with pytest.raises(kind) as ei:
        open_checkpoint(path, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and msg.strip() == msg and len(msg) < max_len, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def _full(ck: Path, shard: str) -> str:
    """A shard as error messages name it: its full path in the (resolved) checkpoint directory."""
    return str(ck.resolve() / shard)


def _index(ck: Path) -> dict:
    return json.loads((ck / INDEX_NAME).read_text())


def _write_index(ck: Path, doc: dict) -> None:
    (ck / INDEX_NAME).write_text(json.dumps(doc, indent=2))


def _rewrite_shard(ck: Path, shard: str, edit) -> None:
    t = load_file(str(ck / shard))
    edit(t)
    save_file(t, str(ck / shard), metadata={"format": "pt"})


def test_fresh_copy_is_accepted(ck):
    assert len(open_checkpoint(ck)) == 1492


def test_missing_shard(ck):
    (ck / S2).unlink()
    _refused(ck, CheckpointError, S2, "missing")


def test_truncated_shard(ck):
    size = (ck / S1).stat().st_size
    with open(ck / S1, "r+b") as f:
        f.truncate(size - 100)
    _refused(ck, CheckpointError, _full(ck, S1), "truncated", "language_model.model.")


def test_header_length_past_end_of_file(ck):
    b = bytearray((ck / S2).read_bytes())
    b[:8] = (len(b) + 1).to_bytes(8, "little")
    (ck / S2).write_bytes(bytes(b))
    _refused(ck, CheckpointError, _full(ck, S2), "header length", "past the end")


def test_shard_shorter_than_a_header(ck):
    (ck / S2).write_bytes(b"\x01\x02")
    _refused(ck, CheckpointError, _full(ck, S2), "too short")


def test_zero_byte_shard(ck):
    (ck / S1).write_bytes(b"")
    _refused(ck, CheckpointError, _full(ck, S1), "0 bytes", "too short")


def test_header_not_json(ck):
    b = bytearray((ck / S1).read_bytes())
    b[8:12] = b"\xff\xfe{["
    (ck / S1).write_bytes(bytes(b))
    _refused(ck, CheckpointError, _full(ck, S1), "not valid JSON")


def test_index_names_tensor_the_shard_lacks(ck):
    doc = _index(ck)
    doc["weight_map"]["language_model.model.layers.0.self_attn.extra.weight"] = S1
    _write_index(ck, doc)
    _refused(ck, CheckpointError, "language_model.model.layers.0.self_attn.extra.weight", S1, "does not hold",
             str(ck.resolve() / INDEX_NAME))  # the index named by its path, not a bare file name


def test_index_points_at_the_wrong_shard(ck):
    doc = _index(ck)
    doc["weight_map"][A_LOG] = S2
    _write_index(ck, doc)
    msg = _refused(ck, CheckpointError, A_LOG, S2, S1)
    assert msg.startswith(f"{ck.resolve() / INDEX_NAME}: "), msg  # which checkpoint's index is wrong


def test_tensor_in_two_shards(ck):
    dup = load_file(str(ck / S1))[A_LOG]
    _rewrite_shard(ck, S2, lambda t: t.__setitem__(A_LOG, dup))
    _refused(ck, CheckpointError, A_LOG, S1, S2, "both")


def test_shard_tensor_missing_from_index(ck):
    doc = _index(ck)
    del doc["weight_map"][A_LOG]
    _write_index(ck, doc)
    _refused(ck, CheckpointError, A_LOG, "does not list")


def test_wrong_dtype(ck):
    _rewrite_shard(ck, S1, lambda t: t.__setitem__(A_LOG, t[A_LOG].to(torch.bfloat16)))
    _refused(ck, CheckpointError, _full(ck, S1), A_LOG, "BF16", "F32")


def test_wrong_shape(ck):
    _rewrite_shard(ck, S1, lambda t: t.__setitem__(A_LOG, t[A_LOG][:16].clone()))
    _refused(ck, CheckpointError, A_LOG, "[16]", "[32]")


def test_missing_and_unexpected_tensors(ck, tmp_path):
    other = Path(shutil.copytree(ck, tmp_path / "other"))
    _rewrite_shard(ck, S1, lambda t: t.pop(A_LOG))
    doc = _index(ck)
    del doc["weight_map"][A_LOG]
    _write_index(ck, doc)
    _refused(ck, CheckpointError, A_LOG, "missing")

    name = "language_model.model.layers.1.self_attn.bonus.weight"
    _rewrite_shard(other, S1, lambda t: t.__setitem__(name, torch.zeros(2, dtype=torch.bfloat16)))
    doc = _index(other)
    doc["weight_map"][name] = S1
    _write_index(other, doc)
    _refused(other, CheckpointError, name, "unexpected")


@pytest.mark.parametrize("byte", [0xFD, 0xFE])
def test_scale_byte_that_decodes_to_inf(ck, byte):
    """E8M0 2^126 / 2^127: the block's E2M1 values up to 6 decode past fp32's and bf16's range (Inf), which load
    once reported as validated scales; refused like the NaN byte, naming the byte and where; 0xFC (2^125: 6 x 2^125
    is finite) passes."""
    ix = open_checkpoint(ck)
    e = ix.entries[SCALE]
    ix.close()
    orig = (ck / e.shard).read_bytes()
    b = bytearray(orig)
    b[e.start + 2 * 5] = byte  # row 5, column 0 of a [64, 2] scale
    (ck / e.shard).write_bytes(bytes(b))
    _refused(ck, CheckpointError, SCALE, e.shard, f"0x{byte:02X}", f"2^{byte - 127}", "Inf", "(5, 0)")
    b[e.start + 2 * 5] = 0xFC
    (ck / e.shard).write_bytes(bytes(b))
    assert len(open_checkpoint(ck)) == 1492


def test_0xff_scale_byte(ck):
    ix = open_checkpoint(ck)
    e = ix.entries[SCALE]
    ix.close()
    b = bytearray((ck / e.shard).read_bytes())
    b[e.start + 2 * 3 + 1] = 0xFF  # row 3, column 1 of a [64, 2] scale
    (ck / e.shard).write_bytes(bytes(b))
    _refused(ck, CheckpointError, SCALE, e.shard, "0xFF", "(3, 1)")
    assert len(open_checkpoint(ck, check_scales=False)) == 1492  # the scan can be skipped for huge checkpoints


@pytest.mark.parametrize("bad", ["../evil.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_shard_path_escaping_the_directory(ck, bad):
    doc = _index(ck)
    doc["weight_map"][A_LOG] = bad
    _write_index(ck, doc)
    _refused(ck, CheckpointError, bad, "leaves the checkpoint directory")


def test_single_file_symlink_leaving_the_directory(ck, tmp_path):
    """A lone model.safetensors (no index) that links outside is refused before its header is read."""
    (ck / INDEX_NAME).unlink()
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"\xff" * 16)  # not even a header: reading it first would give another error
    os.symlink(outside, ck / "model.safetensors")
    _refused(ck, CheckpointError, "model.safetensors", "outside the checkpoint directory")


def test_shard_symlink_leaving_the_directory(ck, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.move(ck / S2, outside)
    os.symlink(outside, ck / S2)
    _refused(ck, CheckpointError, S2, "outside the checkpoint directory")


def test_config_without_full_attn_layers(ck):
    doc = json.loads((ck / "config.json").read_text())
    del doc["text_config"]["linear_attn_config"]["full_attn_layers"]
    (ck / "config.json").write_text(json.dumps(doc))
    _refused(ck, ConfigError, "config.json", "full_attn_layers")


def test_config_without_quantization_over_mxfp4_shards_says_so(ck):
    """quantization_config removed while the shards hold packed MXFP4 experts: the config is what is wrong, not
    "the checkpoint is incomplete" (the expert .weight tensors the unquantized config expects)."""
    doc = json.loads((ck / "config.json").read_text())
    del doc["text_config"]["quantization_config"]
    (ck / "config.json").write_text(json.dumps(doc))
    msg = _refused(ck, ConfigError, str(ck.resolve() / "config.json"), "has no text_config.quantization_config",
                   "packed MXFP4", ".weight_packed", "weight_scale", "released config.json")
    assert "incomplete" not in msg and "missing" not in msg, msg


def test_config_declaring_mxfp4_over_unquantized_shards_says_so(tmp_path):
    from k3rocm.checkpoint.writer import write_checkpoint
    from k3rocm.config import K3Config, preset

    doc = preset("k3-tiny").to_dict()
    qc = doc["text_config"].pop("quantization_config")
    ck = write_checkpoint(K3Config.from_dict(doc, name="k3-tiny-bf16"), tmp_path / "ck")
    assert len(open_checkpoint(ck)) > 0  # unquantized experts, consistent config: accepted
    doc["text_config"]["quantization_config"] = qc
    (ck / "config.json").write_text(json.dumps(doc))
    msg = _refused(ck, ConfigError, "declares MXFP4 routed experts", "unquantized", ".weight (no .weight_packed")
    assert "incomplete" not in msg, msg


def test_config_json_that_is_a_directory_or_lacks_text_config(ck):
    doc = json.loads((ck / "config.json").read_text())
    del doc["text_config"]  # not "linear_attn_config is missing": the whole text model is
    (ck / "config.json").write_text(json.dumps(doc))
    msg = _refused(ck, ConfigError, "config.json: text_config is missing", "released config.json")
    assert "linear_attn_config" not in msg, msg
    (ck / "config.json").unlink()
    (ck / "config.json").mkdir()
    _refused(ck, ConfigError, "config.json: is a directory, not a file")


def test_config_missing_or_not_json(ck):
    (ck / "config.json").write_text("{not json")
    _refused(ck, ConfigError, "config.json", "not valid JSON")
    (ck / "config.json").unlink()
    _refused(ck, ConfigError, "config.json", "not found")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth", "optimizer.pkl"])
def test_pickle_file_refused(ck, name):
    (ck / name).write_bytes(b"\x80\x04K\x01.")
    _refused(ck, CheckpointError, name, "pickle")


def test_missing_index_and_not_a_directory(ck):
    (ck / INDEX_NAME).unlink()
    _refused(ck, CheckpointError, INDEX_NAME)
    _refused(ck / "config.json", CheckpointError, "not a checkpoint directory")
    _refused(ck / "nope", CheckpointError, "not a checkpoint directory")


def test_index_not_json_or_duplicate_keys(ck):
    raw = (ck / INDEX_NAME).read_text()
    first = raw.index('"language_model.')
    line_end = raw.index("\n", first)
    dup = raw[:line_end] + "\n" + raw[first:line_end] + raw[line_end:]
    (ck / INDEX_NAME).write_text(dup)
    _refused(ck, CheckpointError, INDEX_NAME, "twice")
    (ck / INDEX_NAME).write_text("[")
    _refused(ck, CheckpointError, INDEX_NAME, "not valid JSON")
    (ck / INDEX_NAME).write_text("[" * 100_000 + "]" * 100_000)  # deeper than Python's parser goes
    _refused(ck, CheckpointError, INDEX_NAME, "not valid JSON")


def test_corrupt_data_offsets(ck):
    b = (ck / S1).read_bytes()
    n = int.from_bytes(b[:8], "little")
    hdr = json.loads(b[8:8 + n])
    hdr[A_LOG]["data_offsets"][1] += 4  # no longer shape x dtype
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (n - len(js)) if len(js) <= n else b""
    assert len(js) == n
    (ck / S1).write_bytes(b[:8] + js + b[8 + n:])
    _refused(ck, CheckpointError, _full(ck, S1), A_LOG, "data_offsets")


def test_unknown_dtype_and_overlap_say_what_to_do(ck):
    b = (ck / S1).read_bytes()
    n = int.from_bytes(b[:8], "little")
    hdr = json.loads(b[8:8 + n])

    def write(h):
        js = json.dumps(h, separators=(",", ":")).encode()
        assert len(js) <= n
        (ck / S1).write_bytes(b[:8] + js + b" " * (n - len(js)) + b[8 + n:])

    write({**hdr, A_LOG: {**hdr[A_LOG], "dtype": "F4"}})
    _refused(ck, CheckpointError, _full(ck, S1), A_LOG, "unknown dtype 'F4'", "re-download the shard")
    first, second = sorted((k for k in hdr if k != "__metadata__"), key=lambda k: hdr[k]["data_offsets"])[:2]
    a0, _ = hdr[first]["data_offsets"]
    a1, b1 = hdr[second]["data_offsets"]
    write({**hdr, second: {**hdr[second], "data_offsets": [a1 - 2, b1 - 2]}})  # starts inside the first
    _refused(ck, CheckpointError, _full(ck, S1), "overlap", "header is corrupt", "re-download the shard")


# The safetensors format: the tensors' data_offsets, sorted, tile the data region exactly. safe_open (the oracle)
# refuses trailing bytes and gaps; so must we, with one line naming the shard (and the tensor after a gap).
def _safe_open_refuses(path: Path, needle: str) -> None:
    from safetensors import safe_open

    with pytest.raises(Exception) as ei:
        with safe_open(str(path), "pt"):
            pass
    assert needle in str(ei.value), ei.value


def _cli_refuses(ck: Path, tmp_path: Path, *needles: str) -> None:
    """``checkpoint inspect``, ``load`` and ``validate`` all exit 2 with one line (they exited 0)."""
    for args in (["checkpoint", "inspect", "--checkpoint", str(ck)],
                 ["load", "--checkpoint", str(ck), "--out", str(tmp_path / "r-load")],
                 ["validate", "--level", "load", "--checkpoint", str(ck), "--out", str(tmp_path / "r-val")]):
        r = _cli(*args)
        err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("k3rocm: ")]
        assert r.exit_code == 2 and len(err) == 1 and err[0].startswith("error: "), (args, r.exit_code, r.stderr)
        assert "Traceback" not in r.output + r.stderr
        for nd in needles:
            assert nd in err[0], (args, nd, err[0])


def test_bytes_appended_after_the_last_tensor(ck, tmp_path):
    _rewrite_shard(ck, S1, lambda t: None)  # a shard as safetensors.torch.save_file writes it
    assert len(open_checkpoint(ck)) == 1492
    with open(ck / S1, "ab") as f:
        f.write(os.urandom(4096))
    _safe_open_refuses(ck / S1, "incomplete metadata, file not fully covered")
    msg = _refused(ck, CheckpointError, _full(ck, S1), "last 4096 bytes belong to no tensor", "re-download the shard")
    assert "\n" not in msg
    _cli_refuses(ck, tmp_path, _full(ck, S1), "4096 bytes", "re-download")


def _shift_after(path: Path, k: int, gap: int) -> str:
    """Move the data of the ``k``-th tensor (by offset) and every later one ``gap`` bytes on, leaving a gap of
    ``gap`` zero bytes before it; the header is rewritten to match. Returns that tensor's name."""
    b = path.read_bytes()
    n = int.from_bytes(b[:8], "little")
    hdr = json.loads(b[8:8 + n])
    data = b[8 + n:]
    names = sorted((x for x in hdr if x != "__metadata__"), key=lambda x: hdr[x]["data_offsets"])
    at = hdr[names[k]]["data_offsets"][0]
    for x in names[k:]:
        hdr[x]["data_offsets"] = [o + gap for o in hdr[x]["data_offsets"]]
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    path.write_bytes(len(js).to_bytes(8, "little") + js + data[:at] + bytes(gap) + data[at:])
    return names[k]


def test_gap_between_two_tensors(ck, tmp_path):
    _rewrite_shard(ck, S2, lambda t: None)
    after = _shift_after(ck / S2, 5, 64)
    _safe_open_refuses(ck / S2, f"invalid offset for tensor `{after}`")
    _refused(ck, CheckpointError, _full(ck, S2), f"64 bytes before tensor {after}", "belong to no tensor",
             "header is corrupt", "re-download the shard")
    _cli_refuses(ck, tmp_path, _full(ck, S2), after, "re-download")


@pytest.mark.parametrize("damage, oracle, needles", [
    ("gap_first", "invalid offset for tensor `a`", ("8 bytes before tensor a", "data region starts at offset 0")),
    ("gap_middle", "invalid offset for tensor `b`", ("16 bytes before tensor b", "tensor a ends at data offset 16")),
    ("trailing", "file not fully covered", ("last 3 bytes belong to no tensor", "tensor, b, ends at byte")),
    ("no_tensor_trailing", "file not fully covered", ("last 5 bytes belong to no tensor", "lists no tensor")),
])
def test_shard_coverage_matches_safe_open(tmp_path, damage, oracle, needles):
    """A small save_file shard, damaged: the reader refuses exactly what safe_open refuses."""
    from k3rocm.checkpoint.reader import _shard_entries

    p = tmp_path / "one.safetensors"
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 3)} if damage != "no_tensor_trailing" else {}, str(p))
    assert damage == "no_tensor_trailing" or set(_shard_entries(p, p.name)) == {"a", "b"}  # undamaged: accepted
    if damage == "gap_first":
        _shift_after(p, 0, 8)
    elif damage == "gap_middle":
        _shift_after(p, 1, 16)
    else:
        with open(p, "ab") as f:
            f.write(b"\x00" * (3 if damage == "trailing" else 5))
    _safe_open_refuses(p, oracle)
    with pytest.raises(CheckpointError) as ei:
        _shard_entries(p, p.name)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: ") and "\n" not in msg and msg.endswith("re-download the shard (or write it again)")
    for nd in needles:
        assert nd in msg, (nd, msg)


# ---------------------------------------------------------------------- Hugging Face cache layout
REV = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(src: Path, hub: Path, repo: str = "models--moonshotai--Kimi-K3") -> Path:
    """Lay ``src`` out as the hub cache does: ``<repo>/blobs/<hash>`` holds the bytes and every file of
    ``<repo>/snapshots/<rev>/`` is a relative symlink ``../../blobs/<hash>``. Returns the snapshot dir."""
    import hashlib

    blobs, snap = hub / repo / "blobs", hub / repo / "snapshots" / REV
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        h = hashlib.sha1(f.name.encode()).hexdigest()
        shutil.copyfile(f, blobs / h)
        os.symlink(f"../../blobs/{h}", snap / f.name)
    return snap


def _cli(*args: str):
    from click.testing import CliRunner

    from k3rocm.cli.main import cli

    return CliRunner().invoke(cli, list(args), env={"COLUMNS": "200"})


def test_hf_cache_snapshot_is_accepted_and_loads(golden_ckpt, tmp_path):
    """A snapshot whose files all link into the repo's blobs/ validates, inspects and loads through the links."""
    snap = _hf_cache(golden_ckpt, tmp_path / "hub")
    assert all((snap / f.name).is_symlink() for f in golden_ckpt.iterdir())
    ix = open_checkpoint(snap)
    assert len(ix) == 1492 and ix.path == snap.resolve()
    ref = load_file(str(golden_ckpt / S1))[A_LOG]
    assert torch.equal(ix.read(A_LOG), ref)
    ix.close()

    r = _cli("checkpoint", "inspect", "--checkpoint", str(snap), "--json")
    assert r.exit_code == 0, r.output + r.stderr
    assert json.loads(r.stdout)["tensors"] == 1492

    out = tmp_path / "report"
    r = _cli("load", "--checkpoint", str(snap), "--out", str(out))
    assert r.exit_code == 0, r.output + r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["stages"]["load"]["status"] == "passed", rep["stages"]["load"]


@pytest.mark.parametrize("target", ["elsewhere", "other_repo_blobs", "not_a_snapshot"])
def test_hf_cache_escapes_are_still_refused(golden_ckpt, tmp_path, target):
    """Only links into the same cache repo's blobs/ are allowed: a link anywhere else is refused."""
    snap = _hf_cache(golden_ckpt, tmp_path / "hub")
    if target == "not_a_snapshot":  # <repo>/blobs exists, but the directory is not <repo>/snapshots/<rev>
        d = snap.parent.parent / "copies" / REV
        shutil.copytree(snap, d, symlinks=True)
        _refused(d, CheckpointError, S1, "outside the checkpoint directory", "/blobs/", max_len=600)
        return
    if target == "elsewhere":
        victim = tmp_path / "elsewhere" / S2
    else:
        victim = tmp_path / "hub" / "models--someone--other" / "blobs" / "f00d"
        (victim.parent.parent / "snapshots").mkdir(parents=True)
    victim.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(golden_ckpt / S2, victim)
    (snap / S2).unlink()
    os.symlink(victim, snap / S2)
    # two long paths (the index in the snapshot and the link's target): allow a longer line
    msg = _refused(snap, CheckpointError, S2, "outside the checkpoint directory", str(victim.resolve()),
                   max_len=600)
    assert msg.endswith("copy the file into the directory")


# ---------------------------------------------------------------------- checkpoint make --out
def _one_error_line(r) -> str:
    assert r.exit_code == 2, (r.exit_code, r.exception, r.output, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.output
    return lines[0]


@pytest.mark.parametrize("out", ["", "   "])
def test_make_refuses_an_empty_out(out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty path would otherwise mean "." (here: an empty directory)
    line = _one_error_line(_cli("checkpoint", "make", "--out", out))
    assert "--out is empty" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["/proc/k3rocm-mk8", "/proc/k3rocm-x/y"])
def test_make_refuses_an_unwritable_location_before_the_space_check(out):
    """/proc refuses new entries whatever the permission bits (root included): say so, not "0.0 GB free"."""
    if not Path("/proc/self").exists():
        pytest.skip("no procfs on this system")
    line = _one_error_line(_cli("checkpoint", "make", "--out", out))
    assert line.startswith(f"error: {out}: ") and "/proc" in line and "not writable" in line, line
    assert "GB" not in line, line


def test_make_leaves_no_probe_behind(tmp_path):
    out = tmp_path / "new" / "k3-tiny"
    r = _cli("checkpoint", "make", "--out", str(out))
    assert r.exit_code == 0, r.output + r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["new"] and [p.name for p in out.parent.iterdir()] == ["k3-tiny"]
    assert len(open_checkpoint(out)) == 1492


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["weight_map"].__setitem__(A_LOG, [S1]), "weight_map entry for " + A_LOG),
    (lambda d: d["weight_map"].__setitem__(A_LOG, None), "weight_map entry for " + A_LOG),
    (lambda d: d.__setitem__("weight_map", sorted(d["weight_map"])), "weight_map is a JSON list"),  # said "no weight_map"
    (lambda d: d.pop("weight_map"), "no weight_map"),
    (lambda d: d.__setitem__("metadata", {"total_size": "lots"}), "metadata.total_size"),
    (lambda d: d.__setitem__("metadata", {"total_size": -1}), "metadata.total_size"),
])
def test_malformed_index_values(ck, edit, needle):
    """A weight_map value that is no file name, or a total_size that is no byte count: one line, no crash."""
    doc = _index(ck)
    edit(doc)
    _write_index(ck, doc)
    _refused(ck, CheckpointError, str(ck.resolve() / INDEX_NAME), needle)


def test_index_metadata_leniency(ck):
    """total_size as an integral float or digit string (other writers do that), or metadata as a list, is fine."""
    for meta, want in (({"total_size": 6475776.0}, 6475776), ({"total_size": "6475776"}, 6475776), ([], None)):
        doc = _index(ck)
        doc["metadata"] = meta
        _write_index(ck, doc)
        assert open_checkpoint(ck, check_scales=False).total_size == want


def test_a_shard_that_is_a_directory_is_named_as_such(tmp_path):
    # the index names a shard that exists as a directory: say so, not "missing"
    from k3rocm.checkpoint.reader import _safe_shard_path
    from k3rocm.errors import CheckpointError
    (tmp_path / "model-00001-of-00002.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="is a directory or special file"):
        _safe_shard_path(tmp_path, "model-00001-of-00002.safetensors", tmp_path / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match="is missing"):
        _safe_shard_path(tmp_path, "model-00002-of-00002.safetensors", tmp_path / "model.safetensors.index.json")


def test_a_checkpoint_directory_that_is_a_loop_or_broken_symlink_says_so(tmp_path):
    loop, other, gone = tmp_path / "loop", tmp_path / "other", tmp_path / "gone"
    loop.symlink_to(other)
    other.symlink_to(loop)
    gone.symlink_to(tmp_path / "nowhere")
    _refused(loop, CheckpointError, f"{loop}: is a symbolic link that does not resolve (a loop: it points to {other}",
             "point the link at the checkpoint directory")
    _refused(gone, CheckpointError, f"{gone}: is a symbolic link that does not resolve (broken: its target "
             f"{tmp_path / 'nowhere'} does not exist)")
    _refused(loop / "sub", CheckpointError, "goes through a symbolic link that does not resolve (a loop)")
    _refused(tmp_path / "missing", CheckpointError, "it does not exist or is a file")  # a plain missing path
