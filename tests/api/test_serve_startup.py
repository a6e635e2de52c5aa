"""``hicache serve`` start-up: a bad flag is one line naming the flag, the value and what is
accepted, exit code 2, no traceback (unless ``--log-level debug``); a good start logs one
INFO line with the model, dtype, device, tiers and address."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

HICACHE = [sys.executable, "-m", "hicache.cli"]
TINY = ["--model-path", "tiny-random-llama", "--device", "cpu"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [*HICACHE, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CASES = [
    (["serve", "--device", "foo"], "--device", "foo"),
    (["serve", "--model-path", "/no/such/model"], "--model-path", "/no/such/model"),
    (["serve", "--port", "70000"], "--port", "70000"),
    (["serve", "--hicache-ratio", "inf"], "--hicache-ratio", "inf"),
    (
        ["serve", "--hicache-storage-negative-ttl", "nan"],
        "--hicache-storage-negative-ttl",
        "nan",
    ),
    (["serve", "--hicache-storage-negative-ttl", "-1"], "--hicache-storage-negative-ttl", "-1"),
    (["serve", "--hicache-storage-negative-ttl", "inf"], "--hicache-storage-negative-ttl", "inf"),
    (["serve", *TINY, "--hicache-ratio", "0.5"], "--hicache-ratio", "0.5"),
    (
        ["serve", *TINY, "--unhealthy-after-failed-steps", "0"],
        "--unhealthy-after-failed-steps",
        "0",
    ),
    (
        ["serve", "--hicache-storage-backend-extra-config", '{"a": 1}'],
        "--hicache-storage-backend-extra-config",
        "--hicache-storage-backend",
    ),
    (["serve", "--log-level", "loud"], "--log-level", "loud"),
    (["serve", "--grpc-port", "40000"], "--grpc-port", "--grpc-mode"),
    (["serve", "--grpc-mode", "--port", "60000"], "--grpc-port", "70000"),
    (["serve", "--grpc-mode", "--port", "30001", "--grpc-port", "30001"], "--grpc-port", "30001"),
    (["serve", *TINY, "--metrics-require-api-key"], "--metrics-require-api-key", "--api-key"),
    (["serve", "--mamba-track-interval", "0"], "--mamba-track-interval", "0"),
    (["serve", "--swa-full-tokens-ratio", "0"], "--swa-full-tokens-ratio", "0"),
    (
        ["serve", "--hicache-write-back-threshold", "1.5"],
        "--hicache-write-back-threshold",
        "1.5",
    ),
    (
        [
            "serve",
            *TINY,
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "redis",
            "--hicache-storage-backend-extra-config",
            '{"url": "redis://127.0.0.1:1"}',
        ],
        "--hicache-storage-backend",
        "redis",
    ),
    (
        [
            "serve",
            *TINY,
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "file",
            "--hicache-storage-backend-extra-config",
            json.dumps({"file_path": "/proc/no/dir"}),
        ],
        "--hicache-storage-backend",
        "/proc/no/dir",
    ),
    # an empty key would refuse every request: refused at start
    (["serve", "--api-key", ""], "--api-key", "''"),
    (["serve", "--admin-api-key", ""], "--admin-api-key", "''"),
    # prefill/decode disaggregation
    (
        ["serve", "--disaggregation-decode-enable-offload-kvcache"],
        "--disaggregation-decode-enable-offload-kvcache",
        "--disaggregation-mode decode",
    ),
    (["serve", "--disaggregation-mode", "decode", "--tp-size", "2"], "--tp-size", "2"),
    (
        [
            "serve",
            "--disaggregation-mode",
            "decode",
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "file",
        ],
        "--disaggregation-decode-enable-offload-kvcache",
        "False",
    ),
    (
        [
            "serve",
            "--disaggregation-mode",
            "decode",
            "--disaggregation-decode-enable-offload-kvcache",
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "file",
            "--hicache-write-policy",
            "write_back",
        ],
        "--hicache-write-policy",
        "write_back",
    ),
    (["serve", "--disaggregation-mode", "both"], "--disaggregation-mode", "both"),
    (["serve", "--disaggregation-mode", "prefill", "--host", "0.0.0.0"], "--host", "0.0.0.0"),
    (
        ["serve", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-key", ""],
        "--disaggregation-bootstrap-key",
        "empty key",
    ),
    (
        ["serve", "--disaggregation-mode", "decode", "--disaggregation-bootstrap-allow", "a b"],
        "--disaggregation-bootstrap-allow",
        "'a b'",
    ),
    (
        ["serve", "--disaggregation-mode", "decode", "--disaggregation-max-links", "0"],
        "--disaggregation-max-links",
        "0",
    ),
]


@pytest.mark.parametrize(
    ("argv", "flag", "value"), CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)]
)
def test_bad_flag_is_one_line(argv: list[str], flag: str, value: str) -> None:
    """Through :func:`hicache.cli.main` in this process: the same parsing, checks and
    start-up as ``python -m hicache.cli``, less an interpreter and torch's import per case
    (about 2 s each). A traceback would be an exception here; the process-level exit code
    and stderr are the subprocess tests' below (port in use, CUDA, debug, the INFO line)."""
    code, stderr = main_here(argv)
    assert code == 2, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1, stderr
    assert flag in errors[0] and value in errors[0], errors[0]
    assert "Traceback" not in stderr


def main_here(argv: list[str]) -> tuple[int | str | None, str]:
    """:func:`hicache.cli.main` on ``argv`` in this process: its exit code (argparse's
    refusals exit, 2) and what it wrote to stderr."""
    from hicache import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code: int | str | None = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


def test_cuda_without_cuda_is_refused() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    r = run("serve", "--device", "cuda")
    assert r.returncode == 2 and "--device" in r.stderr and "CUDA" in r.stderr
    assert "Traceback" not in r.stderr


def test_debug_shows_the_traceback() -> None:
    r = run(
        "--log-level",
        "debug",
        "serve",
        *TINY,
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "redis",
        "--hicache-storage-backend-extra-config",
        '{"url": "redis://127.0.0.1:1"}',
    )
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_log_level_is_under_serve_help() -> None:
    r = run("serve", "--help")
    assert r.returncode == 0
    for flag in ("--log-level", "--api-key", "--max-request-bytes", "--admin-api-key"):
        assert flag in r.stdout, flag


def test_start_logs_one_info_line() -> None:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    names = ["--served-model-name", "tiny", "--served-model-alias", "smol"]
    names += ["--served-model-alias", "small"]
    proc = subprocess.Popen(
        [*HICACHE, "serve", *TINY, "--port", str(port), "--log-level", "info", *names],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not start")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny", "smol", "small"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    line = next(ln for ln in err.splitlines() if "serving" in ln)
    for part in (
        "INFO",
        "tiny-random-llama",
        "float32",
        "cpu",
        "L1",
        "L2",
        "L3",
        f"127.0.0.1:{port}",
    ):
        assert part in line, (part, line)


def test_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("serve", *TINY, "--port", str(port))
    assert r.returncode == 2 and "--port" in r.stderr and "Traceback" not in r.stderr


def test_grpc_port_in_use_is_one_line() -> None:
    """``--grpc-mode``: a gRPC port in use fails the start before the model loads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("serve", *TINY, "--port", str(free_port()), "--grpc-mode", f"--grpc-port={port}")
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "--grpc-port" in errors[0] and str(port) in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bootstrap_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run(
            "serve",
            *TINY,
            "--port",
            str(free_port()),
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(port),
        )
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, r.stderr
    assert f"--disaggregation-bootstrap-port {port}" in errors[0], errors[0]
    assert "Address already in use" in errors[0] and "Traceback" not in r.stderr


def test_hybrid_flags_reach_the_cache_config() -> None:
    from hicache.cli import build_parser
    from hicache.server.args import engine_config_from_args

    args = build_parser().parse_args(
        ["serve", "--max-mamba-cache-size", "3", "--mamba-full-memory-ratio", "0.5",
         "--mamba-track-interval", "32", "--swa-full-tokens-ratio", "0.25"]
    )  # fmt: skip
    cache = engine_config_from_args(args).cache
    assert (cache.max_mamba_cache_size, cache.mamba_full_memory_ratio) == (3, 0.5)
    assert cache.mamba_track_interval == 32 and cache.swa_full_tokens_ratio == 0.25


def test_the_http_port_is_held_while_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hicache serve`` listens on ``--port`` before it loads the model and hands that
    socket to uvicorn: nothing can take the port between the check and the serving (it
    could, and the server then died after loading with uvicorn's raw ``Errno 98``). A start
    that fails afterwards gives the port back."""
    from hicache import cli

    port = free_port()
    probes: list[str] = []

    def loading(args: object) -> object:  # stands for the model's load, then fails
        with socket.socket() as other:  # another server starting on the same port
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                other.bind(("127.0.0.1", port))
                other.listen()
                probes.append("taken by another")
            except OSError as exc:
                probes.append(f"held: {exc.strerror}")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            probes.append("listening")
        raise cli.StartupError("the model could not load")

    monkeypatch.setattr(cli, "_start_engine", loading)
    args = cli.build_parser().parse_args(["serve", *TINY, "--port", str(port)])
    with pytest.raises(cli.StartupError, match="could not load"):
        cli._serve(args)
    assert probes == ["held: Address already in use", "listening"], probes
    with socket.socket() as after:  # given back
        after.bind(("127.0.0.1", port))
