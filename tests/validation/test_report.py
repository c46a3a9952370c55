"""Evidence model, report merging and the JSON / Markdown / HTML renderers (no model runs here)."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from k3rocm.checkpoint.verify import shard_fingerprints
from k3rocm.errors import ConfigError
from k3rocm.validation.evidence import (LEVELS, SCHEMA, Evidence, Report, Stage, atomic_write, check, info,
                                        listed, load_report, reproduction_block)
from k3rocm.validation.render import render_html, render_json, render_markdown, write_report


def _stage(tier: str, ok: bool = True, level: str = "measured") -> Stage:
    st = Stage(tier, started="2026-11-30T00:00:00Z", seconds=1.5, command=f"k3rocm {tier}")
    st.add(check(tier, f"{tier}.metric", 0.5 if ok else 2.0, le=1.0, unit="ms", level=level, detail="d|x"),
           info(tier, f"{tier}.info", [1, 2, 3], level="projected"))
    st.series["curve"] = {"title": "t", "x": [0, 1, 2], "y": {"a": [1e-4, 2e-3, 3e-2], "b": [0.0, 0.0, 0.0]},
                          "xlabel": "layer", "ylabel": "err", "log": True}
    return st


def _repro(cfg_hash: str = "h1", cmd: str = "k3rocm x") -> dict:
    return reproduction_block(command=cmd, checkpoint=None, config_hash=cfg_hash, seed=3,
                              device={"sku": "cpu", "arch": "cpu", "count": 0}, profile="cpu",
                              thresholds={"t.a": 1.0})


def test_level_must_be_known():
    for lv in LEVELS:
        assert Evidence("env", "x", 1, level=lv).level == lv
    with pytest.raises(ConfigError, match="level"):
        Evidence("env", "x", 1, level="guessed")


def test_check_thresholds_and_nonfinite():
    assert check("t", "a", 1.0, le=1.0).passed is True
    assert check("t", "a", 1.0001, le=1.0).passed is False
    assert check("t", "a", 0.9, ge=0.95).passed is False
    assert check("t", "a", [1, 2], eq=[1, 2]).passed is True
    assert check("t", "a", [1, 3], eq=[1, 2]).passed is False
    # NaN / inf never pass a numeric threshold
    assert check("t", "a", float("nan"), le=1.0).passed is False
    assert check("t", "a", float("inf"), ge=0.0).passed is False
    assert info("t", "b", 3).passed is None


def test_stage_status_follows_failures():
    st = Stage("forward")
    st.add(info("forward", "i", 1))
    assert st.status == "passed"
    st.add(check("forward", "c", 5, le=1))
    assert st.status == "failed" and [e.name for e in st.failures] == ["c"]


def test_report_merge_accumulates_and_replaces():
    rep = Report()
    rep.merge_run(_repro(cmd="k3rocm load"), [_stage("env"), _stage("load")])
    rep.merge_run(_repro(cmd="k3rocm bench"), [_stage("bench")])
    rep.merge_run(_repro(cmd="k3rocm validate"), [_stage("env"), _stage("forward")])
    assert list(rep.to_dict()["stages"]) == ["env", "load", "forward", "bench"]  # tier order, bench last
    # a later run of the same tier replaces it; a tier that now fails drops the stale stages after it
    rep.merge_run(_repro(cmd="k3rocm validate"), [_stage("env"), _stage("forward", ok=False)])
    d = rep.to_dict()
    assert d["schema"] == SCHEMA
    assert list(d["stages"]) == ["env", "load", "forward"]
    assert d["stages"]["forward"]["status"] == "failed" and d["status"] == "failed"
    assert [h["command"] for h in d["history"]] == ["k3rocm load", "k3rocm bench", "k3rocm validate",
                                                    "k3rocm validate"]
    assert set(d["reproduction"]["stage_seconds"]) == {"env", "load", "forward"}
    assert d["reproduction"]["command"] == "k3rocm validate"
    assert d["evidence_levels"]["projected"] == 3 and d["evidence_levels"]["measured"] == 3
    # round trip
    back = Report.from_dict(json.loads(render_json(rep)))
    assert back.to_dict()["stages"] == d["stages"]
    with pytest.raises(ConfigError, match="schema"):
        Report.from_dict({"schema": "other/9"})


def test_settings_are_shown_apart_from_evidence_and_carry_no_level():
    """Inputs of a run (a point's load, the profile) are settings: kept through a round trip, rendered in their own
    table in md and html, and neither counted in evidence_levels nor given a level anywhere."""
    from k3rocm.validation.evidence import setting

    st = _stage("bench")
    st.add_settings(setting("bench", "c4.input_len", 64, "tokens", "upper end L"),
                    setting("bench", "c8.input_len", 64, "tokens", "upper end L"),
                    setting("bench", "endpoint.gpus", 8, "GPU", "from --endpoint-gpus"))
    rep = Report()
    rep.merge_run(_repro(), [st])
    d = rep.to_dict()
    assert sum(d["evidence_levels"].values()) == 2  # the two evidence rows of _stage, no setting
    sd = d["stages"]["bench"]["settings"]
    assert [x["name"] for x in sd] == ["c4.input_len", "c8.input_len", "endpoint.gpus"]
    assert all("level" not in x for x in sd) and all(e["name"] != "c4.input_len" for e in d["stages"]["bench"]["evidence"])
    assert Report.from_dict(json.loads(render_json(rep))).to_dict()["stages"] == d["stages"]
    md, page = render_markdown(rep), render_html(rep)
    assert "inputs, not measurements" in md and "| setting | unit | c=4 | c=8 |" in md and "| input_len | tokens | 64 | 64 |" in md
    assert "| endpoint.gpus | 8 | GPU | from --endpoint-gpus |" in md
    assert "<th>setting</th><th>unit</th><th>c=4</th><th>c=8</th>" in page and "<td>endpoint.gpus</td>" in page
    # and the measured per-point table does not list them
    assert "| field | unit | level |" not in md  # _stage has no per-point evidence rows


def test_every_plot_carries_its_level_and_a_mixed_plot_names_it_per_series():
    """A plot's level is recorded per series in report.json and shown under it in the HTML as a badge (the rows'
    colours); where series differ (planned vs loaded) the caption and the legend name each series' level."""
    st = _stage("load")
    st.series["bytes"] = {"title": "planned vs loaded", "kind": "bar", "x": [0, 1], "xlabel": "rank", "ylabel": "MB",
                          "y": {"planned": [1.0, 2.0], "loaded": [1.0, 2.0]},
                          "levels": {"planned": "projected", "loaded": "measured"}}
    st.series["one"] = {"title": "one level", "x": [0, 1], "y": {"max |h|": [1.0, 2.0]}, "levels": {"max |h|": "measured"}}
    rep = Report()
    rep.merge_run(_repro(), [st])
    d = json.loads(render_json(rep))["stages"]["load"]["series"]
    assert d["bytes"]["levels"] == {"planned": "projected", "loaded": "measured"} and d["one"]["levels"] == {"max |h|": "measured"}
    page = render_html(rep)
    caps = re.findall(r'<p class="caption">(.*?)</p>', page)
    assert len(caps) == 3  # curve (no levels recorded), bytes, one: every plot has a caption
    assert caps[0] == "level: not recorded"
    assert caps[1].startswith("levels per series: planned <span class=\"badge\"") and ">projected<" in caps[1] \
        and "loaded <span" in caps[1] and ">measured<" in caps[1]
    assert caps[2].startswith("level <span") and ">measured<" in caps[2]
    assert "planned (projected)" in page and "loaded (measured)" in page  # the legend of the mixed plot
    assert "max |h| (measured)" not in page  # a plot of one level keeps its plain legend
    md = render_markdown(rep)
    assert "- bytes (planned vs loaded): levels: planned projected; loaded measured" in md
    assert "- one (one level): level: measured" in md


def test_load_report_merges_only_same_checkpoint(tmp_path):
    rep = Report()
    rep.merge_run(_repro("hashA"), [_stage("env")])
    write_report(rep, tmp_path)
    same = load_report(tmp_path, "hashA")
    assert list(same.stages) == ["env"]
    other = load_report(tmp_path, "hashB")  # another checkpoint: start fresh, keep the old one
    assert other.stages == {}
    kept = [json.loads(f.read_text()) for f in tmp_path.glob("report.previous-*.json")]
    assert len(kept) == 1 and kept[0]["reproduction"]["config_hash"] == "hashA"
    assert list(kept[0]["stages"]) == ["env"]
    (tmp_path / "report.json").write_text("{not json")
    assert load_report(tmp_path, "hashA").stages == {}
    texts = sorted(f.read_text() for f in tmp_path.glob("report.previous-*.json"))
    assert len(texts) == 2 and "{not json" in texts  # the earlier kept report is still there


def test_same_config_other_checkpoint_is_not_merged(tmp_path):
    rep = Report()
    r = _repro("hashA")
    r["checkpoint"] = "/models/one"
    rep.merge_run(r, [_stage("env")])
    write_report(rep, tmp_path)
    assert list(load_report(tmp_path, "hashA", "/models/one").stages) == ["env"]
    assert load_report(tmp_path, "hashA", "/models/two").stages == {}


def test_a_report_for_another_profile_is_set_aside(tmp_path):
    """Evidence levels and roofline ceilings were decided against the profile of the run: a report for
    mi355x-8 is not merged into one for cpu (it is kept as report.previous-*.json)."""
    rep = Report()
    r = _repro("hashA")
    r["checkpoint"], r["profile"] = "/models/one", "cpu"
    rep.merge_run(r, [_stage("env"), _stage("load")])
    write_report(rep, tmp_path)
    assert list(load_report(tmp_path, "hashA", "/models/one", "cpu").stages) == ["env", "load"]
    assert load_report(tmp_path, "hashA", "/models/one", "mi355x-8").stages == {}
    assert list(tmp_path.glob("report.previous-*.json"))


def test_a_failing_tier_drops_the_stale_stages_after_it():
    rep = Report()
    rep.merge_run(_repro("h"), [_stage(t) for t in ("env", "load", "forward", "correctness")])
    bad = _stage("load")
    bad.status = "error"
    rep.merge_run(_repro("h"), [_stage("env"), bad])
    assert list(rep.stages) == ["env", "load"] and rep.stages["load"].status == "error"


def test_reproduction_block_contents(tmp_path, golden_ckpt, monkeypatch):
    monkeypatch.delenv("K3ROCM_SOURCE_COMMIT", raising=False)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("UNRELATED_VAR", "x")
    b = reproduction_block(command="k3rocm validate", checkpoint=str(golden_ckpt), config_hash="c", seed=11)
    sw = b["software"]
    for k in ("python", "torch", "torch_build", "triton", "aiter", "k3rocm", "git_sha"):
        assert k in sw
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", sw["git_sha"])
    assert b["env"].get("HIP_VISIBLE_DEVICES") == "0,1" and "UNRELATED_VAR" not in b["env"]
    assert b["seeds"] == {"seed": 11}
    shards = b["shards"]
    assert [s["file"] for s in shards] == sorted(p.name for p in golden_ckpt.glob("*.safetensors"))
    for s in shards:
        assert s["bytes"] == (golden_ckpt / s["file"]).stat().st_size and len(s["header_sha256"]) == 64
    # header hash changes when a header byte changes
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(golden_ckpt, d)
    p = d / shards[0]["file"]
    os.chmod(p, 0o644)
    raw = bytearray(p.read_bytes())
    raw[20] ^= 0x01
    p.write_bytes(bytes(raw))
    assert shard_fingerprints(d)[0]["header_sha256"] != shards[0]["header_sha256"]


def test_renderers(tmp_path):
    rep = Report()
    st = _stage("correctness", level="external")
    st.add(Evidence("correctness", "nan.value", float("nan"), passed=None))
    rep.merge_run(_repro(), [_stage("env"), st, _stage("bench", ok=False)])
    paths = write_report(rep, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.json", "report.md"]
    doc = json.loads(paths["json"].read_text())  # valid JSON even with NaN inside
    assert doc["stages"]["correctness"]["evidence"][-1]["value"] == "nan"
    md = paths["md"].read_text()
    assert "| correctness.metric | 0.5 | ms | <= 1 | pass | `external` | d\\|x |" in md
    assert "FAIL" in md and "FAILED" in md
    html = paths["html"].read_text()
    assert html.count("<svg") == 3  # one plot per stage series
    # self-contained: nothing fetched from elsewhere
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)
    assert "@import" not in html and not re.search(r"url\((?!#)", html)  # only in-document references
    # every evidence row carries its level as a badge
    rows = sum(len(s.evidence) for s in rep.stages.values())
    badges = re.findall(r'<td><span class="badge"[^>]*>(measured|measured-fallback|projected|external)</span></td>',
                        html)
    assert len(badges) == rows
    assert render_markdown(rep).startswith("# k3rocm report")


def test_html_survives_odd_series():
    rep = Report()
    st = Stage("forward")
    st.series["empty"] = {"x": [], "y": {}}
    st.series["zeros"] = {"x": [0, 1], "y": {"z": [0.0, 0.0]}, "log": True}
    st.series["bars"] = {"x": [1, 8], "y": {"p50": [1.0, 2.0], "p99": [3.0, math.inf]}, "kind": "bar"}
    rep.put(st)
    html = render_html(rep)
    assert html.count("<svg") == 2 and "<script" not in html


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    p = tmp_path / "report.json"
    atomic_write(p, "old")

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write(p, "new")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["report.json"]  # no temp file left behind


def test_html_without_matplotlib_still_renders(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rep = Report()
    rep.put(_stage("forward"))
    html = render_html(rep)
    assert "<svg" not in html and "plot curve omitted: matplotlib is not installed" in html
    assert "forward.metric" in html


@pytest.mark.parametrize("text", ['[]', '{"schema": "k3rocm.report/1", "stages": []}',
                                  '{"schema": "k3rocm.report/1", "stages": {}, "reproduction": []}'])
def test_load_report_sets_aside_any_malformed_structure(tmp_path, text):
    """Valid JSON of the wrong shape starts a fresh report and keeps the file, like unparsable text does."""
    (tmp_path / "report.json").write_text(text)
    assert load_report(tmp_path, "hashA").stages == {}
    kept = [f.read_text() for f in tmp_path.glob("report.previous-*.json")]
    assert kept == [text]


def test_html_plots_have_unique_ids(tmp_path):
    """Several inline SVG figures in one page: every id is unique and every internal reference resolves."""
    import re

    from k3rocm.validation.render import render_html
    rep = Report()
    st = _stage("forward")
    st.series = {f"s{k}": {"title": f"t{k}", "x": [0, 1, 2], "y": {"a": [1.0, 2.0, 3.0]}, "xlabel": "x",
                           "ylabel": "y"} for k in range(3)}
    rep.merge_run(_repro(), [st])
    html = render_html(rep)
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert html.count("<svg") == 3 and len(ids) == len(set(ids))
    refs = re.findall(r'url\(#([^)]+)\)', html) + re.findall(r'href="#([^"]+)"', html)
    assert set(refs) <= set(ids)


@pytest.mark.parametrize("value,want", [("ABCDEF1", "abcdef1"), ("0" * 40 + "-DIRTY", "0" * 40 + "-dirty"),
                                        ("", None)])
def test_declared_source_commit(monkeypatch, value, want):
    """A copied tree declares its commit; the report marks it as declared, and names git's answer where git has
    another one. Unset or empty: the git answer as before."""
    import k3rocm.validation.evidence as EV
    monkeypatch.setenv("K3ROCM_SOURCE_COMMIT", value)
    got = EV.git_sha()
    if want is None:
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", got)
    else:
        assert re.fullmatch(re.escape(want) + r" \(declared(; git says [0-9a-f]{40}(-dirty)?)?\)", got), got
        monkeypatch.setattr(EV, "_git_head", lambda: "unknown")  # a copy without git metadata
        assert EV.git_sha() == f"{want} (declared)"
        monkeypatch.setattr(EV, "_git_head", lambda: "1" * 40)
        assert EV.git_sha() == f"{want} (declared; git says {'1' * 40})"
        monkeypatch.setattr(EV, "_git_head", lambda: want)  # the same commit: git's answer alone
        assert EV.git_sha() == want
    monkeypatch.setenv("K3ROCM_SOURCE_COMMIT", "xyz")
    with pytest.raises(ConfigError, match="K3ROCM_SOURCE_COMMIT"):
        EV.git_sha()


def test_a_failed_or_interrupted_run_keeps_the_passed_stage_it_replaces(tmp_path, capsys):
    """An interrupted bench (or any stage that did not pass) replacing a passed one in the same --out keeps the
    previous report as report.previous-*.json with a note; a passing rerun replaces it with no copy."""
    from k3rocm.validation.render import update_report
    update_report(tmp_path, _repro("h"), [_stage("env"), _stage("bench")], config_hash="h")
    good = json.loads((tmp_path / "report.json").read_text())
    bad = _stage("bench")
    bad.status = "error"
    update_report(tmp_path, _repro("h"), [bad], config_hash="h")
    kept = sorted(tmp_path.glob("report.previous-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == good
    assert "bench stage did not pass" in capsys.readouterr().err
    assert json.loads((tmp_path / "report.json").read_text())["stages"]["bench"]["status"] == "error"
    update_report(tmp_path, _repro("h"), [_stage("bench")], config_hash="h")  # error -> passed: nothing to keep
    assert len(list(tmp_path.glob("report.previous-*.json"))) == 1


def test_html_header_names_checkpoint_profile_device_and_commit():
    # the HTML says what the Markdown header says: what was run, on what, from which source
    rep = Report()
    rep.merge_run(_repro("h"), [_stage("env")])
    page = render_html(rep)
    sw = rep.reproduction["software"]
    assert "config sha256" in page and "profile <code>cpu</code>" in page and "device cpu" in page
    assert f"@ <code>{sw['git_sha']}</code>" in page
    # a package that is not installed reads "absent" in both headers, as in the env table (not "None")
    sw["aiter"] = None
    assert "aiter absent" in render_html(rep) and "aiter absent" in render_markdown(rep)
    assert "aiter None" not in render_html(rep) + render_markdown(rep)


def test_random_weights_and_fallback_warnings_head_both_renderings():
    # the console's last lines (synthetic weights; nothing ran on the profile's hardware) head the written report
    # too, in Markdown and HTML, escaped; a report without them has neither line
    rep = Report()
    rep.merge_run(_repro("h"), [_stage("env")])
    assert "RANDOM" not in render_markdown(rep) + render_html(rep)
    assert "nothing ran" not in render_markdown(rep) + render_html(rep)
    r = dict(_repro("h"), synthetic={"note": "WARNING: RANDOM WEIGHTS <x>", "preset": "k3-tiny"},
             fallback_note="note: nothing ran on mi355x-8's hardware (8 x MI355X)")
    rep = Report()
    rep.merge_run(r, [_stage("env")])
    md, page = render_markdown(rep), render_html(rep)
    head = md.split("| stage |")[0]
    assert "- **WARNING: RANDOM WEIGHTS <x>**" in head and "- **note: nothing ran on mi355x-8's hardware" in head
    assert "<li><strong>WARNING: RANDOM WEIGHTS &lt;x&gt;</strong></li>" in page
    assert "nothing ran on mi355x-8&#x27;s hardware" in page


def test_out_that_is_a_dangling_link_or_loop_is_one_clear_line(tmp_path):
    from k3rocm.validation.session import require_dir_for_output
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    gone = tmp_path / "gone"
    gone.symlink_to(tmp_path / "nowhere")
    for p in (loop, gone):
        with pytest.raises(ConfigError, match="symbolic link that leads nowhere"):
            require_dir_for_output(p)


def test_figure_kind_names_detected_figures():
    from types import SimpleNamespace

    from k3rocm.validation.tiers.env import figure_kind
    kinds = [figure_kind(SimpleNamespace(sources={"m": src}), "m")
             for src in ("detected: this machine's memory", "assumption: 16 GiB", "AMD datasheet", "")]
    assert kinds == ["detected", "assumed", "datasheet", "datasheet"]


@pytest.mark.parametrize("sig,exc", [("SIGINT", KeyboardInterrupt), ("SIGTERM", "Terminated")])
def test_a_signal_while_the_report_is_written_waits_for_the_write(tmp_path, monkeypatch, sig, exc):
    # Ctrl-C / SIGTERM landing while the report is written: every file is written, then the signal takes effect
    # (it used to cut the atomic writes and leave only the lock file); the handlers are restored afterwards
    import os
    import signal

    from k3rocm.errors import Terminated
    import k3rocm.validation.render as R

    exc = Terminated if exc == "Terminated" else exc
    real = R.write_report
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def write_with_a_signal(rep, out):
        os.kill(os.getpid(), getattr(signal, sig))  # delivered now: held until the write is done
        return real(rep, out)

    monkeypatch.setattr(R, "write_report", write_with_a_signal)
    with pytest.raises(exc):
        R.update_report(tmp_path, _repro("h"), [_stage("bench")], config_hash="h")
    for name in ("report.json", "report.md", "report.html"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "report.json").read_text())["stages"]
    assert {s: signal.getsignal(s) for s in before} == before


def test_listed_shortens_the_list_not_the_items():
    """A long detail lists whole items and counts the rest, so each shown item keeps its remedy at the end."""
    items = [f"rank 0: tensor.{i}.weight holds 128 NaN/Inf values; the file is corrupt: re-download it" for i in range(9)]
    s = listed(items, limit=200)
    assert s == "; ".join(items[:2]) + "; … and 7 more" and s.count("re-download it") == 2
    assert listed(items[:1], limit=10) == items[0][:9] + "…"  # one item over the limit: the only cut
    assert listed([]) == "" and listed(["a", "b"], ", ") == "a, b"


def test_the_failure_line_shows_a_listed_detail_whole(tmp_path, capsys):
    """The one error line of a failed tier shows the failure's detail up to WHY_MAX without cutting it."""
    from k3rocm.cli.common import WHY_MAX, finish
    detail = listed([f"rank 0: t{i} holds 1 NaN/Inf values (s.safetensors); the file is corrupt: re-download or "
                     f"re-make it" for i in range(20)])
    assert 200 < len(detail) <= WHY_MAX
    st = _stage("load", ok=False)
    st.evidence[0].detail = detail
    with pytest.raises(SystemExit) as e:
        finish([st], tmp_path / "report.html")
    line = capsys.readouterr().err.strip()
    assert e.value.code == 1 and f"— {detail}; see {tmp_path / 'report.html'}" in line, line
    st.evidence[0].detail = "word " * 200
    with pytest.raises(SystemExit):
        finish([st], tmp_path / "report.html")
    line = capsys.readouterr().err.strip()
    shown = line.split(" — ", 1)[1].split("; see ", 1)[0]
    assert shown.endswith("word … (the rest in the report)") and len(shown) <= WHY_MAX + 30, line


def test_per_point_tables_label_each_row_with_its_level():
    # the bench's per-concurrency table puts measured and projected figures side by side: every row says which
    rep = Report()
    st = Stage("bench")
    for c in (1, 8):
        st.add(info("bench", f"c{c}.output_throughput", 10.0 * c, "tok/s", level="measured-fallback"),
               info("bench", f"c{c}.roofline.fraction", 0.5, "", level="projected"))
    st.add(info("bench", "c8.median_tpot_ms", 3.0, "ms", level="measured"))
    rep.put(st)
    md = render_markdown(rep)
    assert "| field | unit | level | c=1 | c=8 |" in md
    assert "| output_throughput | tok/s | measured-fallback | 10.0 | 80.0 |" in md
    assert "| roofline.fraction |  | projected | 0.5 | 0.5 |" in md
    assert "| median_tpot_ms | ms | measured |  | 3.00 |" in md
    html = render_html(rep)
    assert "<th>level</th><th>c=1</th>" in html and "<td>projected</td>" in html


def test_point_table_rows_keep_each_points_order_and_unit():
    """A field first seen at a later point sits after the field before it there, not after every row of the first
    point, and a row that opens without a figure ("not formed", no unit) takes its unit from a later point (the
    c=1 mixed-step breakdown used to sit above the decode rows with no unit, and the other mixed rows below the
    roofline rows)."""
    from k3rocm.validation.render import point_table
    st = Stage("bench")
    st.add(info("bench", "c1.output_throughput", 1.0, "tok/s"), info("bench", "c1.breakdown.decode.wall_ms", 2.0, "ms"),
           info("bench", "c1.breakdown.mixed.wall_ms", "not formed"), info("bench", "c1.roofline.fraction", 0.1, ""))
    st.add(info("bench", "c2.output_throughput", 2.0, "tok/s"), info("bench", "c2.breakdown.decode.wall_ms", 3.0, "ms"),
           info("bench", "c2.breakdown.mixed.wall_ms", 9.0, "ms"), info("bench", "c2.breakdown.mixed.KDA", 4.0, "ms"),
           info("bench", "c2.roofline.fraction", 0.2, ""))
    concs, rows = point_table(st)
    assert concs == [1, 2]
    assert [f for f, _, _ in rows] == ["output_throughput", "breakdown.decode.wall_ms", "breakdown.mixed.wall_ms",
                                       "breakdown.mixed.KDA", "roofline.fraction"]
    assert dict((f, u) for f, u, _ in rows)["breakdown.mixed.wall_ms"] == "ms"
    assert rows[2][2] == {1: "not formed", 2: 9.0}


def _bench_stage(concs: list[int]) -> Stage:
    """A bench stage with the series the performance tier writes (tiers/performance.py bench_rows), at ``concs``."""
    st = Stage("bench", started="2026-11-30T00:00:00Z", seconds=1.0, command="k3rocm bench")
    for c in concs:
        st.add(info("bench", f"c{c}.output_throughput", 10.0 * c, "tok/s"))
    n = len(concs)
    st.series["latency"] = {"title": "latency percentiles vs concurrency", "kind": "bar", "x": concs,
                            "xlabel": "concurrency", "ylabel": "ms", "log": True,
                            "y": {"median TTFT": [1.0] * n, "p99 TTFT": [2.0] * n}}
    st.series["throughput"] = {"title": "throughput vs concurrency", "kind": "bar", "x": concs,
                               "xlabel": "concurrency", "ylabel": "tok/s", "y": {"output_throughput": [5.0] * n}}
    st.series["tradeoff"] = {"title": "throughput per GPU vs speed per user (labels: concurrency)", "kind": "line",
                             "x": [100.0 / c for c in concs], "xlabel": "tok/s/user", "ylabel": "output tok/s/GPU",
                             "y": {"output tok/s/GPU": [10.0 * c for c in concs]}, "labels": [f"c={c}" for c in concs]}
    bars = [f"c{c} {k}" for c in concs for k in ("decode", "mixed")]
    st.series["breakdown"] = {"title": "where a step goes", "kind": "stacked", "x": bars, "xlabel": "step",
                              "ylabel": "ms", "y": {f: [1.0] * len(bars) for f in ("MLA", "MoE", "KDA", "other")}}
    return st


def test_one_concurrency_writes_a_sentence_instead_of_the_vs_concurrency_charts():
    """One concurrency: a chart against concurrency is one bar or one point, which shows nothing; the report writes
    one sentence in its place (HTML and Markdown) and keeps the step breakdown, which still says something."""
    rep = Report()
    rep.merge_run(_repro(), [_bench_stage([8])])
    page = render_html(rep)
    assert page.count("<svg") == 1  # the breakdown only
    assert "throughput vs concurrency" not in page.split("<p class=\"note\">")[0]
    note = re.findall(r'<p class="note">(.*?)</p>', page)
    assert len(note) == 1 and "two or more concurrency levels" in note[0] and "--concurrency 1,8,64" in note[0]
    assert "latency percentiles vs concurrency" in note[0] and "speed per user" in note[0]
    md = render_markdown(rep)
    assert "two or more concurrency levels (e.g. --concurrency 1,8,64)" in md
    assert "- breakdown (where a step goes)" in md and "- latency (" not in md and "- tradeoff (" not in md
    rep = Report()
    rep.merge_run(_repro(), [_bench_stage([1, 8])])  # two points: every chart is drawn, no sentence
    page = render_html(rep)
    assert page.count("<svg") == 4 and "two or more concurrency levels" not in page
    assert "two or more concurrency levels" not in render_markdown(rep)


def test_a_legend_sits_outside_the_axes(monkeypatch):
    """The step breakdown's legend used to cover its "mixed" bar: every legend is drawn right of the axes."""
    import k3rocm.validation.render as render

    boxes = []
    real = render._svg

    def spy(fig):
        fig.canvas.draw()
        ax = fig.axes[0]
        leg = ax.get_legend()
        boxes.append((ax.get_window_extent(), leg.get_window_extent() if leg else None))
        return real(fig)
    monkeypatch.setattr(render, "_svg", spy)
    spec = _bench_stage([1, 8]).series["breakdown"]
    assert "<svg" in render._series_svg("breakdown", spec)
    (axes, legend), = boxes
    assert legend is not None and legend.x0 >= axes.x1  # wholly to the right: no bar is covered


def test_figures_keep_their_units_precision_and_never_show_a_false_zero():
    from k3rocm.validation.render import fmt_value

    assert fmt_value(1234.56, "tok/s") == "1,234.6" and fmt_value(3.14159, "ms") == "3.14"
    assert fmt_value(2.0, "s") == "2.000" and fmt_value(7, "tokens") == "7" and fmt_value(True) == "yes"
    # below the unit's last decimal: three significant digits, not 0.0 (a CPU run's 0.0169 tok/s/GPU)
    assert fmt_value(0.0169, "tok/s/GPU") == "0.0169" and fmt_value(0.0004, "ms") == "0.0004"
    assert fmt_value(0.0, "tok/s") == "0.0"  # a true zero stays in the unit's form
