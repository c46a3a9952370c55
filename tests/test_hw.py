"""Hardware detection (k3rocm.hw) and hardware profiles (k3rocm.profiles)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import k3rocm.cli.main
from k3rocm import hw, profiles
from k3rocm.errors import ConfigError
from k3rocm.validation.evidence import reproduction_block, software_versions

EXPECTED = {"mi355x-8", "mi350x-8", "mi325x-8", "mi300x-8", "h200-8", "h200-1", "h100-8", "b200-8", "cpu"}


def test_list_profiles_has_every_shipped_profile():
    assert EXPECTED <= set(profiles.list_profiles())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_profile_fields_and_sources(name):
    p = profiles.load_profile(name)
    assert p.name == name
    assert p.device_count >= 1 and p.memory_bytes > 0 and p.hbm_bandwidth > 0
    assert 0.5 < p.usable_fraction < 1.0
    assert p.usable_bytes == int(p.memory_bytes * p.usable_fraction)
    assert p.peak_flops["bf16"] and p.peak_flops["bf16"] > 0
    assert p.tp * 1 <= max(p.device_count, 1) and p.tp % p.ep == 0
    # every figure has a source; the usable fraction is labelled an assumption
    for key in ("device.memory_source", "device.hbm_bandwidth_source", "peak_flops.source", "link.source",
                "memory.usable_fraction_source"):
        assert p.sources.get(key), f"{name}: no source for {key}"
    assert "assumption" in p.sources["memory.usable_fraction_source"]
    if p.backend != "cpu":
        assert re.search(r"(datasheet.*20\d\d|measured here.*20\d\d)", p.sources["device.memory_source"])
    for t in p.targets:
        assert t.source and t.value > 0 and t.unit
    d = p.to_dict()
    assert d["usable_bytes"] == p.usable_bytes and d["name"] == name


def test_profile_facts():
    mi = profiles.load_profile("mi355x-8")
    assert (mi.backend, mi.arch, mi.device_count) == ("rocm", "gfx950", 8)
    assert mi.memory_bytes == 288 * 2**30 and mi.hbm_bandwidth == 8e12
    assert mi.has_fp4 and mi.link_kind == "xGMI" and mi.fp8_format == "e4m3fn"
    # K3_FACTS section 7 public figures are the MI355X targets
    tg = {t.name: t for t in mi.targets}
    assert tg["sglang-8k1k-c2-tpot"].value == 20.9 and tg["sglang-8k1k-c2-tpot"].metric == "mean_tpot_ms"
    assert tg["atom-1k1k-c64-output"].value == 1073.5
    for n in ("mi300x-8", "mi325x-8"):
        p = profiles.load_profile(n)
        assert p.arch == "gfx942" and not p.has_fp4 and p.fp8_format == "e4m3fnuz"
    h = profiles.load_profile("h200-8")
    assert h.arch == "sm_90" and not h.has_fp4 and h.link_kind == "NVLink"
    assert h.peak("mxfp4") == h.peak_flops["bf16"]  # no FP4 hardware: falls back to the bf16 rate


def test_unknown_profile_lists_known():
    with pytest.raises(ConfigError) as ei:
        profiles.load_profile("mi999x-8")
    msg = str(ei.value)
    assert "\n" not in msg and "mi999x-8" in msg
    for n in EXPECTED:
        assert n in msg


def test_malformed_profile_names_missing_field():
    with pytest.raises(ConfigError, match="device.arch"):
        profiles.parse_profile({"backend": "rocm", "device": {"name": "x"}, "memory": {}, "peak_flops": {},
                          "link": {}, "parallel": {}}, "broken", "broken.toml")


PROFILE_DIR = Path(__file__).resolve().parents[1] / "hwprofiles"
MI = "mi355x-8"
CPU = "cpu"


def _variant(tmp_path: Path, base: str, prefix: str, new: str, stem: str = "variant") -> Path:
    """A copy of ``hwprofiles/<base>.toml`` whose one line starting with ``prefix`` is replaced by ``new``
    (``{line}`` in ``new`` is the original line; ``""`` deletes it), written to ``tmp_path/<stem>.toml``."""
    lines = (PROFILE_DIR / f"{base}.toml").read_text().split("\n")
    hits = [i for i, ln in enumerate(lines) if ln.startswith(prefix)]
    assert len(hits) == 1, f"{base}.toml: {len(hits)} lines start with {prefix!r}; the case must edit exactly one"
    i = hits[0]
    lines[i] = new.replace("{line}", lines[i])
    path = tmp_path / f"{stem}.toml"
    path.write_text("\n".join(lines))
    return path


def _cases(base, prefix, field, *values):
    return [pytest.param(base, prefix, v, field, id=f"{base}:{field}={v[len(prefix):].strip() or 'missing'}")
            for v in values]


_PEAK_SRC = 'source = "AMD Instinct MI350 series datasheet (MI355X/MI350X), 2025-06: ~2.5'
# (base profile, line prefix, replacement line, dotted field the one-line message must name)
BAD_CASES = [
    *_cases(MI, "mxfp4 =", "peak_flops.mxfp4", 'mxfp4 = "nope"', "mxfp4 = 0", "mxfp4 = -1e+16", "mxfp4 = true"),
    *_cases(MI, "fp8 =", "peak_flops.fp8", "fp8 = nan", "fp8 = inf", 'fp8 = "5e15"', ""),
    *_cases(MI, "bf16 =", "peak_flops.bf16", 'bf16 = "none"', "bf16 = -1", "bf16 = 0", "bf16 = inf", ""),
    *_cases(MI, _PEAK_SRC, "peak_flops.source", "source = 5", 'source = ""'),
    # a key written below [device] belongs to [device]: refused as unknown there, not "missing peak_flops"
    *_cases(MI, "fp8_format =", "device.peak_flops", '{line}\npeak_flops = 5'),
    *_cases(MI, "hbm_bandwidth =", "device.hbm_bandwidth", 'hbm_bandwidth = "fast"', "hbm_bandwidth = nan",
            "hbm_bandwidth = inf", "hbm_bandwidth = -inf", "hbm_bandwidth = 0", "hbm_bandwidth = -8e+12",
            "hbm_bandwidth = true", "hbm_bandwidth = [8e12]", ""),
    *_cases(MI, "memory_bytes =", "device.memory_bytes", 'memory_bytes = "192GB"', "memory_bytes = 0",
            "memory_bytes = -1", "memory_bytes = 2.88e+11", "memory_bytes = true", ""),
    *_cases(MI, "count =", "device.count", "count = 0", "count = -4", "count = 8.5", "count = 8.0", 'count = "8"',
            "count = true", "count = 100000", "count = 65537", ""),
    *_cases(MI, "usable_fraction =", "memory.usable_fraction", 'usable_fraction = "x"', "usable_fraction = 1.5",
            "usable_fraction = 0", "usable_fraction = -0.5", "usable_fraction = nan", "usable_fraction = 1.0000001"),
    *_cases(MI, "workspace_reserve_bytes =", "memory.workspace_reserve_bytes", "workspace_reserve_bytes = -1",
            "workspace_reserve_bytes = 8.5e+9", 'workspace_reserve_bytes = "8GiB"'),
    *_cases(MI, "bandwidth =", "link.bandwidth", 'bandwidth = "x"', "bandwidth = -1", "bandwidth = nan",
            "bandwidth = inf", "bandwidth = 0", ""),
    *_cases(MI, "kind =", "link.kind", "kind = 5", 'kind = ""'),
    *_cases(MI, "kind =", "link.bandwidth", 'kind = "none"'),  # no link, but 1075.2 GB/s of it
    *_cases(MI, "backend =", "backend", 'backend = "tpu"', 'backend = "hip"', "backend = 5", ""),
    *_cases(MI, "fp8_format =", "device.fp8_format", 'fp8_format = "e5m2x"', 'fp8_format = "e4m3fnuz"',
            "fp8_format = 1"),
    *_cases(MI, "arch =", "device.arch", 'arch = "gfx950:sramecc+:xnack-"', 'arch = "sm_90"', "arch = 950",
            'arch = ""', ""),
    *_cases(MI, 'name = "AMD', "device.name", 'name = ""', "name = 5"),
    *_cases(MI, "description =", "description", "description = 5"),
    *_cases(MI, "tp =", "parallel.tp", "tp = 16", "tp = 0", 'tp = "8"', "tp = 8.0", ""),
    *_cases(MI, "ep =", "parallel.ep", "ep = 0", "ep = 3", "ep = 16", "ep = true"),
    *_cases(MI, "value = 20.9", "targets[0].value", 'value = "x"', "value = 0", "value = nan"),
    *_cases(MI, "value = 20.9", "targets[0].valu", "{line}\nvalu = 3"),
    # unknown keys and sections: a typo is refused, never ignored
    *_cases(MI, "fp8_format =", "device.hbm_bandwith", "{line}\nhbm_bandwith = 8e+12"),
    *_cases(MI, "ep =", "parallel.pp", "{line}\npp = 1"),
    *_cases(MI, "backend =", "backedn", '{line}\nbackedn = "rocm"'),
    *_cases(MI, "backend =", "devices", '{line}\n[devices]\ncount = 8'),
    # the cpu profile: one host, no GPU figures of zero
    *_cases(CPU, "count =", "device.count", "count = 0", "count = 4"),
    *_cases(CPU, "hbm_bandwidth =", "device.hbm_bandwidth", "hbm_bandwidth = 0", "hbm_bandwidth = -5e10"),
    *_cases(CPU, "bf16 =", "peak_flops.bf16", "bf16 = -1e12"),
    *_cases(CPU, "tp =", "parallel.tp", "tp = 0", "tp = 65"),
    *_cases(CPU, "arch =", "device.arch", 'arch = "gfx950"'),
    *_cases(CPU, "backend =", "device.arch", 'backend = "rocm"'),  # a rocm profile whose arch is "cpu"
    *_cases(CPU, "bandwidth =", "link.bandwidth", "bandwidth = 1e9"),  # kind = "none" with a bandwidth
]


@pytest.mark.parametrize("base,prefix,new,field", BAD_CASES)
def test_bad_profile_field_is_refused_naming_it(tmp_path, base, prefix, new, field):
    path = _variant(tmp_path, base, prefix, new)
    with pytest.raises(ConfigError) as ei:
        profiles.load_profile(str(path))
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{path}: "), msg  # which file
    assert re.search(rf"(?<![\w.]){re.escape(field)}(?![\w.\[])", msg), msg  # which field, as a whole name


def test_bad_profile_messages_say_value_rule_and_fix(tmp_path):
    def msg(base, prefix, new):
        with pytest.raises(ConfigError) as ei:
            profiles.load_profile(str(_variant(tmp_path, base, prefix, new, stem=f"m{len(seen)}")))
        seen.append(1)
        return str(ei.value)

    seen: list = []
    m = msg(MI, "count =", "count = 8.5")
    assert "device.count = 8.5" in m and "integer from 1 to 65536" in m and "not a float" in m
    m = msg(MI, "hbm_bandwidth =", 'hbm_bandwidth = "fast"')
    assert 'device.hbm_bandwidth = "fast"' in m and "finite number > 0" in m and "without quotes" in m
    m = msg(MI, "hbm_bandwidth =", "hbm_bandwidth = nan")
    assert "device.hbm_bandwidth = nan must be a finite number > 0" in m
    m = msg(MI, "mxfp4 =", 'mxfp4 = "nope"')
    assert 'peak_flops.mxfp4 = "nope"' in m and '"none"' in m
    m = msg(MI, "usable_fraction =", "usable_fraction = 1.5")
    assert "memory.usable_fraction = 1.5" in m and "(0, 1]" in m
    m = msg(MI, "backend =", 'backend = "tpu"')
    assert 'backend = "tpu"' in m and all(f'"{b}"' in m for b in ("rocm", "cuda", "cpu"))
    m = msg(MI, "fp8_format =", 'fp8_format = "e5m2x"')
    assert '"e4m3fn"' in m and '"e4m3fnuz"' in m
    m = msg(MI, "tp =", "tp = 16")
    assert "parallel.tp = 16" in m and "device.count = 8" in m
    m = msg(MI, "ep =", "ep = 3")
    assert "parallel.ep = 3 must divide parallel.tp = 8" in m
    # unknown keys list the known ones of that section
    m = msg(MI, "fp8_format =", "{line}\nhbm_bandwith = 8e+12")
    assert "unknown key device.hbm_bandwith in [device]" in m
    assert all(k in m for k in ("name", "arch", "count", "memory_bytes", "hbm_bandwidth", "fp8_format"))
    m = msg(MI, "backend =", "{line}\n[devices]\ncount = 8")
    assert "unknown section devices" in m and all(s in m for s in ("device", "peak_flops", "link", "memory",
                                                                    "parallel", "targets"))
    # a section written as a value at the top level
    text = (PROFILE_DIR / f"{MI}.toml").read_text()
    block = re.search(r"\n\[peak_flops\].*?\n(?=\[link\])", text, re.S)
    assert block
    path = tmp_path / "peak-scalar.toml"
    path.write_text(text.replace('backend = "rocm"\n', 'backend = "rocm"\npeak_flops = 5\n', 1)
                    .replace(block.group(0), "\n"))
    with pytest.raises(ConfigError) as ei:
        profiles.load_profile(str(path))
    assert "peak_flops = 5 must be a table" in str(ei.value) and "missing" not in str(ei.value)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_shipped_profile_passes_the_checks_as_a_file(tmp_path, name):
    # control for the table above: an unmodified copy loads, and equals the shipped profile
    path = tmp_path / f"{name}.toml"
    path.write_text((PROFILE_DIR / f"{name}.toml").read_text())
    got = profiles.load_profile(str(path))
    assert got.name == str(path.resolve())  # a file is named by its path, never as the shipped profile
    assert replace(got, name=name) == profiles.load_profile(name)


@pytest.mark.parametrize("base,prefix,new", [
    (MI, "usable_fraction =", "usable_fraction = 1"),  # the upper bound is allowed
    (MI, "usable_fraction =", "usable_fraction = 1.0"),
    (MI, "workspace_reserve_bytes =", "workspace_reserve_bytes = 0"),
    (MI, "count =", "count = 65536"),
    (MI, "count =", "count = 16"),
    (MI, "mxfp4 =", 'mxfp4 = "none"'),
    (MI, "arch =", 'arch = "gfx90a"'),  # arch is free-form within the backend's naming (no arch table in the code)
    (MI, "hbm_bandwidth =", "hbm_bandwidth = 8000000000000"),  # an integer rate is a rate
    (MI, "ep =", "ep = 2"),
    (CPU, "bandwidth =", "bandwidth = 0.0"),
])
def test_edge_values_that_are_valid_load(tmp_path, base, prefix, new):
    p = profiles.load_profile(str(_variant(tmp_path, base, prefix, new)))
    key = new.split("=")[0].strip()
    got = {"usable_fraction": p.usable_fraction, "workspace_reserve_bytes": p.workspace_reserve_bytes,
           "count": p.device_count, "mxfp4": p.peak_flops["mxfp4"], "arch": p.arch,
           "hbm_bandwidth": p.hbm_bandwidth, "ep": p.ep, "bandwidth": p.link_bandwidth}[key]
    want = new.split("=", 1)[1].strip()
    assert got == (None if want == '"none"' else want.strip('"') if want.startswith('"') else float(want))


def test_profile_path_that_is_a_directory_or_not_toml(tmp_path):
    d = tmp_path / "dir.toml"
    d.mkdir()
    with pytest.raises(ConfigError, match="is a directory") as ei:
        profiles.load_profile(str(d))
    assert str(d) in str(ei.value) and "\n" not in str(ei.value)
    j = tmp_path / "prof.json"
    j.write_text((PROFILE_DIR / f"{MI}.toml").read_text())
    with pytest.raises(ConfigError, match=r"not a \.toml file"):
        profiles.load_profile(str(j))
    b = tmp_path / "binary.toml"
    b.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not valid TOML"):
        profiles.load_profile(str(b))


@pytest.mark.parametrize("prefix,new,field", [("count =", "count = 8.5", "device.count"),
                                              ("hbm_bandwidth =", 'hbm_bandwidth = "fast"', "device.hbm_bandwidth"),
                                              ("mxfp4 =", 'mxfp4 = "nope"', "peak_flops.mxfp4")])
def test_cli_plan_bad_profile_exits_2_with_one_line(tmp_path, prefix, new, field):
    path = _variant(tmp_path, MI, prefix, new)
    result = CliRunner().invoke(k3rocm.cli.main.cli, ["plan", "--profile", str(path)])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # handled: no traceback
    assert "Traceback" not in result.output and field in result.output and str(path) in result.output


def test_detect_on_this_machine():
    d = hw.detect()
    assert d.backend in ("rocm", "cuda", "cpu")
    assert d.torch_version == torch.__version__
    if torch.version.hip:
        assert d.torch_build.startswith("ROCm")
    if not torch.cuda.is_available():
        assert d.backend == "cpu" and d.devices == [] and d.arch is None
        assert profiles.match_profile(d).name == "cpu"
    dd = d.to_dict()
    assert dd["count"] == d.count and isinstance(dd["env"], dict)


def test_relevant_env_filters(monkeypatch):
    """The one filter, and a report's reproduction block records exactly what it keeps."""
    env = {"HIP_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO", "RCCL_MSCCL_ENABLE": "0", "TRITON_INTERPRET": "1",
           "HSA_XNACK": "0", "PYTORCH_TUNABLEOP_ENABLED": "1", "CUDA_VISIBLE_DEVICES": "3", "ROCR_VISIBLE_DEVICES": "1",
           "ROCM_PATH": "/opt/rocm", "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_COMPILE_DEBUG": "0", "AITER_LOG_MORE": "1",
           "K3ROCM_KERNELS": "oracle", "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "MASTER_ADDR": "h0",
           "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0",
           "HOME": "/root", "PATH": "/bin", "SECRET_TOKEN": "x", "RANKING": "x", "MY_CUDA_HOME": "x"}
    got = hw.relevant_env(env)
    assert set(got) == set(env) - {"HOME", "PATH", "SECRET_TOKEN", "RANKING", "MY_CUDA_HOME"}
    assert list(got) == sorted(got)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    b = reproduction_block(command="k3rocm validate", checkpoint=None, config_hash=None, seed=0)
    assert b["env"] == hw.relevant_env() and got.items() <= b["env"].items()
    assert not {"SECRET_TOKEN", "RANKING", "MY_CUDA_HOME"} & set(b["env"])


class _FakeProps(SimpleNamespace):
    pass


def _fake_torch(monkeypatch, hip, cuda, props):
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(props))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])


def test_detect_rocm_uses_gcn_arch_not_capability(monkeypatch):
    # AMD reports a CUDA-style capability (9, 4); the arch must come from gcnArchName
    props = [_FakeProps(name="AMD Instinct MI355X", gcnArchName="gfx950:sramecc+:xnack-", major=9, minor=4,
                        total_memory=288 * 2**30 - 2**28, multi_processor_count=256) for _ in range(8)]
    _fake_torch(monkeypatch, "7.0.1", None, props)
    d = hw.detect(with_smi=False)
    assert d.backend == "rocm" and d.count == 8 and d.torch_build == "ROCm 7.0.1"
    assert d.devices[0].arch == "gfx950:sramecc+:xnack-" and d.arch == "gfx950"
    assert profiles.match_profile(d).name == "mi355x-8"
    # fewer visible devices -> the largest profile not above the count, same arch
    _fake_torch(monkeypatch, "7.0.1", None, props[:1])
    assert profiles.match_profile(hw.detect(with_smi=False)).arch == "gfx950"
    props3 = [_FakeProps(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", major=9, minor=4,
                         total_memory=192 * 2**30, multi_processor_count=304) for _ in range(8)]
    _fake_torch(monkeypatch, "6.4.0", None, props3)
    assert profiles.match_profile(hw.detect(with_smi=False)).name == "mi300x-8"


@pytest.mark.parametrize("hip, cuda, toolkit, name, software", [
    ("7.0.1", None, ("hip", "7.0.1"), "ROCm 7.0.1", "hip 7.0.1"),
    ("7.0.1", "12.4", ("hip", "7.0.1"), "ROCm 7.0.1", "hip 7.0.1"),  # hip wins
    (None, "13.0", ("cuda", "13.0"), "CUDA 13.0", "cuda 13.0"),
    (None, None, ("cpu", None), "CPU", "cpu"),
])
def test_torch_build_is_read_once_for_detection_and_reports(monkeypatch, hip, cuda, toolkit, name, software):
    _fake_torch(monkeypatch, hip, cuda, [])
    tb = hw.torch_build()
    assert (tb.version, tb.hip, tb.cuda) == (torch.__version__, hip, cuda)
    assert tb.toolkit == toolkit and tb.name == name
    assert hw.detect(with_smi=False).torch_build == name
    assert software_versions()["torch_build"] == software  # the report's spelling of the same build


def test_profile_matches_same_backend_arch_and_enough_devices():
    mi = profiles.load_profile("mi355x-8")

    def det(backend="rocm", arch="gfx950", count=8):
        return SimpleNamespace(backend=backend, arch=arch, count=count)

    assert mi.matches(det()) and mi.matches(det(count=9))  # more devices than the profile names still match
    assert not mi.matches(det(count=7))
    assert not mi.matches(det(arch="gfx942"))
    assert not mi.matches(det(backend="cuda"))
    assert not mi.matches(det(backend="cpu", arch=None, count=0))
    assert profiles.load_profile("cpu").matches(det())  # a CPU profile runs on any machine's CPU


def test_detect_cuda_arch_from_capability(monkeypatch):
    props = [_FakeProps(name="NVIDIA H200", major=9, minor=0, total_memory=150 * 10**9, multi_processor_count=132)]
    _fake_torch(monkeypatch, None, "13.0", props)
    d = hw.detect(with_smi=False)
    assert d.backend == "cuda" and d.arch == "sm_90" and d.torch_build == "CUDA 13.0"
    assert profiles.match_profile(d).name == "h200-1"
    props8 = props * 8
    _fake_torch(monkeypatch, None, "13.0", props8)
    assert profiles.match_profile(hw.detect(with_smi=False)).name == "h200-8"


def test_gpu_build_without_device_is_cpu(monkeypatch):
    _fake_torch(monkeypatch, "7.0.1", None, [])
    d = hw.detect(with_smi=False)
    assert d.backend == "cpu" and any("no device" in n for n in d.notes)


@pytest.mark.gpu
def test_detect_real_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    d = hw.detect()
    assert d.backend in ("rocm", "cuda") and d.count == torch.cuda.device_count()
    assert d.devices[0].memory_bytes == torch.cuda.get_device_properties(0).total_memory
    if d.backend == "rocm":
        assert d.arch.startswith("gfx")
    else:
        assert d.arch.startswith("sm_")
