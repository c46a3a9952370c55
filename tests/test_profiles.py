"""Hardware profiles: the shipped CPU profile describes this machine's memory, not an assumed 16 GiB."""

from __future__ import annotations

import os

from k3rocm.profiles import host_memory_bytes, load_profile


def test_the_cpu_profile_has_this_machines_memory_and_says_so():
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert host_memory_bytes() == host
    p = load_profile("cpu")
    assert p.memory_bytes == host
    assert p.sources["device.memory_source"].startswith("detected: this machine's physical memory")
    assert load_profile("mi355x-8").memory_bytes != host  # a GPU profile keeps its datasheet figure


def test_a_copied_cpu_profile_keeps_the_memory_it_was_given(tmp_path):
    # a copy of cpu.toml whose memory_bytes was edited (its "assumption" source line left as it was) keeps the
    # edited figure; the unedited copy still takes this machine's memory, as the shipped profile does
    from k3rocm.profiles import _profile_dir

    text = _profile_dir().joinpath("cpu.toml").read_text()
    same = tmp_path / "same.toml"
    same.write_text(text)
    assert load_profile(str(same)).memory_bytes == host_memory_bytes()
    small = tmp_path / "small.toml"
    small.write_text(text.replace("memory_bytes = 17179869184", "memory_bytes = 1000000000"))
    assert "memory_bytes = 1000000000" in small.read_text()
    p = load_profile(str(small))
    assert p.memory_bytes == 1_000_000_000 and p.sources["device.memory_source"].startswith("assumption")
