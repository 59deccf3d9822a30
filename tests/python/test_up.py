"""`cargo xtask up` as a user runs it: start it, follow the README, press Ctrl-C.

The stack: Envoy with the weir filter -> weir-sidecar -> two simulated replicas."""

import os
import re
import signal
import subprocess
import time

import pytest
from openai import OpenAI

from conftest import ROOT


def session_processes(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "sid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[0] == str(sid)]


@pytest.fixture(scope="module")
def stack():
    # A new session, like a terminal's foreground job, so Ctrl-C can be sent to all of it.
    proc = subprocess.Popen(
        ["cargo", "xtask", "up", "--port", "0", "--time-scale", "20"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    banner, endpoint = [], None
    deadline = time.time() + 900  # a fresh clone builds the release simulator first
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        banner.append(line)
        match = re.search(r"OpenAI endpoint\s+(http://\S+/v1)", line)
        endpoint = endpoint or (match and match.group(1))
        if "Ctrl-C stops everything" in line:
            break
    if not endpoint:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("cargo xtask up printed no endpoint:\n" + "".join(banner))
    yield proc, endpoint, "".join(banner)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


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


def test_ctrl_c_leaves_no_process_behind(stack):
    proc, _, _ = stack
    sid = os.getsid(proc.pid)
    running = session_processes(sid)
    assert sum("weir-sim" in p for p in running) == 2, running
    assert any("weir-sidecar" in p for p in running), running
    assert any("envoy" in p for p in running), running
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=30)
    for _ in range(100):
        if not session_processes(sid):
            break
        time.sleep(0.1)
    assert session_processes(sid) == []
