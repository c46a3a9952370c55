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
