"""The benchmark load against an OpenAI-compatible ``/v1/completions`` streaming endpoint (stdlib HTTP only).

Each request is ``POST {endpoint}/v1/completions`` with JSON ``{"model", "prompt": [token ids], "max_tokens",
"stream": true, "temperature": 0, "ignore_eos": true, "stream_options": {"include_usage": true}}`` and
reads the server-sent events (``data: {...}`` lines, ending with ``data: [DONE]``), as vLLM's
``benchmark_serving`` does: every event carrying non-empty ``choices[0].text`` is a token arrival (its time
feeds TTFT / ITL); the output token count is ``usage.completion_tokens`` when the server reports it and it agrees
with the stream (at least the number of such events, at most ``max_tokens``), else the number of events, and the
disagreement is recorded. A stream that ends without ``data: [DONE]`` is a failed request (truncated). A server
that takes the connection and never answers fails with "connected, no response", and when every warm-up request
fails the point stops there (:func:`k3rocm.bench.run_bench`). Nothing a server sends is echoed raw: error lines
quote at most :data:`SNIPPET_CHARS` printable characters of its text.

Command line: ``python -m k3rocm.bench.client --endpoint http://host:8000 --concurrency 4 --input-len 1024
--output-len 1024`` prints the result as JSON.
"""

from __future__ import annotations

import argparse
import html
import http.client
import json
import queue
import re
import socket
import sys
import threading
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from k3rocm.bench import progress_ticker, sweep
from k3rocm.bench.loadgen import BenchRequest
from k3rocm.bench.metrics import RequestRecord
from k3rocm.errors import ConfigError, HardwareError

SNIPPET_CHARS = 80  # of a response body quoted in an error line


def usage_check(usage: object, events: int, max_tokens: int) -> tuple[int, str]:
    """Output tokens of one streamed request and how the server's ``usage.completion_tokens`` disagreed.

    ``usage`` is trusted when it is an integer in ``[events, max_tokens]`` (each text event carries at least one
    token; the request asked for at most ``max_tokens``). Otherwise the count is ``events`` (what was seen) and
    the second value is one line naming the disagreement; ``""`` when there is none. Raises nothing.
    """
    if usage is None:
        return events, ""
    if not isinstance(usage, int) or isinstance(usage, bool):
        return events, f"usage.completion_tokens {body_snippet(str(usage).encode(), 20)!r} is not an integer"
    if usage > max_tokens:
        return events, f"usage.completion_tokens {usage} > max_tokens {max_tokens} ({events} token events streamed)"
    if usage < events:
        return events, f"usage.completion_tokens {usage} < the {events} token events streamed"
    return usage, ""


def body_snippet(raw: bytes, limit: int = SNIPPET_CHARS) -> str:
    """One short line from a response body, for an error message: an OpenAI-style JSON error's ``message``, the
    visible text of an HTML page (head, scripts, styles and tags dropped, entities decoded), else the text;
    whitespace collapsed, at most ``limit`` characters (``…`` marks a cut). Never raises."""
    text = raw.decode("utf-8", errors="replace")
    try:
        doc = json.loads(text)
        err = doc.get("error", doc) if isinstance(doc, dict) else None
        msg = err.get("message") if isinstance(err, dict) else (err if isinstance(err, str) else None)
        if isinstance(msg, str) and msg.strip():
            text = msg
    except ValueError:
        if "<" in text and re.search(r"<\s*(!doctype|html|head|body|p|h1|title)\b", text, re.I):
            text = re.sub(r"(?is)<(head|script|style)\b.*?(</\1\s*>|$)", " ", text)
            text = html.unescape(re.sub(r"(?s)<[^>]*>?", " ", text))
    text = "".join(c if c.isprintable() else " " for c in text)  # no control bytes or escapes reach a terminal
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


#: seconds a server may stay silent (no response, no new stream data) before a request fails (``bench
#: --endpoint-timeout`` overrides it)
DEFAULT_TIMEOUT_S = 60.0


class OpenAIClient:
    """Streaming client of one endpoint.

    Args:
        endpoint: base URL (``http://host:port``; the OpenAI base-URL form ``.../v1`` and a trailing
            ``/v1/completions`` are accepted too).
        model: the ``model`` field (None = omitted; vLLM then uses its only model).
        vocab_size: vocabulary for random prompts (K3: 163840). special_ids: ids never used in prompts.
        timeout: socket timeout per read, seconds (a stalled stream also ends at the watchdog).

    Raises:
        ConfigError: a URL that is not ``http``/``https`` with a host.
    """

    def __init__(self, endpoint: str, model: str | None = None, vocab_size: int = 163840,
                 special_ids: tuple[int, ...] = (163584, 163585, 163586, 163839), timeout: float = DEFAULT_TIMEOUT_S):
        u = urlsplit(endpoint)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"--endpoint {endpoint!r} is not an http(s)://host[:port] URL")
        self.endpoint = endpoint
        self.scheme, self.host, self.port = u.scheme, u.hostname, u.port
        path = u.path.rstrip("/")
        if path.endswith("/v1"):  # the OpenAI base-URL form (http://host:8000/v1)
            path = path[:-3]
        self.path = path if path.endswith("/v1/completions") else path + "/v1/completions"
        self.model = model
        self.vocab_size = vocab_size
        self.special_ids = special_ids
        self.timeout = timeout

    def check_reachable(self, timeout: float = 5.0) -> None:
        """Open (and close) a TCP connection to the server before any request is timed.

        Raises:
            HardwareError: the host does not resolve or the port refuses / times out (one line, exit 3).
        """
        port = self.port or (443 if self.scheme == "https" else 80)
        try:
            socket.create_connection((self.host, port), timeout=timeout).close()
        except OSError as e:
            raise HardwareError(f"--endpoint {self.endpoint}: cannot connect to {self.host}:{port} "
                                f"({e.strerror or e}); is the server up?") from None

    def describe(self) -> dict:
        return {"endpoint": self.endpoint, "path": self.path, "model": self.model, "timeout_s": self.timeout}

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def stream(self, prompt_ids: list[int], max_tokens: int, on_token: Callable[[float, int], None],
               stop: threading.Event | None = None) -> tuple[int, str]:
        """Send one request and call ``on_token(arrival_time, n_tokens)`` per streamed event with text.

        Returns:
            ``(output_tokens, disagreement)``: ``usage.completion_tokens`` when the server reports it and it lies
            in ``[events, max_tokens]`` (an event may carry several tokens, but never less than one, and the
            request asked for at most ``max_tokens``), else the number of text events; ``disagreement`` is ""
            or one line saying how the reported usage disagreed with the stream.

        Raises:
            HardwareError: the connection cannot be opened ("cannot connect"); it opened but no answer came
                within ``timeout`` ("connected, no response") or the server closed it unanswered; an HTTP status
                other than 200 (one short line: the status, its reason and the first :data:`SNIPPET_CHARS`
                printable characters of the body's text, never the raw page); a 200 answer that carries no
                server-sent ``data:`` event (not a streaming completions server); a stream that stalls for
                ``timeout`` or ends without ``data: [DONE]`` ("truncated").
        """
        body = {"prompt": list(prompt_ids), "max_tokens": int(max_tokens), "stream": True, "temperature": 0.0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        conn = self._conn()
        events = 0
        usage = None
        ended = False
        try:
            try:
                conn.connect()
            except OSError as e:
                raise HardwareError(f"endpoint {self.endpoint}: cannot connect ({e.strerror or type(e).__name__}); "
                                    "is the server up?") from None
            try:
                conn.request("POST", self.path, body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
                resp = conn.getresponse()
            except TimeoutError:
                raise HardwareError(f"endpoint {self.endpoint}: connected, no response within {self.timeout:g} s "
                                    f"to POST {self.path}") from None
            except (OSError, http.client.HTTPException) as e:
                what = ("closed the connection without a response" if isinstance(
                    e, (http.client.RemoteDisconnected, ConnectionError)) else "answered with no HTTP response")
                raise HardwareError(f"endpoint {self.endpoint}: connected, the server {what} to POST "
                                    f"{self.path}") from None
            if resp.status != 200:
                try:
                    raw = resp.read(4096)
                except (OSError, http.client.HTTPException):
                    raw = b""
                snip = body_snippet(raw)
                raise HardwareError(f"POST {self.path}: HTTP {resp.status} {body_snippet((resp.reason or '').encode())}"
                                    .rstrip() + (f": {snip}" if snip else ""))
            ctype = body_snippet((resp.getheader("Content-Type", "") or "").encode())
            seen_data = False
            first = b""
            while True:
                if stop is not None and stop.is_set():
                    break
                try:
                    line = resp.readline()
                except TimeoutError:
                    raise HardwareError(f"POST {self.path}: the stream stalled (no data for {self.timeout:g} s after "
                                        f"{events} token events)") from None
                except (OSError, http.client.HTTPException):
                    line = b""  # a reset mid-stream ends it: truncated below
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    if not seen_data and len(first) < 4096:
                        first += line + b" "
                    continue
                seen_data = True
                data = line[5:].strip()
                if data == b"[DONE]":
                    ended = True
                    break
                try:
                    msg = json.loads(data)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    # a token in it would go uncounted (TPOT / ITL wrong): the request fails, saying so
                    raise HardwareError(f"POST {self.path}: a malformed server-sent event (not JSON) after {events} "
                                        f"token events: {body_snippet(data)}") from None
                err = msg.get("error") if isinstance(msg, dict) else None
                if err:  # an error event inside the stream (vLLM / SGLang send {"error": {"message": ...}})
                    text = err.get("message") if isinstance(err, dict) else err
                    raise HardwareError(f"POST {self.path}: the stream carried an error: "
                                        f"{body_snippet(str(text).encode())}")
                if not isinstance(msg, dict):
                    continue
                if isinstance(msg.get("usage"), dict):
                    usage = msg["usage"].get("completion_tokens", usage)
                ch = msg.get("choices") or []
                if ch and isinstance(ch[0], dict) and ch[0].get("text"):
                    events += 1
                    on_token(time.perf_counter(), 1)
            stopped = stop is not None and stop.is_set()
            if not seen_data and not stopped:
                snip = body_snippet(first)
                raise HardwareError(f"POST {self.path}: HTTP 200 ({ctype or 'no Content-Type'}) without any "
                                    "server-sent 'data:' event" + (f": {snip}" if snip else ""))
            if not ended and not stopped:
                raise HardwareError(f"POST {self.path}: truncated: the stream ended without 'data: [DONE]' after "
                                    f"{events} token events")
        finally:
            conn.close()
        return usage_check(usage, events, int(max_tokens))

    def drive(self, reqs: list[BenchRequest], conc: int, dog: Any, progress: Callable | None,
              label: str) -> tuple[list[RequestRecord], dict | None, float, float]:
        """Issue ``reqs`` with at most ``conc`` in flight (one thread each); returns
        ``(records, hang or None, t_start, t_end)``. Used by :func:`k3rocm.bench.run_bench`.

        In the ``"warmup"`` phase the rest is not sent once the first ``min(conc, len(reqs))`` requests have all
        failed (a server that answers nothing would otherwise cost every warm-up its timeout); the records then
        hold only the requests sent."""
        stop = threading.Event()
        finished: queue.Queue = queue.Queue()
        pending = list(reversed(reqs))
        active: dict[int, tuple[RequestRecord, threading.Thread]] = {}
        done: list[RequestRecord] = []
        tick = progress_ticker(progress, label, len(reqs), done, lambda: [a[0] for a in list(active.values())])
        t_start = time.perf_counter()
        t_end = t_start
        hang = None

        def work(r: BenchRequest, rec: RequestRecord) -> None:
            def on_token(t: float, n: int) -> None:
                rec.token_times.append(t)
                rec.output_tokens += n
            try:
                n, rec.usage_disagreement = self.stream(list(r.prompt_ids), r.output_len, on_token, stop)
                rec.output_tokens = n
                rec.success = not stop.is_set() and bool(rec.token_times)
                if not rec.success and not rec.error:
                    rec.error = "stopped" if stop.is_set() else "no tokens streamed"
            except Exception as e:  # recorded per request, as vLLM does
                rec.error = str(e).splitlines()[0] if str(e) else type(e).__name__
            finished.put(r.request_id)

        try:
            while pending or active:
                while pending and len(active) < conc and not stop.is_set():
                    r = pending.pop()
                    rec = RequestRecord(r.request_id, r.input_len, r.output_len, time.perf_counter())
                    th = threading.Thread(target=work, args=(r, rec), daemon=True)
                    active[r.request_id] = (rec, th)
                    th.start()
                try:
                    rid = finished.get(timeout=0.02)
                except queue.Empty:
                    rid = None
                if rid is not None:
                    rec, th = active.pop(rid)
                    th.join()
                    done.append(rec)
                    if rec.success:
                        dog.add(rec.e2el)
                        t_end = max(t_end, rec.token_times[-1])
                    tick.send(True)
                    if label == "warmup" and len(done) >= min(conc, len(reqs)) and not any(x.success for x in done):
                        stop.set()  # every warm-up so far failed: send no more
                        pending.clear()
                        for rec2, _ in active.values():
                            rec2.error = rec2.error or "not waited for: every warm-up before it failed"
                            done.append(rec2)
                        active.clear()
                else:
                    tick.send(False)  # tokens of the in-flight requests, at most every 0.5 s
                thr = dog.threshold()
                now = time.perf_counter()
                if thr is not None and hang is None:
                    for rid2, (rec, _) in active.items():
                        if now - rec.issue_time > thr:
                            where = {"status": "decode" if rec.token_times else "waiting for first token",
                                     "output_tokens": rec.output_tokens}
                            hang = {"request_id": rid2, "elapsed_s": now - rec.issue_time, "threshold_s": thr,
                                    "median_e2el_s": thr / dog.factor, "where": where, "phase": label}
                            rec.where = where
                            rec.error = "hang"
                            break
                if hang is not None:
                    # end cleanly: tell the streams to stop, do not wait on a stalled socket (daemon threads)
                    stop.set()
                    pending.clear()
                    for rid2, (rec, _) in active.items():
                        rec.success = False
                        rec.error = rec.error or "aborted after a hang"
                        done.append(rec)
                    active.clear()
                    t_end = now
        except KeyboardInterrupt:  # Ctrl-C: the streams stop too (they are daemon threads)
            stop.set()
            raise
        return done, hang, t_start, t_end


def main(argv: list[str] | None = None) -> int:
    """CLI: benchmark an endpoint; prints the :class:`~k3rocm.bench.BenchResult` as JSON."""
    ap = argparse.ArgumentParser(prog="python -m k3rocm.bench.client",
                                 description="InferenceX-style load against an OpenAI-compatible endpoint")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", default="4", help="one value or a comma list")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--range-ratio", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-gpus", type=int, required=True,
                    help="GPUs serving the endpoint: the divisor of the tok/s/GPU figures (the server does not say)")
    ap.add_argument("--vocab-size", type=int, default=163840)
    a = ap.parse_args(argv)
    client = OpenAIClient(a.endpoint, a.model, a.vocab_size)
    concs = [int(x) for x in a.concurrency.split(",")]
    res = sweep(client, concs, a.input_len, a.output_len, num_prompts=a.num_prompts, range_ratio=a.range_ratio,
                seed=a.seed, num_gpus=a.num_gpus)
    json.dump([r.to_dict(per_request=False) for r in res], sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
