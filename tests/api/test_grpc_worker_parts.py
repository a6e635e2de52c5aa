"""The gRPC worker's parts that need no server: which key each RPC needs (as over HTTP),
and the tokenizer bundle ``GetTokenizer`` streams. The worker itself, behind the real
smg: ``tests/router/test_smg_grpc.py``."""

from __future__ import annotations

import hashlib
import io
import shutil
import zipfile
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from transformers import AutoTokenizer

from hicache.runner.checkpoints import resolve_checkpoint
from hicache.server.grpc_worker.keys import RPC_ACCESS, GrpcKeys
from hicache.server.grpc_worker.servicer import SchedulerServicer
from hicache.server.grpc_worker.tokenizer_bundle import tokenizer_bundle

KEYS = GrpcKeys(api_key="inference-key", admin_api_key="admin-key")


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_every_rpc_served_has_a_key_decision() -> None:
    base = pb_grpc.SglangSchedulerServicer
    served = {n for n in vars(SchedulerServicer) if n in vars(base) and not n.startswith("_")}
    assert served == set(RPC_ACCESS)


@pytest.mark.parametrize("rpc", ["Generate", "Abort", "GetModelInfo", "GetTokenizer"])
def test_inference_rpcs_need_the_api_key(rpc: str) -> None:
    for metadata in ([], _auth("wrong"), _auth("admin-key")):
        denied = KEYS.check(rpc, metadata)
        assert denied is not None and denied.code is grpc.StatusCode.UNAUTHENTICATED
        assert denied.message.startswith(f"{rpc}: API key missing or wrong")
    assert KEYS.check(rpc, _auth("inference-key")) is None
    assert GrpcKeys().check(rpc, []) is None  # no --api-key: open


def test_flush_needs_the_admin_key_and_is_refused_without_one() -> None:
    assert KEYS.check("FlushCache", _auth("admin-key")) is None
    denied = KEYS.check("FlushCache", _auth("inference-key"))
    assert denied is not None and denied.code is grpc.StatusCode.UNAUTHENTICATED
    none = GrpcKeys(api_key="inference-key").check("FlushCache", _auth("inference-key"))
    assert none is not None and none.code is grpc.StatusCode.PERMISSION_DENIED


def test_health_is_open_and_loads_open_unless_metrics_need_the_key() -> None:
    assert KEYS.check("HealthCheck", []) is None
    assert KEYS.check("GetLoads", []) is None
    strict = GrpcKeys(api_key="inference-key", metrics_require_api_key=True)
    denied = strict.check("GetLoads", [])
    assert denied is not None and denied.code is grpc.StatusCode.UNAUTHENTICATED
    assert strict.check("GetLoads", [("Authorization", b"Bearer inference-key")]) is None


def _unzip(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def test_bundle_holds_the_model_dirs_tokenizer_files() -> None:
    model = resolve_checkpoint("tiny-random-llama").path
    tok = AutoTokenizer.from_pretrained(model)
    bundle = tokenizer_bundle(model, tok)
    files = _unzip(bundle.data)
    assert set(files) == set(bundle.files)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(files)
    assert "model.safetensors" not in files
    for name, data in files.items():
        assert data == (model / name).read_bytes(), name
    assert bundle.sha256 == hashlib.sha256(bundle.data).hexdigest()
    chunks = list(bundle.chunks(size=100_000))
    assert b"".join(c for c, _ in chunks) == bundle.data
    assert [s for _, s in chunks] == [""] * (len(chunks) - 1) + [bundle.sha256]


def test_bundle_adds_the_loaded_template_when_no_file_has_it(tmp_path: Path) -> None:
    model = resolve_checkpoint("tiny-random-llama").path
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model / name, tmp_path / name)
    tok = AutoTokenizer.from_pretrained(model)
    files = _unzip(tokenizer_bundle(tmp_path, tok).data)
    assert files["chat_template.jinja"].decode() == tok.chat_template


def test_bundle_of_a_dir_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        tokenizer_bundle(tmp_path, None)
