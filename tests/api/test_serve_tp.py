"""``hicache serve --tp-size 2`` (real rank processes, gloo, CPU): it answers
``/v1/completions`` as TP 1 does; a rank killed while serving turns ``/health`` 503 naming
the rank and the server exits non-zero; a bad ``--tp-size`` or a join that times out is
one line naming it, exit code 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from tests.api.test_serve_startup import main_here
from tests.helpers.engine_fixtures import engine_model

HICACHE = [sys.executable, "-m", "hicache.cli"]
TINY = ["--model-path", "tiny-random-llama", "--device", "cpu", "--dtype", "float32"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_pids(server_pid: int) -> list[int]:
    """The server's spawned rank processes (not multiprocessing's resource tracker)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and "spawn_main" in cmdline:
            out.append(int(entry.name))
    return out


def running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_serve_tp2_answers_and_a_dead_rank_stops_it() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*HICACHE, "serve", *TINY, "--tp-size", "2", "--port", str(port), "--page-size", "4"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail(f"the server did not start: {proc.stderr.read() if proc.stderr else ''}")
        ids = [5, 17, 29, 3, 41, 8, 12, 99, 7]
        body = {"model": "tiny-random-llama", "prompt": ids, "max_tokens": 5, "temperature": 0}
        body["ignore_eos"] = True
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        config = EngineConfig(
            model_path="tiny-random-llama",
            dtype="float32",
            device="cpu",
            cache=CacheConfig(page_size=4, device_tokens=16384),
        )
        with Engine(config, loaded=engine_model("tiny-random-llama")) as tp1:
            want = tp1.generate(ids, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert got.json()["choices"][0]["text"] == want.text
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        # /health answers 503 naming the rank until the server has exited (it may exit
        # before a probe lands: the exit code and its line are the check then)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(f"{base}/health", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            if health.status_code == 503:  # before rank 1's exit is seen, rank 0 says
                # its collective failed (the reset of rank 1's socket); then it names rank 1
                assert "rank 1" in health.text or (
                    "rank 0 stopped" in health.text and "stopping the ranks" in health.text
                ), health.text
            time.sleep(0.05)
        code = proc.wait(timeout=60)
        err = proc.stderr.read() if proc.stderr else ""
        assert code == 1, err
        assert f"hicache serve: error: rank 1 (pid {ranks[0]}) exited with code -9" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("argv", "needle", "here"),
    [
        (["--tp-size", "3"], "--tp-size 3 is invalid", True),
        (["--tp-size", "0"], "--tp-size 0 is invalid", True),
        (["--tp-size", "2", "--dist-init-timeout", "0"], "--dist-init-timeout 0", True),
        (
            ["--tp-size", "2", "--dist-init-timeout", "0.001"],
            "--tp-size 2: rank 1 did not join the process group within 0.001 s",
            False,
        ),
    ],
)
def test_bad_tp_flags_are_one_line(argv: list[str], needle: str, here: bool) -> None:
    """``here``: a flag refused before any rank starts, checked through
    :func:`hicache.cli.main` in this process (as test_serve_startup's bad flags); the
    start whose rank does not join runs as ``python -m hicache.cli``."""
    if here:
        code, stderr = main_here(["serve", *TINY, *argv])
    else:
        r = subprocess.run(
            [*HICACHE, "serve", *TINY, *argv], capture_output=True, text=True, timeout=180, env=ENV
        )
        code, stderr = r.returncode, r.stderr
    assert code == 2, stderr
    errors = [ln for ln in stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and needle in errors[0], stderr
    assert "Traceback" not in stderr


def test_followers_exit_when_rank_0_dies() -> None:
    """SIGKILL the server (rank 0): its follower's next exchange fails and it exits."""
    port = free_port()
    proc = subprocess.Popen(
        [*HICACHE, "serve", *TINY, "--tp-size", "2", "--port", str(port)],
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("the server did not start")
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 1, ranks
        proc.kill()
        proc.wait(timeout=30)
        gone = time.monotonic() + 30
        while running(ranks[0]) and time.monotonic() < gone:
            time.sleep(0.1)
        if running(ranks[0]):
            os.kill(ranks[0], signal.SIGKILL)
            pytest.fail("rank 1 did not exit within 30 s of rank 0's death")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
