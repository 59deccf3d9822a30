"""`cargo xtask up` as a user runs it: start it, follow the README, press Ctrl-C.

The stack: Envoy with the weir filter -> weir-sidecar -> two simulated replicas."""

import json
import os
import re
import signal
import time
import urllib.request
import uuid

import anthropic
import openai
import pytest
from openai import OpenAI

from conftest import admin, banner_value, ledger_row, session_processes, up


@pytest.fixture(scope="module")
def stack():
    yield from up("--observe")


def test_readme_example_streams_through_the_stack(stack):
    _, endpoint, banner = stack
    assert "wk-demo-standard" in banner
    client = OpenAI(base_url=endpoint, api_key="wk-demo-standard", max_retries=0)
    stream = client.chat.completions.create(
        model="llama-3.1-8b", stream=True, max_tokens=16,
        messages=[{"role": "user", "content": "Hello!"}],
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()
    reply = client.chat.completions.create(
        model="llama-3.1-8b", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
    )
    assert reply.usage.completion_tokens <= 4
    with pytest.raises(Exception) as denied:
        OpenAI(base_url=endpoint, api_key="wk-not-a-key", max_retries=0).models.list()
    assert getattr(denied.value, "status_code", None) == 401


MODEL = "llama-3.1-8b"


def access_log(banner: str, trace: str) -> dict:
    """The `name=value` fields of the access-log line of a trace id, once written."""
    path = banner_value(banner, "Access log")
    for _ in range(100):
        with open(path) as log:
            lines = [line for line in log if f"id={trace} " in line]
        if lines:
            return dict(f.split("=", 1) for f in lines[0].split() if "=" in f)
        time.sleep(0.05)
    pytest.fail(f"no access-log line for {trace}")


def gateway_tokens(banner: str) -> tuple[int, int]:
    """What the filter has settled so far, input and output tokens (Envoy's stats)."""
    url = admin(banner) + "/stats?filter=weir.tokens&format=json"
    stats = json.load(urllib.request.urlopen(url))["stats"]
    value = {s["name"].rsplit(".", 1)[-1]: s["value"] for s in stats if "value" in s}
    return value.get("input", 0), value.get("output", 0)


def billed_as_reported(banner, trace, api, usage):
    """The ledger, the access log and the filter's settlement all hold the engine's figures."""
    row = ledger_row(banner, trace)
    assert (row["api"], row["prompt_tokens"], row["completion_tokens"], row["source"]) == (
        api, usage[0], usage[1], "engine",
    ), row
    log = access_log(banner, trace)
    assert (log["api"], int(log["tokens_in"]), int(log["tokens_out"])) == (api, *usage), log


def ids(trace: str) -> dict:
    return {"Idempotency-Key": trace, "x-request-id": trace}


def test_the_openai_sdk_streams_a_responses_call_billed_as_the_engine_counts(stack):
    _, endpoint, banner = stack
    client = OpenAI(base_url=endpoint, api_key="wk-demo-standard", max_retries=0)
    trace = f"sdk-responses-{uuid.uuid4().hex}"
    before = gateway_tokens(banner)
    events = list(client.responses.create(
        model=MODEL, stream=True, max_output_tokens=24, extra_headers=ids(trace),
        instructions="Answer in one line.", input="What does a gateway meter?",
    ))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip()
    usage = events[-1].response.usage
    assert usage.output_tokens == len([k for k in kinds if k == "response.output_text.delta"])
    billed_as_reported(banner, trace, "responses", (usage.input_tokens, usage.output_tokens))
    after = gateway_tokens(banner)
    assert (after[0] - before[0], after[1] - before[1]) == (usage.input_tokens, usage.output_tokens)


def test_the_openai_sdk_streams_a_chat_call_with_tool_calls(stack):
    _, endpoint, banner = stack
    client = OpenAI(base_url=endpoint, api_key="wk-demo-standard", max_retries=0)
    trace = f"sdk-tools-{uuid.uuid4().hex}"
    tools = [{"type": "function", "function": {
        "name": "lookup_order", "description": "Find an order by its id",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    }}]
    chunks = list(client.chat.completions.create(
        model=MODEL, stream=True, max_tokens=256, tools=tools, extra_headers=ids(trace),
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Where is order 42?"}],
    ))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "lookup_order"
    arguments = json.loads("".join(tc.function.arguments or "" for tc in calls))
    assert isinstance(arguments, dict)
    # A call the model finished, or one its output limit cut (its arguments still close).
    assert chunks[-2].choices[0].finish_reason in ("tool_calls", "length")
    usage = chunks[-1].usage
    billed_as_reported(banner, trace, "chat_completions", (usage.prompt_tokens, usage.completion_tokens))


def test_the_anthropic_sdk_streams_a_messages_call_with_its_api_key_header(stack):
    _, endpoint, banner = stack
    client = anthropic.Anthropic(
        base_url=endpoint.removesuffix("/v1"), api_key="wk-demo-standard", max_retries=0,
    )
    trace = f"sdk-messages-{uuid.uuid4().hex}"
    with client.messages.stream(
        model=MODEL, max_tokens=24, extra_headers=ids(trace), system="Be brief.",
        messages=[{"role": "user", "content": "Say hello."}],
    ) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text.strip() and message.stop_reason in ("end_turn", "max_tokens")
    u = message.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    billed_as_reported(banner, trace, "messages", (prompt, u.output_tokens))


def test_embeddings_for_a_batch_of_32_strings_bill_their_input(stack):
    _, endpoint, banner = stack
    client = OpenAI(base_url=endpoint, api_key="wk-demo-standard", max_retries=0)
    trace = f"sdk-embeddings-{uuid.uuid4().hex}"
    inputs = [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(32)]
    result = client.embeddings.create(model=MODEL, input=inputs, extra_headers=ids(trace))
    assert [d.index for d in result.data] == list(range(32))
    assert result.usage.prompt_tokens > 32 * 10
    billed_as_reported(banner, trace, "embeddings", (result.usage.prompt_tokens, 0))


def sdk_calls(endpoint: str, key: str) -> dict:
    """One call of each API, by name, taking the output limit to ask for."""
    client = OpenAI(base_url=endpoint, api_key=key, max_retries=0)
    # An explicit timeout: without one the SDK refuses, itself, a non-streamed call whose
    # max_tokens may take over ten minutes (the over-context case asks for 200,000).
    claude = anthropic.Anthropic(
        base_url=endpoint.removesuffix("/v1"), api_key=key, max_retries=0, timeout=60,
    )
    hi = [{"role": "user", "content": "hi"}]
    return {
        "chat": lambda n: client.chat.completions.create(model=MODEL, messages=hi, max_tokens=n),
        "responses": lambda n: client.responses.create(model=MODEL, input="hi", max_output_tokens=n),
        "messages": lambda n: claude.messages.create(model=MODEL, messages=hi, max_tokens=n),
        "embeddings": lambda _: client.embeddings.create(model=MODEL, input="hi"),
    }


SDK_OF = {"chat": openai, "responses": openai, "messages": anthropic, "embeddings": openai}


def test_each_sdk_raises_its_own_typed_errors(stack):
    _, endpoint, _ = stack
    generating = ["chat", "responses", "messages"]
    standard = sdk_calls(endpoint, "wk-demo-standard")
    free = sdk_calls(endpoint, "wk-demo-free")
    for api in generating:
        sdk = SDK_OF[api]
        # Over the model's context (131,072 tokens).
        with pytest.raises(sdk.BadRequestError) as over_context:
            standard[api](200_000)
        assert "context" in str(over_context.value), api
        # Over the free tier's 1,024 output tokens per request.
        with pytest.raises(sdk.BadRequestError) as over_cap:
            free[api](2_000)
        assert "1024" in str(over_cap.value), api
    # Over quota: one prompt larger than the free tier's 60,000 input tokens a minute is let
    # through from the full bucket (the example's free tier sets `oversize: debt`; the default
    # refuses it as request_too_large) and leaves a debt; every API after it gets a 429.
    huge = "the quick brown fox jumps over the lazy dog " * 7_000
    OpenAI(base_url=endpoint, api_key="wk-demo-free", max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": huge}],
    )
    for api, call in free.items():
        sdk = SDK_OF[api]
        with pytest.raises(sdk.RateLimitError) as limited:
            call(16)
        headers = limited.value.response.headers
        assert int(headers["retry-after"]) >= 1, api
        prefix = "anthropic-ratelimit-input-tokens" if api == "messages" else "x-ratelimit"
        assert any(h.startswith(prefix) for h in headers), (api, dict(headers))


def test_observe_runs_prometheus_scraping_every_part_of_the_stack(stack):
    _, _, banner = stack
    match = re.search(r"Prometheus\s+(http://\S+)", banner)
    assert match, banner
    # The first scrapes come within a scrape interval (5 s) of the start.
    deadline, health = time.time() + 30, {}
    while time.time() < deadline:
        with urllib.request.urlopen(match.group(1) + "/api/v1/targets") as resp:
            targets = json.load(resp)["data"]["activeTargets"]
        health = {}
        for t in targets:
            health.setdefault(t["labels"]["job"], []).append(t["health"])
        jobs = ("weir-sidecar", "weir-envoy", "weir-engine")
        if all(health.get(job) and set(health[job]) == {"up"} for job in jobs):
            break
        time.sleep(1)
    assert health.get("weir-sidecar") == ["up"], health
    assert health.get("weir-envoy") == ["up"], health
    assert health.get("weir-engine") == ["up", "up"], health


def test_ctrl_c_leaves_no_process_behind(stack):
    proc, _, _ = stack
    sid = os.getsid(proc.pid)
    running = session_processes(sid)
    assert sum("weir-sim" in p for p in running) == 2, running
    assert any("weir-sidecar" in p for p in running), running
    assert any("envoy" in p for p in running), running
    assert any("prometheus" in p for p in running), running
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=30)
    for _ in range(100):
        if not session_processes(sid):
            break
        time.sleep(0.1)
    assert session_processes(sid) == []
