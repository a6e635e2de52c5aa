"""smg in PD mode (``--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL``, as
:class:`tests.helpers.smg.Smg` runs it) registers a hicache prefill instance and a decode
instance as SGLang prefill and decode workers, with the prefill's bootstrap port, both
load-polled. Registration only: the transfer between them is tested with it."""

from __future__ import annotations

import httpx

from hicache.services.process import free_port
from tests.helpers.smg import Smg
from tests.router.conftest import ROUTER_KEY, StartWorker


def test_smg_registers_prefill_and_decode_workers(start_worker: StartWorker) -> None:
    bootstrap = free_port()
    prefill = start_worker(
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)
    )
    decode = start_worker("--disaggregation-mode", "decode")
    info = httpx.get(f"{prefill.url}/server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == bootstrap
    assert httpx.get(f"{decode.url}/server_info", timeout=10).json()["disaggregation_mode"] == (
        "decode"
    )
    with Smg(
        prefill=[(prefill.url, bootstrap)],
        decode=[decode.url],
        policy="round_robin",
        api_key=ROUTER_KEY,
    ) as smg:
        workers = smg.wait_workers(
            lambda ws: len(ws) == 2 and all(w.get("engine_load") for w in ws),
            15,
            "both workers' loads polled",
        )
        by_url = {w["url"]: w for w in workers}
        p, d = by_url[prefill.url], by_url[decode.url]
        assert (p["worker_type"], p["runtime_type"]) == ("prefill", "sglang")
        assert p["bootstrap_port"] == bootstrap
        assert (d["worker_type"], d["runtime_type"]) == ("decode", "sglang")
