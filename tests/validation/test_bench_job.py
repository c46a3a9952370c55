"""The bench job as a library (k3rocm.validation.bench_job): option checks, defaults and the report's endpoint
block, without the CLI."""

from __future__ import annotations

import pytest

from k3rocm.errors import ConfigError
from k3rocm.validation.bench_job import (BenchOptions, check_options, endpoint_gpus, parse_concurrency,
                                         resolve_points)
from k3rocm.validation.session import EndpointTarget, Options, Session


def test_parse_concurrency():
    assert parse_concurrency("1,8,64") == [1, 8, 64]
    for bad, why in (("1,,8", "empty entry"), ("a", "positive integers"), ("0", "positive integers"),
                     ("4,4", "given twice")):
        with pytest.raises(ConfigError, match=why):
            parse_concurrency(bad)


def test_check_options_says_who_serves_an_endpoint():
    assert check_options(BenchOptions(), "auto", None) is None
    url = "http://127.0.0.1:9"
    assert check_options(BenchOptions(endpoint=url, endpoint_gpus=2), "auto", None) == (2, "from --endpoint-gpus")
    assert endpoint_gpus(None, "mi355x-8") == (8, "the device count of --profile mi355x-8")
    with pytest.raises(ConfigError, match="--endpoint-gpus N"):
        check_options(BenchOptions(endpoint=url), "auto", None)
    with pytest.raises(ConfigError, match="describes no GPU"):
        check_options(BenchOptions(endpoint=url), "auto", "cpu")
    with pytest.raises(ConfigError, match="no effect on an --endpoint run"):
        check_options(BenchOptions(endpoint=url, endpoint_gpus=1), "torch", None)
    with pytest.raises(ConfigError, match="fewer than --concurrency 8"):
        check_options(BenchOptions(concurrency=[1, 8], num_prompts=4), "auto", None)


def test_max_num_batched_tokens_checks_and_reaches_the_engine(tmp_path):
    url = "http://127.0.0.1:9"
    assert check_options(BenchOptions(max_num_batched_tokens=1024, concurrency=[1, 64], num_prompts=64), "auto",
                         None) is None
    with pytest.raises(ConfigError, match="an --endpoint server schedules its own"):
        check_options(BenchOptions(endpoint=url, endpoint_gpus=1, max_num_batched_tokens=512), "auto", None)
    for bad in (0, 16_385):
        with pytest.raises(ConfigError, match=f"--max-num-batched-tokens {bad} must be in 1..16,384"):
            check_options(BenchOptions(max_num_batched_tokens=bad), "auto", None)
    with pytest.raises(ConfigError, match="below --concurrency 64: .* pass at least 64"):
        check_options(BenchOptions(max_num_batched_tokens=32, concurrency=[8, 64], num_prompts=64), "auto", None)
    # against the default concurrency too, once it is known (4 for a small checkpoint on the CPU)
    small = Session(Options(out=str(tmp_path / "d"), profile="cpu", synthetic=True, preset="k3-tiny"))
    with pytest.raises(ConfigError, match="below the default --concurrency 4: .* pass at least 4"):
        resolve_points(small, BenchOptions(max_num_batched_tokens=2))
    assert resolve_points(small, BenchOptions(max_num_batched_tokens=4)).concurrencies == [4]
    # the session builds the engine with it (and keeps engines of different budgets apart)
    from k3rocm.runtime.engine import MAX_NUM_BATCHED_TOKENS

    s = Session(Options(out=str(tmp_path / "r"), profile="cpu", synthetic=True, preset="k3-tiny"))
    s.preflight()
    s.load()
    assert s.engine_for(max_batch=2, max_model_len=32).scheduler.max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS
    eng = s.engine_for(max_batch=2, max_model_len=32, max_num_batched_tokens=48)
    assert eng.scheduler.max_num_batched_tokens == 48 and eng.describe()["max_num_batched_tokens"] == 48


def test_defaults_follow_the_checkpoint_and_the_target(golden_ckpt):
    s = Session(Options(checkpoint=str(golden_ckpt), profile="cpu"))
    small = resolve_points(s, BenchOptions())
    assert (small.concurrencies, small.input_len, small.output_len) == ([4], 64, 16)
    big = resolve_points(s, BenchOptions(endpoint="http://127.0.0.1:9"))
    assert (big.concurrencies, big.input_len, big.output_len) == ([64], 1024, 1024)
    given = resolve_points(s, BenchOptions(concurrency=[2], input_len=8, output_len=4))
    assert (given.concurrencies, given.input_len, given.output_len) == ([2], 8, 4)
    with pytest.raises(ConfigError, match="fewer than the default --concurrency 4"):
        resolve_points(s, BenchOptions(num_prompts=2))


def test_endpoint_target_is_the_reports_endpoint_block():
    assert EndpointTarget("http://h:8000", 8, "from --endpoint-gpus", 60.0).to_dict() == \
        {"url": "http://h:8000", "gpus": 8, "gpus_source": "from --endpoint-gpus", "timeout_s": 60.0}
    assert Options().endpoint is None


def test_a_sweep_the_host_memory_cannot_hold_is_refused_before_anything_runs(monkeypatch):
    import k3rocm.validation.bench_job as BJ
    from k3rocm.errors import ConfigError
    from k3rocm.validation.bench_job import BenchOptions, BenchPoints, check_host_memory

    gb = 10 ** 9
    big = BenchPoints([1, 100_000], 64, 16)  # 1.2 M requests at the largest point: ~32 GB by the estimate
    with pytest.raises(ConfigError, match=r"--concurrency 100000: 1,200,000 requests .* lower --concurrency"):
        check_host_memory(BenchOptions(), big, available=24 * gb)
    check_host_memory(BenchOptions(), BenchPoints([64], 1024, 1024), available=24 * gb)  # the K3 default: ~0.2 GB
    check_host_memory(BenchOptions(num_prompts=10, warmups=0), big, available=24 * gb)  # few requests: fits
    # the options that set the counts are named: an explicit --warmups that is the cause, not only --concurrency
    with pytest.raises(ConfigError, match=r"1,000,000 warm-up \+ 40 measured.*lower --concurrency or --warmups$"):
        check_host_memory(BenchOptions(warmups=1_000_000), BenchPoints([4], 64, 16), available=24 * gb)
    monkeypatch.setattr(BJ, "host_memory_available", lambda: None)
    check_host_memory(BenchOptions(), big)  # memory unknown (no /proc/meminfo): no check


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the engine would step on the GPU here")
def test_a_gpu_profile_named_on_the_cpu_keeps_the_small_defaults(tmp_path):
    """--synthetic --profile mi355x-8 on a CPU machine: the engine steps on the CPU, so the defaults are the small
    ones (a 1 GB+ model at 1024/1024 x 64 would run for hours there), as the bench help says."""
    s = Session(Options(out=str(tmp_path / "r"), profile="mi355x-8", synthetic=True, preset="k3-prefix-1"))
    assert s.device == "cpu" and s.profile.backend != "cpu"
    pts = resolve_points(s, BenchOptions())
    assert (pts.concurrencies, pts.input_len, pts.output_len) == ([4], 64, 16)
