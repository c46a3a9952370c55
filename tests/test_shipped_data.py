"""The reference data the tests use ships in the repository (tests/data), byte for byte as its README lists."""

from __future__ import annotations

import hashlib
import re

from tests.helpers import DATA, DEFAULT_GOLDEN, OFFICIAL_CONFIG, REPO


def test_the_golden_set_and_the_official_config_ship_with_the_clone():
    assert DEFAULT_GOLDEN.is_relative_to(REPO) and OFFICIAL_CONFIG.is_relative_to(REPO)
    rows = re.findall(r"^\| `([^`]+)` \| ([\d,]+) \| `([0-9a-f]{64})` \|$", (DATA / "README.md").read_text(), re.M)
    listed = {name for name, _, _ in rows}
    assert {"k3-tiny-golden/golden.safetensors", "k3-tiny-golden/checkpoint/config.json", "kimi-k3/config.json"} <= listed
    for name, size, digest in rows:
        p = DATA / name
        assert p.stat().st_size == int(size.replace(",", "")), name
        assert hashlib.sha256(p.read_bytes()).hexdigest() == digest, name
    on_disk = {str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file() and p.name != "README.md" or
               p.is_file() and p.parent != DATA and p.name == "README.md"}
    assert on_disk == listed  # nothing unlisted, nothing missing
