"""Hardware detection and profiles (k3rocm.hw)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from k3rocm import hw
from k3rocm.errors import ConfigError

EXPECTED = {"mi355x-8", "mi350x-8", "mi325x-8", "mi300x-8", "h200-8", "h200-1", "h100-8", "b200-8", "cpu"}


def test_list_profiles_has_every_shipped_profile():
    assert EXPECTED <= set(hw.list_profiles())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_profile_fields_and_sources(name):
    p = hw.load_profile(name)
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
    mi = hw.load_profile("mi355x-8")
    assert (mi.backend, mi.arch, mi.device_count) == ("rocm", "gfx950", 8)
    assert mi.memory_bytes == 288 * 2**30 and mi.hbm_bandwidth == 8e12
    assert mi.has_fp4 and mi.link_kind == "xGMI" and mi.fp8_format == "e4m3fn"
    # K3_FACTS section 7 public figures are the MI355X targets
    tg = {t.name: t for t in mi.targets}
    assert tg["sglang-8k1k-c2-tpot"].value == 20.9 and tg["sglang-8k1k-c2-tpot"].metric == "mean_tpot_ms"
    assert tg["atom-1k1k-c64-output"].value == 1073.5
    for n in ("mi300x-8", "mi325x-8"):
        p = hw.load_profile(n)
        assert p.arch == "gfx942" and not p.has_fp4 and p.fp8_format == "e4m3fnuz"
    h = hw.load_profile("h200-8")
    assert h.arch == "sm_90" and not h.has_fp4 and h.link_kind == "NVLink"
    assert h.peak("mxfp4") == h.peak_flops["bf16"]  # no FP4 hardware: falls back to the bf16 rate


def test_unknown_profile_lists_known():
    with pytest.raises(ConfigError) as ei:
        hw.load_profile("mi999x-8")
    msg = str(ei.value)
    assert "\n" not in msg and "mi999x-8" in msg
    for n in EXPECTED:
        assert n in msg


def test_malformed_profile_names_missing_field():
    with pytest.raises(ConfigError, match="device.arch"):
        hw.parse_profile({"backend": "rocm", "device": {"name": "x"}, "memory": {}, "peak_flops": {},
                          "link": {}, "parallel": {}}, "broken", "broken.toml")


def test_detect_on_this_machine():
    d = hw.detect()
    assert d.backend in ("rocm", "cuda", "cpu")
    assert d.torch_version == torch.__version__
    if torch.version.hip:
        assert d.torch_build.startswith("ROCm")
    if not torch.cuda.is_available():
        assert d.backend == "cpu" and d.devices == [] and d.arch is None
        assert hw.match_profile(d).name == "cpu"
    dd = d.to_dict()
    assert dd["count"] == d.count and isinstance(dd["env"], dict)


def test_relevant_env_filters():
    env = {"HIP_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO", "RCCL_MSCCL_ENABLE": "0", "TRITON_INTERPRET": "1",
           "HSA_XNACK": "0", "PYTORCH_TUNABLEOP_ENABLED": "1", "CUDA_VISIBLE_DEVICES": "3", "HOME": "/root",
           "PATH": "/bin", "SECRET_TOKEN": "x"}
    got = hw.relevant_env(env)
    assert set(got) == {"HIP_VISIBLE_DEVICES", "NCCL_DEBUG", "RCCL_MSCCL_ENABLE", "TRITON_INTERPRET", "HSA_XNACK",
                        "PYTORCH_TUNABLEOP_ENABLED", "CUDA_VISIBLE_DEVICES"}


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
    assert hw.match_profile(d).name == "mi355x-8"
    # fewer visible devices -> the largest profile not above the count, same arch
    _fake_torch(monkeypatch, "7.0.1", None, props[:1])
    assert hw.match_profile(hw.detect(with_smi=False)).arch == "gfx950"
    props3 = [_FakeProps(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", major=9, minor=4,
                         total_memory=192 * 2**30, multi_processor_count=304) for _ in range(8)]
    _fake_torch(monkeypatch, "6.4.0", None, props3)
    assert hw.match_profile(hw.detect(with_smi=False)).name == "mi300x-8"


def test_detect_cuda_arch_from_capability(monkeypatch):
    props = [_FakeProps(name="NVIDIA H200", major=9, minor=0, total_memory=150 * 10**9, multi_processor_count=132)]
    _fake_torch(monkeypatch, None, "13.0", props)
    d = hw.detect(with_smi=False)
    assert d.backend == "cuda" and d.arch == "sm_90" and d.torch_build == "CUDA 13.0"
    assert hw.match_profile(d).name == "h200-1"
    props8 = props * 8
    _fake_torch(monkeypatch, None, "13.0", props8)
    assert hw.match_profile(hw.detect(with_smi=False)).name == "h200-8"


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
