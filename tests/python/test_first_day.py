"""A platform team's first day, on the local stack: the README's examples as written, then the
rollout runbook of deploy/README.md on the API's route, `llm-api` — off, shadow, 10 %,
enforce, and back step by step — each step pushed to Envoy over ECDS as a mesh pushes a
`WasmPlugin` edit (`cargo xtask up` delivers the filter's config from the file its banner
names). At every step no caller gets a 401 or a 5xx the step should not give, and the ledger's
route and mode columns show the step."""

import concurrent.futures
import contextlib
import io
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest
import yaml

from conftest import ROOT, admin, banner_value, ledger_rows, up

MODEL = "llama-3.1-8b"
# Tenants with room for the day's traffic (the free tier's 60 requests a minute has not).
KEYS = ("wk-demo-enterprise", "wk-demo-standard")
# Requests per caller at each step: enough that a 10 % share is never drawn empty (0.9^100).
PER_CALLER = 100


@pytest.fixture(scope="module")
def stack():
    yield from up()


def readme_block(language: str) -> str:
    """The README's first code block in `language` after "## Try it"."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Try it"):]
    match = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert match, f"no {language} example in the README's Try it"
    return match.group(1)


def test_the_readme_examples_work_as_written(stack):
    _, endpoint, _ = stack
    # The examples use the default port; the test's stack runs on a free one.
    here = endpoint.removesuffix("/v1")
    curl = readme_block("sh").replace("http://127.0.0.1:8080", here).replace("\\\n", " ")
    streamed = subprocess.run(["sh", "-c", curl], capture_output=True, text=True, timeout=60)
    assert streamed.returncode == 0, streamed.stderr
    events = [line for line in streamed.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", streamed.stdout
    assert any(json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1])

    python = readme_block("python").replace("http://127.0.0.1:8080", here)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(python, "README.md", "exec"), {})
    assert printed.getvalue().strip(), "the Python example printed nothing"


def config_reloads(banner: str) -> int:
    stat = "extension_config_discovery.http_filter.weir.config_reload"
    url = f"{admin(banner)}/stats?filter={stat}&format=json"
    with urllib.request.urlopen(url) as resp:
        return sum(s.get("value", 0) for s in json.load(resp)["stats"] if s["name"] == stat)


def push(banner: str, route: dict) -> None:
    """Sets `routes.by_name.llm-api` in the filter's config file, as a runbook step edits the
    WasmPlugin, and returns once Envoy has taken the new version over ECDS."""
    path = banner_value(banner, "Filter config")
    with open(path) as f:
        config = yaml.safe_load(f)
    config["routes"]["by_name"]["llm-api"] = route
    before = config_reloads(banner)
    with open(path + ".next", "w") as f:
        yaml.safe_dump(config, f)
    os.replace(path + ".next", path)
    deadline = time.time() + 10
    while config_reloads(banner) <= before:
        assert time.time() < deadline, f"Envoy did not take {route}"
        time.sleep(0.05)


def call(endpoint: str, key: str | None, trace: str) -> tuple[int, dict, dict]:
    """One small chat completion as a caller with `key` (none: no credential) sends it;
    (status, headers, body)."""
    headers = {"content-type": "application/json", "Idempotency-Key": trace}
    if key:
        headers["authorization"] = f"Bearer {key}"
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    request = urllib.request.Request(
        f"{endpoint}/chat/completions", json.dumps(body).encode(), headers, method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def keyed_rows(banner: str, traces: list[str]) -> list[dict]:
    """The records of requests sent with a key, by their Idempotency-Key."""
    marks = ",".join("?" * len(traces))
    return ledger_rows(
        banner, f"idempotency_key IN ({marks})", tuple(traces), len(traces), within=10,
    )


def keyless_rows(banner: str, since_ms: int, count: int) -> list[dict]:
    """The records of requests sent without a key since `since_ms`: the default tenant's
    (whose callers' Idempotency-Keys weir does not carry, as they all share one tenant)."""
    return ledger_rows(
        banner, "tenant = 'anonymous' AND finished_at_ms >= ?", (since_ms,), count, within=10,
    )


# (step, the route's config, what a caller without a key gets)
RUNBOOK = [
    ("off", {"mode": "off"}, "served"),
    ("shadow", {"mode": "shadow"}, "served"),
    ("10 %", {"mode": "enforce", "rollout_percent": 10}, "some refused"),
    ("enforce", {"mode": "enforce", "rollout_percent": 100}, "refused"),
    ("back to 10 %", {"mode": "enforce", "rollout_percent": 10}, "some refused"),
    ("back to shadow", {"mode": "shadow"}, "served"),
    ("back to off", {"mode": "off"}, "served"),
]


@pytest.mark.parametrize("step,route,keyless", RUNBOOK, ids=[s for s, _, _ in RUNBOOK])
def test_each_runbook_step_pushed_over_ecds(stack, step, route, keyless):
    _, endpoint, banner = stack
    push(banner, route)
    started_ms = int(time.time() * 1000)
    callers = [*KEYS, None]
    jobs = [(key, f"day1-{uuid.uuid4().hex}") for key in callers for _ in range(PER_CALLER)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: (*job, *call(endpoint, *job)), jobs))

    for key, trace, status, headers, body in answers:
        if key:
            # A tenant with a valid key and room in its quota is served at every step.
            assert status == 200, (step, key, status, body)
            continue
        assert status in (200, 401), (step, status, body)
        if status == 401:
            assert body["error"]["code"] == "invalid_api_key", (step, body)
        elif step.endswith("shadow"):
            # Shadow mode serves it, and says what enforcement would have done.
            assert "reason=missing_api_key" in headers.get("x-weir-shadow", ""), (step, headers)
    refused = sum(status == 401 for key, _, status, _, _ in answers if key is None)
    if keyless == "served":
        assert refused == 0, step
    elif keyless == "refused":
        assert refused == PER_CALLER, step
    else:
        assert 0 < refused < PER_CALLER / 2, (step, refused)

    keyed = keyed_rows(banner, [trace for key, trace, _, _, _ in answers if key])
    served_keyless = sum(status == 200 for key, _, status, _, _ in answers if key is None)
    keyless = keyless_rows(banner, started_ms, served_keyless) if served_keyless else []
    assert len(keyless) == served_keyless, (step, len(keyless))
    rows = keyed + keyless
    assert {r["route"] for r in rows} == {"llm-api"}, step
    if "rollout_percent" in route and route["rollout_percent"] < 100:
        # The share drawn into the rollout is enforced, the rest passes as `off`.
        modes = [r["mode"] for r in keyed]
        assert set(modes) == {"enforce", "off"}, (step, set(modes))
        assert 0 < modes.count("enforce") < len(modes) / 2, (step, modes.count("enforce"))
        # A keyless caller was served only when drawn outside the rollout.
        assert {r["mode"] for r in keyless} <= {"off"}, step
    else:
        assert {r["mode"] for r in rows} == {route["mode"]}, step
    assert {r["tenant"].split("/")[0] for r in keyed} == {"acme", "globex"}, step
