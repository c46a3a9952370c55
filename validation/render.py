"""Report renderers: ``report.json``, ``report.md`` and a self-contained ``report.html``.

The HTML has no external references: CSS is inline and plots are inline SVG drawn with matplotlib
(Agg backend, text kept as ``<text>`` so the files stay small). Plots are drawn from each stage's
``series`` (see :class:`k3rocm.validation.evidence.Stage`): per-layer error vs the oracle
(correctness), per-layer activation max |h| (forward), latency percentiles and throughput (bench /
performance). Every evidence row shows its level of proof as a coloured badge.
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
from pathlib import Path

from k3rocm.errors import K3Error, Terminated, os_error
from k3rocm.validation.evidence import (LEVELS, Report, Stage, atomic_write_set, keep_previous, load_report,
                                        replaced_passing_stages, report_lock)

LEVEL_COLORS = {"measured": "#1a7f37", "measured-fallback": "#9a6700", "projected": "#0969da",
                "external": "#8250df"}
STATUS_COLORS = {"passed": "#1a7f37", "failed": "#cf222e", "error": "#cf222e", "skipped": "#6e7781"}


def render_json(rep: Report) -> str:
    """The report document (schema ``k3rocm.report/1``) as indented JSON."""
    return json.dumps(rep.to_dict(), indent=2, sort_keys=False) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list):
        s = ", ".join(_fmt(x) for x in v[:8])
        return f"[{s}{', ...' if len(v) > 8 else ''}]"
    return str(v)


_POINT = re.compile(r"c(\d+)\.(.+)")


def point_table(stage: Stage, rows=None) -> tuple[list[int], list[tuple[str, str, dict[int, object]]]]:
    """A benchmark stage's per-point rows (``c<N>.<field>``) as one table, grouped per concurrency point.

    ``rows``: the rows to table (default the stage's evidence; its :attr:`Stage.settings` for the point settings).

    Returns:
        ``(concurrencies, rows)``: the points in the order they ran, and ``(field, unit, {concurrency: value})``
        per field in the order the rows first appear (vLLM's result order, see
        :data:`k3rocm.validation.tiers.performance.POINT_FIELDS`). Empty lists when the stage has no such rows.
    """
    concs: list[int] = []
    units: dict[str, str] = {}
    vals: dict[str, dict[int, object]] = {}
    order: list[str] = []  # fields merged over the points: a field first seen at a later point goes after the
    prev: dict[int, str | None] = {}  # field before it in that point (c=1 forms no mixed step, c=2 does)
    for e in (stage.evidence if rows is None else rows):
        m = _POINT.fullmatch(e.name)
        if not m:
            continue
        c, f = int(m.group(1)), m.group(2)
        if c not in concs:
            concs.append(c)
        if f not in vals:
            before = prev.get(c)
            order.insert(order.index(before) + 1 if before in order else len(order) if before else 0, f)
        prev[c] = f
        vals.setdefault(f, {})[c] = e.value
        if e.unit and not units.get(f):  # a row without a figure ("not formed") may come first
            units[f] = e.unit
    return concs, [(f, units.get(f, ""), vals[f]) for f in order]


def point_levels(stage: Stage) -> dict[str, str]:
    """Evidence level of each per-point field of :func:`point_table` (``measured``, ``measured-fallback``,
    ``projected``, ...; the levels of its points joined with "/" where they differ), so a table that puts
    measured and projected figures side by side labels every row."""
    seen: dict[str, list[str]] = {}
    for e in stage.evidence:
        m = _POINT.fullmatch(e.name)
        if m and e.level not in seen.setdefault(m.group(2), []):
            seen[m.group(2)].append(e.level)
    return {f: "/".join(v) for f, v in seen.items()}


#: the heading of a stage's settings in every format: they are inputs, so they carry no level of proof
SETTINGS_TITLE = "Settings of the run (inputs, not measurements: no level of proof)"


def stage_settings(stage: Stage) -> tuple[list, list[int], list[tuple[str, str, dict[int, object]]]]:
    """A stage's settings split for display: ``(others, concurrencies, point rows)``: the settings that are not
    per benchmark point (e.g. ``profile``), then the per-point ones (``c<N>.input_len``, ...) as
    :func:`point_table` rows. Raises nothing."""
    others = [x for x in stage.settings if not _POINT.fullmatch(x.name)]
    concs, rows = point_table(stage, stage.settings)
    return others, concs, rows


def fmt_value(v, unit: str = "") -> str:
    """A figure at a precision that fits its unit: ms 2 decimals, tok/s 1, s and req/s 3 (a nonzero figure below
    the unit's last decimal: 3 significant digits, never a false 0.0), counts with thousands separators, booleans
    as yes/no, other floats 4 significant digits."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        fixed = {"ms": 2, "s": 3, "req/s": 3}.get(unit, 1 if unit.startswith("tok/s") else None)
        if fixed is None:
            return f"{v:.4g}"
        if v and abs(v) < 10 ** -fixed:  # too small for the unit's decimals (0.0169 tok/s is not 0.0): 3 digits
            return f"{v:.3g}"
        return f"{v:,.{fixed}f}"
    return _fmt(v)


def _passed_mark(p) -> str:
    return "" if p is None else ("pass" if p else "FAIL")


def render_markdown(rep: Report) -> str:
    """A Markdown summary: status, reproduction essentials, one table of evidence per stage."""
    d = rep.to_dict()
    r = d["reproduction"]
    sw = r.get("software", {})
    dev = r.get("device", {})
    lines = [f"# k3rocm report — {d['status'].upper()}", "",
             f"- schema `{d['schema']}`, updated {d['updated']}",
             f"- command: `{r.get('command', '')}`",
             f"- checkpoint: `{r.get('checkpoint')}` (config sha256 `{str(r.get('config_hash'))[:16]}`)",
             f"- profile: `{r.get('profile')}`; kernels: `{r.get('kernels')}`",
             f"- device: {dev.get('sku', '?')} × {dev.get('count', '?')} ({dev.get('arch', '?')}, "
             f"backend {dev.get('backend', '?')})" + (" — the machine that sent the load" if r.get("endpoint") else ""),
             *([f"- benchmarked server: {r['endpoint'].get('url')} ({r['endpoint'].get('gpus')} GPUs, "
                f"{r['endpoint'].get('gpus_source')}){_timeout_text(r['endpoint'])}; the checkpoint above only gave "
                "the prompts' vocabulary"]
               if isinstance(r.get("endpoint"), dict) else []),
             *[f"- **{n}**" for n in _header_notes(r)],
             f"- k3rocm {sw.get('k3rocm')} @ {sw.get('git_sha')}; torch {sw.get('torch')} ({sw.get('torch_build')}),"
             f" triton {sw.get('triton')}, aiter {sw.get('aiter') or 'absent'}",
             "- evidence levels: " + ", ".join(f"{k} {v}" for k, v in d["evidence_levels"].items()), ""]
    lines += ["| stage | status | seconds | rows | failures |", "|---|---|---:|---:|---:|"]
    for s in rep.ordered():
        lines.append(f"| {s.tier} | {s.status} | {s.seconds:.2f} | {len(s.evidence)} | {len(s.failures)} |")
    for s in rep.ordered():
        lines += ["", f"## {s.tier} — {s.status} ({s.seconds:.2f} s)", ""]
        if s.error:
            lines += [f"> error: {s.error}", ""]
        if s.command:
            lines += [f"`{s.command}`", ""]
        others, sconcs, srows = stage_settings(s)
        if others or sconcs:
            lines += [SETTINGS_TITLE + ":", ""]
        if others:
            lines += ["| setting | value | unit | detail |", "|---|---|---|---|"]
            for x in others:
                det = str(x.detail).replace("|", "\\|")
                lines.append(f"| {x.name} | {_fmt(x.value)} | {x.unit} | {det} |")
            lines.append("")
        if sconcs:
            lines += ["| setting | unit | " + " | ".join(f"c={c}" for c in sconcs) + " |",
                      "|---|---|" + "---:|" * len(sconcs)]
            for f, u, vals in srows:
                lines.append(f"| {f} | {u} | " + " | ".join(fmt_value(vals[c], u) if c in vals else ""
                                                           for c in sconcs) + " |")
            lines.append("")
        specs = [(k, v) for k, v in (s.series or {}).items() if has_points(v)]
        plots = [(k, v) for k, v in specs if not single_concurrency(v)]
        if plots:
            lines += ["Plots (drawn in report.html), with the level of their series:", ""]
            lines += [f"- {k} ({v.get('title', k)}): {plot_level_text(v)}" for k, v in plots]
            lines.append("")
        lone = [v for _, v in specs if single_concurrency(v)]
        if lone:
            lines += [one_concurrency_note(lone), ""]
        concs, prow = point_table(s)
        if concs:
            lv = point_levels(s)
            lines += ["Per concurrency point (vLLM's result fields):", "",
                      "| field | unit | level | " + " | ".join(f"c={c}" for c in concs) + " |",
                      "|---|---|---|" + "---:|" * len(concs)]
            for f, u, vals in prow:
                lines.append(f"| {f} | {u} | {lv.get(f, '')} | " + " | ".join(fmt_value(vals[c], u) if c in vals
                                                                             else "" for c in concs) + " |")
            lines.append("")
        if s.evidence:
            lines += ["| evidence | value | unit | threshold | result | level | detail |",
                      "|---|---|---|---|---|---|---|"]
            for e in s.evidence:
                det = str(e.detail).replace("|", "\\|")
                lines.append(f"| {e.name} | {_fmt(e.value)} | {e.unit} | {e.threshold or ''} | "
                             f"{_passed_mark(e.passed)} | `{e.level}` | {det} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- HTML
_SVG_COUNT = [0]


def _svg(fig) -> str:
    """The figure as an inline ``<svg>`` element whose ids are unique in the page.

    matplotlib names the elements of every figure alike (``figure_1``, ``axes_1``, clip paths); several
    figures inlined in one page would repeat ids (invalid HTML, and a clip path could resolve to another
    figure's), so each figure's ids and references get their own prefix.
    """
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    s = buf.getvalue()
    i = s.find("<svg")
    s = s[i:] if i >= 0 else s
    _SVG_COUNT[0] += 1
    pre = f"f{_SVG_COUNT[0]}-"
    s = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{pre}{m.group(1)}"', s)
    s = re.sub(r'url\(#([^)]+)\)', lambda m: f"url(#{pre}{m.group(1)})", s)
    return re.sub(r'href="#([^"]+)"', lambda m: f'href="#{pre}{m.group(1)}"', s)


def series_levels(spec: dict) -> dict[str, str | None]:
    """The evidence level of each series (y label) of a plot spec, from its ``levels`` (``{label: level}``, written
    by the tiers); None for a label without one (a report written before plots carried levels). Raises nothing."""
    lv = spec.get("levels") if isinstance(spec.get("levels"), dict) else {}
    return {lab: (lv.get(lab) if lv.get(lab) in LEVELS else None) for lab in (spec.get("y") or {})}


def plot_level_text(spec: dict) -> str:
    """The plot's level as one line of text: ``"level: measured"`` when every series has the same level, else
    ``"levels: planned projected; loaded measured"`` (one per series), ``"level: not recorded"`` without any."""
    per = series_levels(spec)
    distinct = set(per.values())
    if distinct == {None} or not per:
        return "level: not recorded"
    if len(distinct) == 1:
        return f"level: {next(iter(distinct))}"
    return "levels: " + "; ".join(f"{lab} {lv or 'not recorded'}" for lab, lv in per.items())


def has_points(spec: dict) -> bool:
    """Whether a series spec has a value to draw (an interrupted sweep can leave labels with empty lists)."""
    return any(len(v or ()) for v in (spec.get("y") or {}).values())


def single_concurrency(spec: dict) -> bool:
    """Whether ``spec`` is a chart against concurrency (x = concurrency, or points labelled ``c=N``) holding fewer
    than two concurrency levels: one bar or one point, which shows no trend; the report writes
    :func:`one_concurrency_note` in its place (the numbers are in the per-point table)."""
    if spec.get("xlabel") == "concurrency":
        n = len({str(v) for v in spec.get("x") or []})
    else:
        labs = [str(v) for v in spec.get("labels") or []]
        if not labs or not all(v.startswith("c=") for v in labs):
            return False
        n = len(set(labs))
    return n < 2


def one_concurrency_note(specs: list[dict]) -> str:
    """The sentence that stands for the charts of :func:`single_concurrency` (one run's concurrency)."""
    titles = "; ".join(re.sub(r"\s*\(.*\)", "", str(v.get("title") or "chart")) for v in specs)
    return (f"Not drawn ({titles}): these charts need two or more concurrency levels (e.g. --concurrency 1,8,64); "
            "this run measured one, whose numbers are in the per-point table.")


def _series_svg(name: str, spec: dict) -> str | None:
    """One line/bar plot from a series spec ``{"x", "y": {label: values}, "xlabel", "ylabel", "log", "kind",
    "levels": {label: level}}`` (``kind``: ``"line"``, ``"bar"`` side by side, or ``"stacked"``: one bar per x with
    the labels stacked). Where the series carry different levels (planned vs loaded bytes), each legend entry names
    its series' level.

    Returns None for an empty series. Without matplotlib (a declared dependency, but a GPU node may run
    a bare environment) the plot becomes a one-line note instead of failing the report."""
    if "MPLCONFIGDIR" not in os.environ and not os.access(os.path.expanduser("~"), os.W_OK):
        # a read-only HOME (service accounts): keep matplotlib's font cache quiet and out of the output
        os.environ["MPLCONFIGDIR"] = tempfile.mkdtemp(prefix="k3rocm-mpl-")
    try:
        # imported only when a plot is drawn: it costs ~1.1 s (measured, matplotlib + pyplot) that no other
        # command needs, MPLCONFIGDIR must be set before it, and without it the plot becomes a note
        import matplotlib
    except ImportError:
        return (f"<p class=\"fail\">plot {html.escape(name)} omitted: matplotlib is not installed "
                "(pip install matplotlib)</p>") if has_points(spec) else None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    plt.rcParams["svg.fonttype"] = "none"
    x = spec.get("x") or []
    ys = spec.get("y") or {}
    if not has_points(spec):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.0), dpi=100)
    kind = spec.get("kind", "line")
    labels = list(ys)
    levels = series_levels(spec)
    mixed = len(set(levels.values())) > 1
    stack: dict = {}
    for j, lab in enumerate(labels):
        shown = f"{lab} ({levels.get(lab) or 'level not recorded'})" if mixed else lab
        vals = [float(v) if isinstance(v, (int, float)) and math.isfinite(v) else float("nan") for v in ys[lab]]
        xs = x if len(x) == len(vals) else list(range(len(vals)))
        if kind == "stacked":  # one bar per x, the labels stacked bottom to top
            bottom = stack.setdefault("b", [0.0] * len(vals))
            ax.bar(range(len(vals)), vals, width=0.6, bottom=bottom, label=shown)
            stack["b"] = [b + (v if v == v else 0.0) for b, v in zip(bottom, vals)]
            ax.set_xticks(range(len(vals)), [str(v) for v in xs])
        elif kind == "bar":
            w = 0.8 / max(1, len(labels))
            pos = [i + j * w for i in range(len(vals))]
            ax.bar(pos, vals, width=w, label=shown)
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(vals))], [str(v) for v in xs])
        else:
            ax.plot(xs, vals, marker="o", markersize=3, label=shown)
            for xv, yv, text in zip(xs, vals, spec.get("labels") or []):
                ax.annotate(str(text), (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=7)
    positive = [float(v) for vals in ys.values() for v in vals
                if isinstance(v, (int, float)) and v == v and v > 0]
    if spec.get("log") and positive:
        ax.set_yscale("log")
    ax.set_title(spec.get("title", name), fontsize=10)
    ax.set_xlabel(spec.get("xlabel", ""))
    ax.set_ylabel(spec.get("ylabel", ""))
    ax.grid(alpha=0.3)
    if len(labels) > 1:  # outside the axes, to the right (savefig's bbox_inches="tight" widens the figure)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    try:
        return _svg(fig)
    finally:
        plt.close(fig)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#1f2328}
h1{font-size:1.6em}h2{font-size:1.25em;border-bottom:1px solid #d0d7de;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.88em;margin:.6em 0}td,th{border:1px solid #d0d7de;padding:3px 7px;text-align:left}
th{background:#f6f8fa}.badge{display:inline-block;border-radius:1em;padding:0 .6em;color:#fff;font-size:.8em;white-space:nowrap}
.fail{color:#cf222e;font-weight:600}.pass{color:#1a7f37}code{background:#f6f8fa;padding:0 .25em}
.plots{display:flex;flex-wrap:wrap;gap:1em}.plots svg{max-width:100%;height:auto}details{margin:.5em 0}
.caption{font-size:.85em;margin:.2em 0 0 0}
"""


def _badge(text: str, color: str) -> str:
    return f'<span class="badge" style="background:{color}">{html.escape(text)}</span>'


def _plot_caption(spec: dict) -> str:
    """The HTML caption under a plot: its level as a badge (the table rows' colours), or one badge per series
    where they differ."""
    per = series_levels(spec)
    distinct = set(per.values())
    if not per or distinct == {None}:
        return "<p class=\"caption\">level: not recorded</p>"
    if len(distinct) == 1:
        lv = next(iter(distinct))
        return f"<p class=\"caption\">level {_badge(lv, LEVEL_COLORS[lv])}</p>"
    return "<p class=\"caption\">levels per series: " + " · ".join(
        f"{html.escape(lab)} {_badge(lv or 'not recorded', LEVEL_COLORS.get(lv or '', '#6e7781'))}"
        for lab, lv in per.items()) + "</p>"


def _timeout_text(ep: dict) -> str:
    """``", a request fails after 60 s without data"`` for an endpoint block that names its timeout, else ""."""
    t = ep.get("timeout_s")
    return f", a request fails after {t:g} s without data (--endpoint-timeout)" if isinstance(t, (int, float)) else ""


def _header_notes(r: dict) -> list[str]:
    """The report-wide warnings of a reproduction block, for the header of both renderings: the synthetic run's
    (random weights, no correctness claim) and the fallback run's (nothing ran on the profile's hardware)."""
    notes = []
    syn = r.get("synthetic")
    if isinstance(syn, dict) and syn.get("note"):
        notes.append(str(syn["note"]))
    if r.get("fallback_note"):
        notes.append(str(r["fallback_note"]))
    return notes


def _html_context(r: dict) -> list[str]:
    """The header lines of the Markdown report (checkpoint, profile, kernels, device, software), as HTML."""
    e = html.escape
    sw = r.get("software", {}) or {}
    dev = r.get("device", {}) or {}
    out = ["<ul class=\"context\">",
           f"<li>checkpoint <code>{e(str(r.get('checkpoint')))}</code> (config sha256 "
           f"<code>{e(str(r.get('config_hash'))[:16])}</code>)</li>",
           f"<li>profile <code>{e(str(r.get('profile')))}</code>; kernels <code>{e(str(r.get('kernels')))}</code></li>",
           f"<li>device {e(str(dev.get('sku', '?')))} × {e(str(dev.get('count', '?')))} "
           f"({e(str(dev.get('arch', '?')))}, backend {e(str(dev.get('backend', '?')))})"
           + (" — the machine that sent the load" if r.get("endpoint") else "") + "</li>"]
    if isinstance(r.get("endpoint"), dict):
        ep = r["endpoint"]
        out.append(f"<li>benchmarked server {e(str(ep.get('url')))} ({e(str(ep.get('gpus')))} GPUs, "
                   f"{e(str(ep.get('gpus_source')))}){e(_timeout_text(ep))}; the checkpoint above only gave the "
                   "prompts' vocabulary</li>")
    out += [f"<li><strong>{e(n)}</strong></li>" for n in _header_notes(r)]
    out += [f"<li>k3rocm {e(str(sw.get('k3rocm')))} @ <code>{e(str(sw.get('git_sha')))}</code>; torch "
            f"{e(str(sw.get('torch')))} ({e(str(sw.get('torch_build')))}), triton {e(str(sw.get('triton')))}, "
            f"aiter {e(str(sw.get('aiter') or 'absent'))}</li>", "</ul>"]
    return out


def render_html(rep: Report) -> str:
    """A self-contained HTML page: summary, legend of levels, per-stage tables with badges, inline SVG plots."""
    d = rep.to_dict()
    r = d["reproduction"]
    e = html.escape
    out = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>k3rocm report</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>k3rocm report {_badge(d['status'], STATUS_COLORS.get(d['status'], '#6e7781'))}</h1>",
           f"<p>schema <code>{e(d['schema'])}</code> · updated {e(d['updated'])} · command "
           f"<code>{e(str(r.get('command', '')))}</code></p>",
           *_html_context(r),
           "<p>Levels of proof: " + " ".join(
               _badge(f"{lv} ({d['evidence_levels'].get(lv, 0)})", LEVEL_COLORS[lv]) for lv in LEVELS) + "</p>",
           "<table><tr><th>stage</th><th>status</th><th>seconds</th><th>rows</th><th>failures</th></tr>"]
    for s in rep.ordered():
        out.append(f"<tr><td><a href=\"#stage-{e(s.tier)}\">{e(s.tier)}</a></td><td>"
                   f"{_badge(s.status, STATUS_COLORS.get(s.status, '#6e7781'))}</td><td>{s.seconds:.2f}</td>"
                   f"<td>{len(s.evidence)}</td><td>{len(s.failures)}</td></tr>")
    out.append("</table>")
    for s in rep.ordered():
        out.append(f"<h2 id=\"stage-{e(s.tier)}\">{e(s.tier)} "
                   f"{_badge(s.status, STATUS_COLORS.get(s.status, '#6e7781'))}</h2>")
        if s.command:
            out.append(f"<p><code>{e(s.command)}</code> · {s.seconds:.2f} s · started {e(s.started)}</p>")
        if s.error:
            out.append(f"<p class=\"fail\">error: {e(s.error)}</p>")
        specs = [(k, v) for k, v in (s.series or {}).items() if has_points(v)]
        plots = [(p, v) for p, v in ((_series_svg(k, v), v) for k, v in specs if not single_concurrency(v)) if p]
        if plots:  # each plot with its level under it, as every table row carries one
            out.append("<div class=\"plots\">" + "".join(f"<div>{p}{_plot_caption(v)}</div>" for p, v in plots)
                       + "</div>")
        lone = [v for _, v in specs if single_concurrency(v)]
        if lone:  # one bar / one point says nothing: a sentence in their place
            out.append(f"<p class=\"note\">{e(one_concurrency_note(lone))}</p>")
        others, sconcs, srows = stage_settings(s)
        if others or sconcs:
            out.append(f"<p>{e(SETTINGS_TITLE)}:</p>")
        if others:
            out.append("<table><tr><th>setting</th><th>value</th><th>unit</th><th>detail</th></tr>" + "".join(
                f"<tr><td>{e(x.name)}</td><td>{e(_fmt(x.value))}</td><td>{e(x.unit or '')}</td>"
                f"<td>{e(str(x.detail))}</td></tr>" for x in others) + "</table>")
        if sconcs:
            out.append("<table><tr><th>setting</th><th>unit</th>" + "".join(f"<th>c={c}</th>" for c in sconcs)
                       + "</tr>")
            for f, u, vals in srows:
                out.append(f"<tr><td>{e(f)}</td><td>{e(u)}</td>" + "".join(
                    f"<td>{e(fmt_value(vals[c], u)) if c in vals else ''}</td>" for c in sconcs) + "</tr>")
            out.append("</table>")
        concs, prow = point_table(s)
        if concs:
            lv = point_levels(s)
            out.append("<p>Per concurrency point (vLLM's result fields):</p><table><tr><th>field</th><th>unit</th>"
                       "<th>level</th>" + "".join(f"<th>c={c}</th>" for c in concs) + "</tr>")
            for f, u, vals in prow:
                out.append(f"<tr><td>{e(f)}</td><td>{e(u)}</td><td>{e(lv.get(f, ''))}</td>" + "".join(
                    f"<td>{e(fmt_value(vals[c], u)) if c in vals else ''}</td>" for c in concs) + "</tr>")
            out.append("</table>")
        if s.evidence:
            out.append("<table><tr><th>evidence</th><th>value</th><th>unit</th><th>threshold</th>"
                       "<th>result</th><th>level</th><th>detail</th></tr>")
            for ev in s.evidence:
                res = "" if ev.passed is None else (
                    "<span class=\"pass\">pass</span>" if ev.passed else "<span class=\"fail\">FAIL</span>")
                out.append(f"<tr><td>{e(ev.name)}</td><td>{e(_fmt(ev.value))}</td><td>{e(ev.unit or '')}</td>"
                           f"<td>{e(ev.threshold or '')}</td><td>{res}</td>"
                           f"<td>{_badge(ev.level, LEVEL_COLORS.get(ev.level, '#6e7781'))}</td>"
                           f"<td>{e(str(ev.detail))}</td></tr>")
            out.append("</table>")
    out.append("<h2>Reproduction</h2><details open><summary>reproduction block (JSON)</summary><pre>"
               + e(json.dumps(r, indent=2)) + "</pre></details>")
    if d.get("history"):
        out.append("<details><summary>run history</summary><pre>" + e(json.dumps(d["history"], indent=2))
                   + "</pre></details>")
    out.append("</body></html>\n")
    return "\n".join(out)


def write_report(rep: Report, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and report.html into ``out_dir`` as one set; returns their paths.

    All three are rendered from the same document before anything is written (a renderer failing writes
    nothing), then written to temporary files beside them, and only when all three are on disk renamed into
    place (:func:`~k3rocm.validation.evidence.atomic_write_set`, report.json first: it is the record, and the
    merge base of the next command). A failure while writing (no space, an I/O error) removes the temporaries
    and leaves the previous report as it was, all three files, so no format on disk disagrees with another.

    Raises:
        K3Error: an OS error (exit 3 for no space / I/O, exit 2 otherwise, see :func:`k3rocm.errors.os_error`).
    """
    out = Path(out_dir)
    paths = {"json": out / "report.json", "md": out / "report.md", "html": out / "report.html"}
    texts = {"json": render_json(rep), "md": render_markdown(rep), "html": render_html(rep)}
    try:
        atomic_write_set({paths[k]: texts[k] for k in ("json", "md", "html")})
    except OSError as e:
        done = getattr(e, "replaced", None)
        if done:  # a rename failed after others (no space cannot cause it): say which files hold this run
            raise os_error(e, f"renaming the report into {out} ({', '.join(p.name for p in done)} "
                              f"{'holds' if len(done) == 1 else 'hold'} this run's results, the others the previous "
                              "run's)") from None
        target = getattr(e, "target", None)
        what = f"writing {target}" if target is not None else f"writing the report into {out}"
        kept = "the previous report there is unchanged" if paths["json"].exists() else "no report was written"
        raise os_error(e, f"{what} (nothing of this run was saved; {kept})") from None
    return paths


class DeferSignals:
    """Hold Ctrl-C (SIGINT) and SIGTERM while the report is written, then act on them: a run's measured stages are
    never lost to an interrupt that lands in the second or two of writing (the writes are atomic, so an interrupt
    there used to leave only the lock file). On leaving without an exception, a held SIGTERM is raised as
    :class:`~k3rocm.errors.Terminated`, a held Ctrl-C as ``KeyboardInterrupt``; nested uses each restore the
    handlers they found. Outside the main thread signals cannot be caught here: no-op."""

    def __enter__(self):
        self.got: list[int] = []
        self.old: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, lambda signum, frame: self.got.append(signum))
        return self

    def __exit__(self, *exc):
        for sig, h in self.old.items():
            signal.signal(sig, h)
        if self.got and exc[0] is None:
            if signal.SIGTERM in self.got:
                raise Terminated()
            raise KeyboardInterrupt
        return False


def update_report(out_dir: str | Path, reproduction: dict, stages: list[Stage], *, config_hash: str | None = None,
                  checkpoint: str | None = None, profile: str | None = None) -> dict[str, Path]:
    """Merge one command's ``stages`` into ``out_dir``'s report and write it, under :func:`report_lock`.

    Reading (:func:`load_report`, same checkpoint and profile only), merging (:meth:`Report.merge_run`) and
    writing (:func:`write_report`) happen while the lock is held, so two commands writing into one directory
    at once both keep their stages and history entries. Ctrl-C or SIGTERM during it takes effect once the report
    is written (:class:`DeferSignals`). Returns the paths of report.json/md/html.

    Raises:
        K3Error: an OS error as one line (see :func:`write_report`), or the lock timed out.
    """
    try:
        with DeferSignals(), report_lock(out_dir):
            rep = load_report(out_dir, config_hash, checkpoint, profile)
            lost = replaced_passing_stages(rep, stages)
            if lost:  # an interrupted or failed run replaces a passed stage: its figures stay in a kept copy
                keep = keep_previous(Path(out_dir) / "report.json")
                print(f"note: this run's {', '.join(lost)} stage did not pass and replaces the passed one in "
                      f"{Path(out_dir) / 'report.json'}; the previous report is kept as {keep.name}", file=sys.stderr)
            rep.merge_run(reproduction, stages)
            return write_report(rep, out_dir)
    except K3Error:
        raise
    except OSError as e:
        raise os_error(e, f"updating the report in {out_dir}") from None
