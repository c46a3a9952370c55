"""`k3rocm bench --endpoint` honesty: tok/s/GPU divides by the GPUs that serve the endpoint and says where that
number came from; a server that answers no request yields no numbers, one short line and exit 3; options that
cannot mean anything are refused before any report directory exists."""

from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from click.testing import CliRunner

from k3rocm.bench.client import body_snippet
from k3rocm.bench.loadgen import make_requests
from k3rocm.bench.metrics import RequestRecord, aggregate
from k3rocm.cli.main import cli
from k3rocm.errors import ConfigError

torch.set_num_threads(1)

LATENCY_ROWS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
                "median_e2el_ms", "p99_e2el_ms", "output_throughput", "total_token_throughput",
                "output_throughput_per_gpu", "tok_s_per_user")


def run(args, code=0, env=None):
    r = CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "200", **(env or {})})
    assert r.exit_code == code, (args, r.exit_code, r.output, r.exception)
    return r


def one_line_error(r) -> str:
    """Exactly one ``error: ...`` line on stderr (besides ``k3rocm: ...`` progress lines) and no traceback."""
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("k3rocm: ")]
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    return err[0]


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """One private user cache for the embedded k3-tiny, shared by this module's runs."""
    mp = pytest.MonkeyPatch()
    mp.setenv("K3ROCM_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


class _Streaming(BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible streaming /v1/completions server: one 'x' per token, 2 ms apart."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        type(self).seen.append(self.path)
        n = int(req["max_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for _ in range(n):
            time.sleep(0.002)
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(req["prompt"]), "completion_tokens": n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


class _Html404(BaseHTTPRequestHandler):
    """Answers every request with http.server's HTML error page, as a plain web server does."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_error(404)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_error(404)


@contextmanager
def serve(handler):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _rows(out) -> dict:
    return {e["name"]: e for e in json.loads((out / "report.json").read_text())["stages"]["bench"]["evidence"]}


def _settings(out) -> dict:
    """The bench stage's settings (inputs of the run: no level) by name."""
    return {x["name"]: x for x in json.loads((out / "report.json").read_text())["stages"]["bench"]["settings"]}


LOAD = ["--concurrency", "2", "--num-prompts", "4", "--warmups", "1", "--input-len", "8", "--output-len", "4"]


# ------------------------------------------------------------------------------------------------ per-GPU figures
def test_per_gpu_figures_divide_by_the_profile_gpus_and_say_so(tmp_path):
    _Streaming.seen = []
    out = tmp_path / "r"
    with serve(_Streaming) as url:
        r = run(["bench", "--endpoint", url, "--profile", "mi355x-8", *LOAD, "--out", out])
    assert len(_Streaming.seen) == 5  # 1 warm-up + 4 measured
    rows = _rows(out)
    tot, per = rows["c2.output_throughput"]["value"], rows["c2.output_throughput_per_gpu"]["value"]
    assert tot > 0 and per == pytest.approx(tot / 8, rel=1e-3, abs=1e-3)
    detail = rows["c2.output_throughput_per_gpu"]["detail"]
    assert "8 GPUs" in detail and "--profile mi355x-8" in detail
    gpus = _settings(out)["endpoint.gpus"]  # the divisor given (or taken from --profile): a setting, not a claim
    assert gpus["value"] == 8 and "--profile mi355x-8" in gpus["detail"] and "endpoint.gpus" not in rows
    assert rows["c2.output_throughput_per_gpu"]["level"] == "external"
    assert "endpoint.gpus" in r.output
    md = (out / "report.md").read_text()  # the header names the server measured, not only this machine
    assert f"benchmarked server: {url} (8 GPUs" in md and "the machine that sent the load" in md
    assert "a request fails after 60 s without data (--endpoint-timeout)" in md  # the default wait, said


def test_endpoint_gpus_wins_over_the_profile(tmp_path):
    out = tmp_path / "r"
    with serve(_Streaming) as url:
        run(["bench", "--endpoint", url, "--profile", "mi355x-8", "--endpoint-gpus", "2", *LOAD, "--out", out])
    rows = _rows(out)
    tot, per = rows["c2.output_throughput"]["value"], rows["c2.output_throughput_per_gpu"]["value"]
    assert per == pytest.approx(tot / 2, rel=1e-3, abs=1e-3)
    assert "2 GPUs" in rows["c2.output_throughput_per_gpu"]["detail"]
    assert "--endpoint-gpus" in rows["c2.output_throughput_per_gpu"]["detail"]
    assert _settings(out)["endpoint.gpus"]["value"] == 2


# ------------------------------------------------------------------------------------------------ nothing measured
def test_a_server_that_answers_html_404_gives_no_numbers_one_line_exit_3(tmp_path):
    out = tmp_path / "r"
    with serve(_Html404) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", "--concurrency", "1,2", "--num-prompts", "2",
                 "--warmups", "0", "--input-len", "8", "--output-len", "2", "--out", out], code=3)
    line = one_line_error(r)
    assert "HTTP 404" in line and "none of 2 requests" in line
    assert "<" not in line and "DOCTYPE" not in line and len(line) < 400, line
    rep = json.loads((out / "report.json").read_text())
    bench = rep["stages"]["bench"]
    assert bench["status"] == "error"
    rows = {e["name"]: e for e in bench["evidence"]}
    for k in LATENCY_ROWS:  # no measurement, no number
        assert f"c1.{k}" not in rows, k
    assert not any(name.startswith("c2.") for name in rows)  # the sweep stopped at the point that measured nothing
    failed = rows["c1.failed"]
    assert failed["passed"] is False and failed["value"] == 2
    assert "HTTP 404" in failed["detail"] and "<" not in failed["detail"]
    assert rows["c1.completed"]["value"] == 0 and rows["c1.completed"]["passed"] is False
    # the stdout table holds no 0 ms latency either
    assert "median_ttft_ms" not in r.output and "output_throughput" not in r.output


def test_body_snippet_is_short_text():
    page = (b'<!DOCTYPE HTML>\n<html lang="en">\n<head><title>Error response</title>'
            b"<style>body{color:red}</style></head>\n<body>\n<h1>Error response</h1>\n"
            b"<p>Error code: 404</p>\n<p>Message: File not found &amp; more.</p>\n" + b"<p>x</p>" * 200 +
            b"</body></html>")
    s = body_snippet(page)
    assert s.startswith("Error response Error code: 404 Message: File not found & more.")
    assert len(s) <= 80 and "<" not in s and "color" not in s
    assert body_snippet(b'{"object": "error", "message": "model k9 does not exist", "code": 404}') == \
        "model k9 does not exist"
    assert body_snippet(b'{"error": {"message": "bad prompt"}}') == "bad prompt"
    assert body_snippet(b"model\n  overloaded") == "model overloaded"
    assert body_snippet(b"") == ""


def test_aggregate_leaves_out_what_was_not_measured():
    failed = RequestRecord(0, 10, 4, 0.0, [], 0, False, "HTTP 404")
    m = aggregate([failed], 1e-9, num_gpus=8)
    assert (m["completed"], m["failed"], m["num_gpus"]) == (0, 1, 8)
    for k in ("duration", "output_throughput", "output_throughput_per_gpu", "mean_ttft_ms", "median_tpot_ms",
              "p99_itl_ms", "median_e2el_ms"):
        assert k not in m, k
    one = RequestRecord(1, 10, 1, 0.0, [0.25], 1, True)  # one output token: TTFT and E2EL, no TPOT or ITL
    m = aggregate([one], 0.5, num_gpus=2)
    assert m["median_ttft_ms"] == pytest.approx(250.0) and m["median_e2el_ms"] == pytest.approx(250.0)
    assert not any(k.endswith(("_tpot_ms", "_itl_ms")) for k in m)
    assert m["output_throughput_per_gpu"] == pytest.approx(1 / 0.5 / 2)
    with pytest.raises(ConfigError):
        aggregate([one], 0.5, num_gpus=0)


def test_output_draws_start_at_two_tokens():
    reqs = make_requests(50, 8, 2, vocab_size=97, range_ratio=0.8, seed=1)
    assert {r.output_len for r in reqs} == {2}
    reqs = make_requests(200, 8, 10, vocab_size=97, range_ratio=0.1, seed=1)
    assert min(r.output_len for r in reqs) == 2 and max(r.output_len for r in reqs) == 10
    with pytest.raises(ConfigError, match="TPOT"):
        make_requests(1, 8, 1, vocab_size=97)


# ------------------------------------------------------------------------------------------------ refusals
DEAD = "http://127.0.0.1:9"  # never contacted: every refusal comes first


@pytest.mark.parametrize("args,words", [
    (["--endpoint", DEAD], ["--endpoint-gpus"]),
    (["--endpoint", DEAD, "--profile", "cpu"], ["--endpoint-gpus", "no GPU"]),
    (["--endpoint", DEAD, "--endpoint-gpus", "0"], ["--endpoint-gpus 0"]),
    (["--endpoint-gpus", "4"], ["--endpoint-gpus", "--endpoint URL"]),
    (["--endpoint", DEAD, "--endpoint-gpus", "8", "--kernels", "triton"], ["--kernels", "no effect"]),
    (["--endpoint", DEAD, "--profile", "mi355x-8", "--kernels", "torch"], ["--kernels", "no effect"]),
    (["--num-prompts", "1", "--concurrency", "4"], ["--num-prompts 1", "--concurrency 4", "--num-prompts 4"]),
    (["--endpoint", DEAD, "--endpoint-gpus", "8", "--num-prompts", "3", "--concurrency", "1,8"],
     ["--num-prompts 3", "--num-prompts 8"]),
    (["--endpoint", DEAD, "--endpoint-gpus", "8", "--num-prompts", "10"], ["default --concurrency 64"]),
    (["--num-prompts", "2"], ["default --concurrency 4", "--num-prompts 4"]),
    (["--output-len", "1"], ["--output-len 1", "TPOT"]),
    (["--output-len", "0", "--endpoint", DEAD, "--endpoint-gpus", "8"], ["--output-len 0", "TPOT"]),
    (["--endpoint-timeout", "30"], ["--endpoint-timeout", "--endpoint URL"]),
    (["--endpoint", DEAD, "--endpoint-gpus", "8", "--endpoint-timeout", "0"], ["--endpoint-timeout 0", "(0, 86400]"]),
    (["--endpoint", DEAD, "--endpoint-gpus", "8", "--endpoint-timeout", "nan"], ["--endpoint-timeout nan"]),
])
def test_refusals_are_one_line_exit_2_and_create_nothing(tmp_path, args, words):
    out = tmp_path / "deep" / "r"
    line = one_line_error(run(["bench", *args, "--out", out], code=2))
    for w in words:
        assert w in line, (w, line)
    assert not (tmp_path / "deep").exists()


def test_help_says_the_limits():
    h = " ".join(run(["bench", "--help"]).output.split())
    assert "--endpoint-gpus" in h and "at least 2" in h and "no TPOT or ITL" in h
    assert "at least the largest concurrency" in h


class _FixedStream(_Streaming):
    """Answers every request with the same server-sent event body (``BODY``), whatever it asked for."""

    BODY = b""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(self.BODY)
        self.wfile.flush()
        self.close_connection = True


class _StreamError(_FixedStream):
    """An error event inside the stream, the way vLLM reports an unknown model."""

    BODY = b'data: {"error": {"message": "The model `nope` does not exist.", "code": 404}}\n\ndata: [DONE]\n\n'


def test_an_error_event_in_the_stream_is_reported_in_the_servers_words(tmp_path):
    out = tmp_path / "r"
    with serve(_StreamError) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", "--model", "nope", *LOAD, "--out", out], code=3)
    line = one_line_error(r)
    assert "does not exist" in line and "no tokens streamed" not in line


class _Short(_FixedStream):
    """Streams one token whatever max_tokens asks for (a server that stops at EOS)."""

    BODY = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\ndata: [DONE]\n\n'


def test_short_outputs_are_counted_in_a_row(tmp_path):
    out = tmp_path / "r"
    with serve(_Short) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", *LOAD, "--out", out], code=1)
    # every request short: the server ignored max_tokens / ignore_eos, the row fails (exit 1), and it is said on
    # the console, not only in a report row
    assert "note: at concurrency 2, 4 completed request(s) returned fewer output tokens than asked" in \
        " ".join(r.output.split())
    rows = _rows(out)
    assert rows["c2.short_outputs"]["value"] == 4 and "fewer output tokens" in rows["c2.short_outputs"]["detail"]
    assert rows["c2.short_outputs"]["passed"] is False and rows["c2.short_outputs"]["threshold"] == "<= 2"
    assert "c2.median_tpot_ms" not in rows  # one token each: no TPOT was measured, and none is shown


# ------------------------------------------------------------------------------------------------ trusting less
@contextmanager
def silent_server(max_s: float = 5.0):
    """A loopback TCP server that accepts connections and never answers (bounded: it stops after ``max_s``)."""
    import socket

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    lst.settimeout(0.05)
    held, stop = [], threading.Event()

    def accept():
        t0 = time.monotonic()
        while not stop.is_set() and time.monotonic() - t0 < max_s:
            try:
                held.append(lst.accept()[0])
            except OSError:
                pass
    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{lst.getsockname()[1]}", held
    finally:
        stop.set()
        th.join()
        for c in held:
            c.close()
        lst.close()


def test_a_server_that_never_answers_stops_after_the_warmups_and_says_connected_no_response():
    from k3rocm.bench import run_bench
    from k3rocm.bench.client import OpenAIClient
    from k3rocm.validation.bench_job import _nothing_measured

    with silent_server() as (url, held):
        t0 = time.monotonic()
        r = run_bench(OpenAIClient(url, timeout=0.3), 2, 8, 4, num_prompts=6, warmups=4, vocab_size=100)
        took = time.monotonic() - t0
        sent = len(held)
    wu = r.warmup
    assert took < 3.0 and sent <= 3 and wu["sent"] <= 3  # about one wave of the 4 warm-ups, then nothing more
    assert r.records == [] and wu["failed"] == wu["sent"] and wu["completed"] == 0
    line = _nothing_measured(url, r.to_dict(per_request=False))
    assert f"the first {wu['sent']} of 4 warm-up requests" in line and "connected, no response within 0.3 s" in line
    assert f"the other {4 - wu['sent']} and every measured request were not sent" in line
    assert "cannot connect" not in line
    wu["sent"] = wu["failed"] = wu["asked"]  # every planned warm-up sent and failed: "all"
    line = _nothing_measured(url, {"concurrency": 2, "warmup": wu})
    assert "all 4 warm-up requests at concurrency 2 failed" in line and "no measured request was sent" in line


def test_endpoint_timeout_bounds_the_wait_on_a_silent_server(tmp_path):
    # --endpoint-timeout reaches the client: a silent server fails the run after 0.3 s per wait, and says so
    with silent_server() as (url, _):
        t0 = time.monotonic()
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", "--endpoint-timeout", "0.3", "--concurrency", "1",
                 "--num-prompts", "1", "--warmups", "1", "--input-len", "4", "--output-len", "2",
                 "--out", tmp_path / "r"], code=3)
        took = time.monotonic() - t0
    assert "no response within 0.3 s" in one_line_error(r) and took < 30


class _Fails(_Streaming):
    """Answers every request with HTTP 500."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()


def test_a_failing_server_gets_warm_up_counts_that_agree_in_progress_error_and_report(tmp_path):
    """Concurrency 1, 2 warm-ups planned: the first fails and the second is not sent. The progress line (1/2, 1
    failed), the error line and the report row say the same counts (not "all 1 warm-up requests")."""
    out = tmp_path / "r"
    with serve(_Fails) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", "--concurrency", "1", "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "4", "--out", out], code=3)
    assert "bench c=1 warm-up: 1/2 (50%), 1 failed" in r.stderr
    line = one_line_error(r)
    assert "the first 1 of 2 warm-up requests at concurrency 1 failed (" in line, line
    assert "the other 1 and every measured request were not sent" in line and "all 1 warm-up" not in line
    row = _rows(out)["c1.warmup_failed"]
    assert row["value"] == 1 and "of 1 warm-up requests sent (not measured); 2 were planned, the other 1 not sent" \
        in row["detail"], row["detail"]
    assert _settings(out)["c1.num_warmups"]["value"] == 2


class _NoDone(_FixedStream):
    """Streams tokens and then closes without the end marker."""

    BODY = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n' * 4


def test_a_stream_without_its_end_marker_is_a_failed_truncated_request(tmp_path):
    out = tmp_path / "r"
    with serve(_NoDone) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", *LOAD, "--out", out], code=3)
    assert "truncated" in one_line_error(r)


class _Malformed(_FixedStream):
    """A broken event among good token events (a token in it would go uncounted)."""

    BODY = (b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n' * 2 + b'data: {not json\n\n'
            + b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n' * 2 + b'data: [DONE]\n\n')


def test_a_malformed_event_fails_the_request_and_says_so(tmp_path):
    """It was skipped: the run passed with those tokens uncounted (TPOT / ITL wrong) and said nothing."""
    out = tmp_path / "r"
    with serve(_Malformed) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", *LOAD, "--out", out], code=3)
    line = one_line_error(r)
    assert "malformed" in line and "truncated" not in line, line


class _BigUsage(_FixedStream):
    """Four token events but a usage claiming 10,000 completion tokens."""

    BODY = (b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n' * 4
            + b'data: {"choices": [], "usage": {"completion_tokens": 10000}}\n\ndata: [DONE]\n\n')


def test_usage_that_disagrees_with_the_stream_is_reported_and_not_used(tmp_path):
    out = tmp_path / "r"
    with serve(_BigUsage) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", *LOAD, "--out", out], code=1)
    rows = _rows(out)
    row = rows["c2.usage_disagreements"]
    assert row["value"] == 4 and row["passed"] is False and "> max_tokens" in row["detail"]
    assert "usage_disagreements" in one_line_error(r)
    doc = json.loads((out / "report.json").read_text())
    assert doc["stages"]["bench"]["status"] == "failed"
    assert rows["c2.output_throughput"]["value"] < 1e5  # counted from the 4 events per request, not 10,000


def test_usage_check_trusts_usage_only_between_the_events_and_max_tokens():
    from k3rocm.bench.client import usage_check

    assert usage_check(None, 5, 8) == (5, "")
    assert usage_check(7, 5, 8) == (7, "")  # an event may carry several tokens
    assert usage_check(10000, 5, 8)[0] == 5 and "> max_tokens 8" in usage_check(10000, 5, 8)[1]
    assert usage_check(2, 5, 8)[0] == 5 and "< the 5 token events" in usage_check(2, 5, 8)[1]


def test_no_raw_bytes_reach_an_error_line():
    s = body_snippet(b"\x1b[2J\x1b[31mred\x00\x07 text \xff\xfe")
    assert "\x1b" not in s and "\x00" not in s and "\x07" not in s and "red" in s and "text" in s


# ------------------------------------------------------------------------------------------------ what load was measured
LOAD_FIELDS = ("input_len", "output_len", "range_ratio", "num_prompts", "num_warmups")  # settings of each point
POINT_FIELDS = (*LOAD_FIELDS, "duration", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
                "total_token_throughput", *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                                           for s in ("mean", "median", "p99")))


def test_each_point_states_its_load_and_vllms_result_fields_in_every_format(tmp_path):
    out = tmp_path / "r"
    with serve(_Streaming) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", "--concurrency", "1,2", "--num-prompts", "2",
                 "--warmups", "1", "--input-len", "8", "--output-len", "4", "--out", out])
    rows, st = _rows(out), _settings(out)
    for c in (1, 2):
        for f in POINT_FIELDS:  # the load the point was given is a setting (no level); what it measured, evidence
            assert (f"c{c}.{f}" in st) == (f in LOAD_FIELDS) and (f"c{c}.{f}" in rows) == (f not in LOAD_FIELDS), (c, f)
    assert st["c2.input_len"]["value"] == 8 and st["c2.range_ratio"]["value"] == 0.8 and "level" not in st["c2.input_len"]
    assert st["c1.num_warmups"]["value"] == 1 and rows["c1.total_output_tokens"]["value"] >= 2
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "| field | unit | level | c=1 | c=2 |" in md and "<th>level</th><th>c=1</th><th>c=2</th>" in page
    assert "| setting | unit | c=1 | c=2 |" in md and "<th>setting</th><th>unit</th><th>c=1</th><th>c=2</th>" in page
    assert "inputs, not measurements" in md and "load of each point (settings)" in r.output
    for f in POINT_FIELDS:
        assert f"| {f} |" in md and f"<td>{f}</td>" in page and f in r.output, f
    assert "per concurrency point" in r.output
    line = next(ln for ln in r.output.splitlines() if " mean_ttft_ms " in ln)
    assert re.search(r"\d+\.\d\d\b", line)  # milliseconds at two decimals


# ------------------------------------------------------------------------------------------------ progress
class _EveryOtherFails(_Streaming):
    """Streams like _Streaming, but answers every second request with HTTP 500."""

    count = [0]

    def do_POST(self):
        type(self).count[0] += 1
        if type(self).count[0] % 2 == 0:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            return
        super().do_POST()


def test_progress_states_the_work_labels_the_phases_and_counts_failures_apart(tmp_path):
    with serve(_EveryOtherFails) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", "--concurrency", "1", "--num-prompts", "4",
                 "--warmups", "1", "--input-len", "8", "--output-len", "4", "--out", tmp_path / "r"], code=1)
    err = r.stderr
    assert "bench: 1 point (concurrency 1), 5 requests (1 warm-up + 4 measured), up to 8 prompt + 4 output" in err
    first = err.index("bench: 1 point")
    assert first < err.index("bench c=1 warm-up: ") < err.index("bench c=1 measured: ")
    done = [ln for ln in err.splitlines() if "bench c=1 measured: 4/4" in ln][-1]
    assert "2 failed" in done and "tokens" in done


def test_ctrl_c_keeps_the_finished_points_marked_interrupted(tmp_path, monkeypatch):
    from k3rocm.validation import bench_job

    real = bench_job.run_bench

    def interrupted_at_2(client, c, *a, **k):
        if c == 2:
            raise KeyboardInterrupt
        return real(client, c, *a, **k)
    monkeypatch.setattr(bench_job, "run_bench", interrupted_at_2)
    out = tmp_path / "r"
    with serve(_Streaming) as url:
        r = run(["bench", "--endpoint", url, "--endpoint-gpus", "1", "--concurrency", "1,2,4", "--num-prompts", "4",
                 "--warmups", "0", "--input-len", "8", "--output-len", "4", "--out", out], code=130)
    line = one_line_error(r)
    assert "interrupted (Ctrl-C) after 1 of 3 points" in line and "bench tier was stopped" in line
    stage = json.loads((out / "report.json").read_text())["stages"]["bench"]
    rows = {e["name"]: e for e in stage["evidence"]}
    assert stage["status"] == "error" and "interrupted" in stage["error"]
    assert rows["c1.completed"]["value"] == 4 and "c1.median_ttft_ms" in rows
    assert rows["sweep.interrupted"]["value"] is True and "during concurrency 2" in rows["sweep.interrupted"]["detail"]
