"""Fixtures that start weir's real binaries on loopback for the SDK tests."""

import os
import re
import subprocess
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
