"""Fixtures that start weir's real binaries on loopback for the SDK tests."""

import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]


def binary(name: str) -> str:
    """A workspace binary, built by `cargo xtask test` before pytest runs."""
    path = Path(os.environ.get("WEIR_TARGET_DIR", ROOT / "target")) / "debug" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `cargo xtask test`, which builds it first")
    return str(path)


@pytest.fixture(scope="module")
def sim():
    """A tiny-preset simulator, time-scaled, on a free port; yields its base URL."""
    proc = subprocess.Popen(
        [binary("weir-sim"), "--port", "0", "--preset", "tiny", "--time-scale", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    banner = proc.stdout.readline()
    match = re.search(r"http://(\S+)", banner)
    if not match:
        proc.kill()
        pytest.fail(f"no address in banner {banner!r}")
    yield f"http://{match.group(1)}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def client(sim):
    return OpenAI(base_url=f"{sim}/v1", api_key="unused", max_retries=0)


def session_processes(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "sid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[0] == str(sid)]


def up(*extra: str):
    """Runs `cargo xtask up` (`extra` its further flags) until the banner is printed; yields
    (process, OpenAI endpoint, banner) and kills what is left at the end."""
    # A new session, like a terminal's foreground job, so Ctrl-C can be sent to all of it.
    proc = subprocess.Popen(
        ["cargo", "xtask", "up", "--port", "0", "--time-scale", "20", *extra],
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


def banner_value(banner: str, label: str) -> str:
    match = re.search(rf"{label}\s+(\S+)", banner)
    assert match, f"{label} not in the banner"
    return match.group(1)


def admin(banner: str) -> str:
    """The gateway Envoy's admin URL."""
    return banner_value(banner, "Gateway metrics").removesuffix("/stats/prometheus")


def ledger_rows(banner: str, where: str, args: tuple, count: int, within: float) -> list[dict]:
    """The sidecar's ledger records matching `where`, once `count` of them are written (waiting
    up to `within` seconds)."""
    path = banner_value(banner, "Usage ledger")
    rows: list = []
    deadline = time.time() + within
    while time.time() < deadline:
        with sqlite3.connect(path) as conn:
            conn.row_factory = sqlite3.Row
            rows = conn.execute(f"SELECT * FROM usage WHERE {where}", args).fetchall()
        if len(rows) >= count:
            return [dict(r) for r in rows]
        time.sleep(0.05)
    pytest.fail(f"{count - len(rows)} of {count} ledger records not written ({where}: {args})")


def ledger_row(banner: str, idempotency_key: str) -> dict:
    """The sidecar's ledger record of an idempotency key, once written."""
    rows = ledger_rows(banner, "idempotency_key = ?", (idempotency_key,), 1, within=5)
    assert len(rows) == 1, rows
    return rows[0]


