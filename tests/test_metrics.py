"""`/metrics` as a scraper reads it: prometheus text over HTTP, parsed by prometheus_client's
parser, moving as real clients send requests through the real engine (scripted model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
from prometheus_client.parser import text_string_to_metric_families

from turbospark import metrics
from turbospark.ratecontrol import FileTemperature, RateControl
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer, free_port

Families = dict[str, Any]


def scrape(url: str) -> Families:
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def value(families: Families, sample: str, **labels: str) -> float | None:
    """One sample's value by its full name (`x_total`, `x_count`, `x_bucket`), None if absent."""
    for family in families.values():
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return float(s.value)
    return None


def moved(before: Families, after: Families, sample: str, **labels: str) -> float:
    now = value(after, sample, **labels)
    assert now is not None, f"{sample}{labels} missing from /metrics"
    return now - (value(before, sample, **labels) or 0.0)


REPLY = "Metrics move when tokens do."


def test_one_streamed_request_moves_tokens_latencies_and_engine_state() -> None:
    model = "metrics-one"
    with LiveServer([ScriptedChatModel([REPLY], model_id=model)]) as srv:
        before = scrape(srv.url)
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "count me"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
        after = scrape(srv.url)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY

    assert moved(before, after, "turbospark_requests_total", api="openai", status="200") == 1
    assert moved(before, after, "turbospark_prompt_tokens_total", model=model) == usage.prompt_tokens
    assert moved(before, after, "turbospark_generation_tokens_total", model=model) == usage.completion_tokens
    # every token but the first has an inter-token gap; one TTFT and one end-to-end per request
    assert moved(before, after, "turbospark_time_to_first_token_seconds_count", model=model) == 1
    itl = moved(before, after, "turbospark_inter_token_latency_seconds_count", model=model)
    assert itl == usage.completion_tokens - 1
    assert moved(before, after, "turbospark_e2e_request_latency_seconds_count", model=model) == 1
    e2e_inf = value(after, "turbospark_e2e_request_latency_seconds_bucket", model=model, le="+Inf")
    assert e2e_inf == 1
    assert moved(before, after, "turbospark_engine_requests_total", model=model, finish_reason="stop") == 1
    # the forward fed the whole prompt (no prefix hit on a first request) and every generated
    # token, the last one included: the end-of-turn token was sampled after it
    fed = moved(before, after, "turbospark_forward_tokens_total", model=model)
    assert fed == usage.prompt_tokens + usage.completion_tokens

    assert value(after, "turbospark_running_sequences", model=model) == 0
    assert value(after, "turbospark_waiting_sequences", model=model) == 0
    capacity = value(after, "turbospark_kv_blocks_capacity", model=model)
    used = value(after, "turbospark_kv_blocks_used", model=model)
    assert capacity is not None and capacity > 0 and used == 0
    assert value(after, "turbospark_preemptions_total", model=model) == 0
    steps = value(after, "turbospark_engine_steps_total", model=model)
    assert steps is not None and steps >= usage.completion_tokens
    forward = value(after, "turbospark_engine_step_seconds_total", model=model, part="forward")
    overhead = value(after, "turbospark_engine_step_seconds_total", model=model, part="overhead")
    assert forward is not None and forward > 0 and overhead is not None and overhead > 0


def test_prefix_cache_hits_are_the_cached_tokens_usage_reports() -> None:
    model = "metrics-prefix"
    long_prompt = "A shared system prompt that spans several KV blocks of sixteen tokens each. " * 4
    messages = [{"role": "system", "content": long_prompt}, {"role": "user", "content": "again"}]
    with LiveServer([ScriptedChatModel([REPLY], model_id=model)]) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            client.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
            before = scrape(srv.url)
            second = client.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
        after = scrape(srv.url)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 16
    assert moved(before, after, "turbospark_prefix_cache_hit_tokens_total", model=model) == cached


def test_requests_are_counted_by_api_and_status() -> None:
    model = "metrics-apis"
    with LiveServer([ScriptedChatModel([REPLY], model_id=model)]) as srv:
        before = scrape(srv.url)
        with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0) as claude:
            claude.messages.create(model=model, max_tokens=64, messages=[{"role": "user", "content": "hi"}])
        with ollama.Client(host=srv.url) as local:
            local.chat(model=model, messages=[{"role": "user", "content": "hi"}])
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            client.responses.create(model=model, input="hi")
            bad = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": model}, timeout=30)
            httpx.get(f"{srv.url}/health", timeout=30)
        after = scrape(srv.url)
    assert 400 <= bad.status_code < 500
    assert moved(before, after, "turbospark_requests_total", api="anthropic", status="200") == 1
    assert moved(before, after, "turbospark_requests_total", api="ollama", status="200") == 1
    assert moved(before, after, "turbospark_requests_total", api="responses", status="200") == 1
    assert moved(before, after, "turbospark_requests_total", api="openai", status=str(bad.status_code)) == 1
    apis = {s.labels["api"] for s in after["turbospark_requests"].samples}
    assert apis <= {"openai", "responses", "anthropic", "ollama"}  # /health and /metrics are not counted
    assert moved(before, after, "turbospark_engine_requests_total", model=model, finish_reason="stop") == 3


def test_api_of_path() -> None:
    assert metrics.api_of("/v1/chat/completions") == "openai"
    assert metrics.api_of("/v1/completions") == "openai"
    assert metrics.api_of("/v1/embeddings") == "openai"
    assert metrics.api_of("/v1/responses") == "responses"
    assert metrics.api_of("/v1/responses/resp_1") == "responses"
    assert metrics.api_of("/v1/messages") == "anthropic"
    assert metrics.api_of("/v1/messages/count_tokens") == "anthropic"
    assert metrics.api_of("/api/chat") == "ollama"
    assert metrics.api_of("/v1/chat/completionsx") is None
    assert metrics.api_of("/health") is None
    assert metrics.api_of("/metrics") is None


def test_temperature_stepping_up_lowers_the_cap_in_metrics(tmp_path: Path) -> None:
    sensor = tmp_path / "temp"
    sensor.write_text("50\n")
    # poll_interval 0: every scrape takes a fresh reading, so the test needs no waiting
    rate = RateControl(
        200, thermal_steps=[(70, 20), (80, 5)], temperature=FileTemperature(sensor), poll_interval=0.0
    )
    metrics.watch_rate(rate)
    seen = []
    with LiveServer([ScriptedChatModel([REPLY], model_id="metrics-thermal", rate=rate)]) as srv:
        for reading in ("50", "72.5", "85000", "60"):  # sysfs-style millidegrees too
            sensor.write_text(reading + "\n")
            families = scrape(srv.url)
            seen.append(
                (
                    value(families, "turbospark_temperature_celsius", source=f"file:{sensor}"),
                    value(families, "turbospark_decode_rate_cap_tokens_per_second"),
                )
            )
    assert seen == [(50.0, 200.0), (72.5, 20.0), (85.0, 5.0), (60.0, 200.0)]


def test_served_process_exports_its_rate_control(tmp_path: Path) -> None:
    """`turbospark serve` registers the process's RateControl: the flags show in /metrics."""
    sensor = tmp_path / "temp"
    sensor.write_text("81\n")
    port = free_port()
    src = Path(__file__).resolve().parent.parent / "src"
    args = ["--model", "scripted", "--max-decode-rate", "500", "--thermal-steps", "70:20,80:5"]
    args += ["--thermal-source", f"file:{sensor}", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "turbospark", "serve", *args],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        from test_cli import wait_healthy

        wait_healthy(url, proc)
        families = scrape(url)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()
    assert value(families, "turbospark_temperature_celsius", source=f"file:{sensor}") == 81.0
    assert value(families, "turbospark_decode_rate_cap_tokens_per_second") == 5.0
