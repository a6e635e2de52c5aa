"""What a client or a stranger can make a PD instance hold, and whom it makes a decode
instance contact (issue 33, item 3): the links of a decode instance are bounded and
retire when idle (its threads come back); a bootstrap address it may not contact is
refused with a 400 before any connection; a keyed bootstrap server refuses a caller
without the key (401) and changes nothing; bodies are capped (413), and the open rooms
of one client (429); a long poll reads the rooms asked for, not again on every wake.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from hicache.disagg.bootstrap import MAX_REGISTER_BYTES, BootstrapServer, PrefillRooms
from hicache.disagg.bootstrap_client import BootstrapClient
from hicache.disagg.config import Bootstrap
from hicache.disagg.rooms import RoomState, RoomTable
from hicache.engine.sampling import InvalidRequest
from tests.disagg.test_pd_engine import FAST, GREEDY, PROMPT, free_port, make_engine, run_room
from tests.disagg.test_rooms import LAYOUT, reg
from tests.helpers.api_fixtures import serve


def link_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hicache-pd-link-")]


def wait_for(check: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@contextmanager
def bootstrap(key: str | None = None, **rooms_kw: object) -> Iterator[tuple[PrefillRooms, str]]:
    """A bootstrap server of :data:`LAYOUT` on a free port; yields its rooms and URL."""
    rooms = PrefillRooms(LAYOUT, timeout_s=30.0, closed_ttl_s=60.0, **rooms_kw)  # type: ignore[arg-type]
    server = BootstrapServer(rooms, "127.0.0.1", 0, **({} if key is None else {"key": key}))
    server.start()
    try:
        yield rooms, f"http://127.0.0.1:{server.port}"
    finally:
        server.close()


def raw_post(url: str, path: str, headers: dict[str, str], body: bytes = b"") -> int:
    """POST with exactly these headers (the body may be shorter than Content-Length:
    the server must answer without reading it); returns the status."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        s.sendall(head.encode() + body)
        return int(s.recv(4096).split(b" ", 2)[1])


# ---------------------------------------------------------------- the decode's links


def test_links_are_bounded_and_retire_when_idle() -> None:
    """60 requests naming 60 ports that nothing listens on: at most ``max_links`` link
    threads at any time, none once they have been idle for the timeout."""
    before = len(link_threads())
    with make_engine(
        "tiny-random-llama", "decode", **FAST, max_links=8, link_idle_timeout_s=0.5
    ) as decode:
        most = 0
        for i in range(60):
            out = decode.generate(
                PROMPT, GREEDY, 60, bootstrap=Bootstrap("127.0.0.1", free_port(), i)
            )
            assert out.error is not None and "did not answer" in out.error, out.error
            most = max(most, len(link_threads()) - before)
        assert 1 <= most <= 8
        assert wait_for(lambda: len(link_threads()) == before, 5.0), link_threads()
        assert decode.role.receiver.links == 0  # type: ignore[attr-defined]
        # a link is made again when needed
        out = decode.generate(PROMPT, GREEDY, 60, bootstrap=Bootstrap("127.0.0.1", free_port(), 99))
        assert out.error is not None


def test_a_link_holding_rooms_is_kept_and_past_the_bound_a_new_address_gets_503() -> None:
    """Two bootstrap servers that take registrations and never answer them (their rooms
    wait for a prefill request that never comes); with ``max_links=2`` and a short idle
    timeout the two links stay (they hold rooms) and a third address is refused with a
    503 naming the flag, before anything is sent to it."""
    with make_engine(
        "tiny-random-llama",
        "decode",
        **{**FAST, "room_timeout_s": 30.0},
        max_links=2,
        link_idle_timeout_s=0.2,
    ) as decode:
        layout = decode.role.layout  # type: ignore[attr-defined]
        servers = []
        try:
            for _ in range(2):
                rooms = PrefillRooms(layout, timeout_s=30.0, closed_ttl_s=60.0)
                srv = BootstrapServer(rooms, "127.0.0.1", 0)
                srv.start()
                servers.append((rooms, srv))
            with serve(decode) as url, httpx.Client(timeout=60) as c:
                streams = []
                for i, (rooms, srv) in enumerate(servers):
                    body = {
                        "input_ids": PROMPT,
                        "sampling_params": {"max_new_tokens": 2},
                        "stream": True,
                        "bootstrap_host": "127.0.0.1",
                        "bootstrap_port": srv.port,
                        "bootstrap_room": 100 + i,
                    }
                    streams.append(
                        c.send(c.build_request("POST", f"{url}/generate", json=body), stream=True)
                    )
                    assert wait_for(lambda rooms=rooms: len(rooms) == 1)
                time.sleep(0.6)  # three idle timeouts: links with rooms stay
                assert len(link_threads()) >= 2 and decode.role.receiver.links == 2  # type: ignore[attr-defined]
                listener = socket.socket()
                listener.bind(("127.0.0.1", 0))
                listener.listen(1)
                listener.settimeout(0.3)
                body = {
                    "input_ids": PROMPT,
                    "sampling_params": {"max_new_tokens": 2},
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": listener.getsockname()[1],
                    "bootstrap_room": 200,
                }
                r = c.post(f"{url}/generate", json=body)
                assert r.status_code == 503, r.text
                assert "--disaggregation-max-links 2" in r.json()["error"]["message"]
                assert r.headers["Retry-After"] == "1"
                with pytest.raises(TimeoutError):
                    listener.accept()  # never contacted
                listener.close()
                for s in streams:
                    s.close()
        finally:
            for _, srv in servers:
                srv.close()


# ---------------------------------------------------------------- whom a decode contacts


def test_a_disallowed_bootstrap_address_is_refused_without_any_connection() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    with make_engine(
        "tiny-random-llama", "decode", port=port, **FAST, bootstrap_allow=("10.0.0.0/8", "pf:8998")
    ) as decode:
        with serve(decode) as url:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
            room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5}
            r = httpx.post(f"{url}/generate", json={**body, **room}, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "bootstrap_host" and "127.0.0.1:" in err["message"]
            assert "--disaggregation-bootstrap-allow 10.0.0.0/8,pf:8998" in err["message"]
            # the router's no-transfer host is never contacted, always served
            alone = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 1}
            r = httpx.post(f"{url}/generate", json={**body, **alone}, timeout=60)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
        with pytest.raises(InvalidRequest, match="not an address this decode instance may contact"):
            decode.validate(PROMPT, GREEDY, bootstrap=Bootstrap("pf", 8999, 6))
        assert decode.role.receiver.links == 0  # type: ignore[attr-defined]
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_by_default_a_decode_instance_contacts_loopback_only() -> None:
    with make_engine("tiny-random-llama", "decode", **FAST) as decode:
        for host in ("192.0.2.1", "example.com", "10.1.2.3"):
            with pytest.raises(InvalidRequest) as exc:
                decode.validate(PROMPT, GREEDY, bootstrap=Bootstrap(host, 8998, 7))
            assert exc.value.param == "bootstrap_host"
        for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
            decode.validate(PROMPT, GREEDY, bootstrap=Bootstrap(host, 8998, 8))
        assert decode.role.receiver.links == 0  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the keyed bootstrap


def test_a_keyed_bootstrap_server_refuses_without_the_key_and_changes_nothing() -> None:
    with bootstrap(key="s3cret") as (rooms, url):
        port = int(url.rsplit(":", 1)[1])
        body = reg(7).to_json()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for path, b in (
                ("/register", body),
                ("/status", {"rooms": [7], "wait_s": 0}),
                ("/abort", {"room": 7, "why": "x"}),
            ):
                r = httpx.post(f"{url}{path}", json=b, headers=headers, timeout=5)
                assert r.status_code == 401, (path, headers, r.text)
                assert "key" in r.json()["error"]
            assert httpx.get(f"{url}/layout", headers=headers, timeout=5).status_code == 401
        assert len(rooms) == 0 and rooms.status([7]) == [None]  # nothing registered, aborted
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # open
        # with the key: registered, then the prefill's own request claims it
        client = BootstrapClient("127.0.0.1", port, key="s3cret")
        assert client.register(reg(7)) is None
        assert rooms.claim(7) is None
        got = client.status([7], 0)[0]
        assert got is not None and got.state is RoomState.WAITING_FOR_INPUT
        assert client.abort(7, "done") is True
        client.close()
        nokey = BootstrapClient("127.0.0.1", port)
        why = nokey.register(reg(8))
        assert why is not None and "key" in why
        nokey.close()
        assert rooms.status([8]) == [None]


def test_a_keyed_pair_serves_and_a_decode_without_the_key_is_refused() -> None:
    port = free_port()
    with make_engine(
        "tiny-random-llama", "prefill", port=port, **FAST, bootstrap_key="k1"
    ) as prefill:
        with make_engine(
            "tiny-random-llama", "decode", port=port, **FAST, bootstrap_key="k1"
        ) as decode:
            p, d = run_room(prefill, decode, 41)
            assert p.error is None and d.error is None and len(d.output_ids) > 1
        with make_engine("tiny-random-llama", "decode", port=port, **FAST) as stranger:
            out = stranger.generate(PROMPT, GREEDY, 60, bootstrap=Bootstrap("127.0.0.1", port, 42))
            assert out.error is not None and "key" in out.error, out.error
        assert prefill.role.rooms.status([42]) == [None]  # type: ignore[attr-defined]


# ---------------------------------------------------------------- caps


def test_bodies_past_the_cap_get_413_unread() -> None:
    with bootstrap() as (rooms, url):
        big = str(MAX_REGISTER_BYTES + 1)
        assert raw_post(url, "/register", {"Content-Length": big}) == 413
        assert raw_post(url, "/status", {"Content-Length": str(2 << 20)}) == 413
        assert raw_post(url, "/abort", {"Content-Length": str(2 << 20)}) == 413
        assert len(rooms) == 0
    with bootstrap(key="k") as (rooms, url):  # the key is checked first: a stranger learns nothing
        assert raw_post(url, "/register", {"Content-Length": str(MAX_REGISTER_BYTES + 1)}) == 401


def test_the_open_rooms_of_one_client_are_capped_with_429() -> None:
    with bootstrap(max_rooms_per_client=2) as (rooms, url):
        r = [httpx.post(f"{url}/register", json=reg(n).to_json(), timeout=5) for n in (1, 2, 3)]
        assert [x.status_code for x in r] == [200, 200, 429], r[2].text
        assert "--disaggregation-max-rooms-per-client 2" in r[2].json()["error"]
        assert rooms.status([3]) == [None]  # nothing changed
        assert httpx.post(f"{url}/abort", json={"room": 1}, timeout=5).json() == {"closed": True}
        r4 = httpx.post(f"{url}/register", json=reg(4).to_json(), timeout=5)
        assert r4.status_code == 200  # one closed: room for one more
        assert httpx.post(f"{url}/register", json=reg(5).to_json(), timeout=5).status_code == 429


def test_a_long_poll_reads_its_rooms_once_not_on_every_wake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poll of 500 rooms waits while 300 other rooms close (each close wakes it): it
    reads the rooms asked for twice (at the start and at the end), not once per wake."""
    rooms = PrefillRooms(LAYOUT, timeout_s=30.0, closed_ttl_s=60.0)
    for n in range(1000):
        assert rooms.claim(n) is None
    reads = 0
    real = RoomTable.status

    def counted(self: RoomTable, room: int) -> object:
        nonlocal reads
        reads += 1
        return real(self, room)

    monkeypatch.setattr(RoomTable, "status", counted)
    asked = list(range(500))

    def closer() -> None:
        time.sleep(0.05)
        for n in range(500, 800):
            rooms.close(n, error="x")

    t = threading.Thread(target=closer)
    t.start()
    got = rooms.status(asked, 0.5)
    t.join()
    assert all(s is not None and s.state is RoomState.BOOTSTRAPPING for s in got)
    assert reads == 2 * len(asked), reads
    # a close among the rooms asked ends the wait at once
    t = threading.Thread(target=lambda: (time.sleep(0.05), rooms.close(3, error="gone")))
    t.start()
    t0 = time.monotonic()
    got = rooms.status(asked, 1.0)
    t.join()
    assert got[3] is not None and got[3].state is RoomState.FAILED
    assert time.monotonic() - t0 < 0.9
    assert len(rooms) == 1000 - 301


def test_status_asking_for_too_many_rooms_is_refused() -> None:
    with bootstrap() as (_, url):
        r = httpx.post(f"{url}/status", json={"rooms": list(range(20000)), "wait_s": 0}, timeout=5)
        assert r.status_code == 400 and "at most" in r.json()["error"]


def test_the_bootstrap_key_and_allow_list_are_validated() -> None:
    from hicache.disagg.config import DisaggConfig

    with pytest.raises(ValueError, match="bootstrap_key"):
        DisaggConfig(mode="decode", bootstrap_key="")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bootstrap_allow"):
        DisaggConfig(mode="decode", bootstrap_allow=("10.0.0.1:99999",))  # type: ignore[arg-type]
    assert "s3cret" not in repr(DisaggConfig(mode="decode", bootstrap_key="s3cret"))  # type: ignore[arg-type]


# ---------------------------------------------------------------- transfer listeners

_LISTENERS = """
import json, os, sys, psutil, torch
from hicache.disagg.backends import make_transport
from hicache.disagg.transport import Region, TransportUnavailable
try:
    t = make_transport("nixl", sys.argv[1], "probe")
except TransportUnavailable as e:
    print(json.dumps({"missing": str(e)}))
    raise SystemExit(0)
buf = torch.zeros(1 << 16, dtype=torch.uint8)
t.register([Region(buf.data_ptr(), buf.numel(), False, 0)])
assert t.endpoint
conns = psutil.Process().net_connections("tcp")
print(json.dumps({"listen": sorted({c.laddr.ip for c in conns if c.status == "LISTEN"})}))
t.close()
sys.stdout.flush()
os._exit(0)  # NIXL 1.5.1 crashes at interpreter teardown in a bare script (main too)
"""


def _routable_ipv4() -> str | None:
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def test_nixl_listens_on_the_interface_of_its_host_only() -> None:
    """With a routable ``--host`` UCX opened a listener on every interface (loopback
    too); it now listens on that address's interface only."""
    import os
    import subprocess
    import sys

    host = _routable_ipv4()
    if host is None:
        pytest.skip("this host has no routable IPv4 address")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run(
        [sys.executable, "-c", _LISTENERS, host],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "missing" in got:
        pytest.skip(got["missing"])
    assert got["listen"] == [host], got


# ---------------------------------------------------------------- a paused prefill

_PAUSABLE = """
import json, sys, time
from hicache.disagg.bootstrap import BootstrapServer, PrefillRooms
from hicache.disagg.layout import InstanceLayout
rooms = PrefillRooms(InstanceLayout.from_json(json.loads(sys.argv[1])), timeout_s=60.0, closed_ttl_s=60.0)
server = BootstrapServer(rooms, "127.0.0.1", 0)
server.start()
print(server.port, flush=True)
time.sleep(600)
"""


def test_a_link_to_a_paused_prefill_stays_while_it_holds_rooms_then_retires() -> None:
    """A prefill's bootstrap server (its own process) takes a registration, then is
    SIGSTOPped: the link keeps its room past many idle timeouts (it is not idle), the
    request fails at the health bound, the link still holds the room's pages while the
    prefill is paused, and once it resumes and acknowledges the abort the link retires;
    the decode's link threads are back where they were."""
    import os
    import signal
    import subprocess
    import sys

    before = len(link_threads())
    bounds = {**FAST, "health_interval_s": 0.5, "health_failures": 3, "room_timeout_s": 60.0}
    with make_engine(
        "tiny-random-llama", "decode", **bounds, max_links=4, link_idle_timeout_s=0.2
    ) as decode:
        layout = json.dumps(decode.role.layout.to_json())  # type: ignore[attr-defined]
        proc = subprocess.Popen(
            [sys.executable, "-c", _PAUSABLE, layout], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
            ends: list[object] = []
            decode.submit(
                PROMPT,
                GREEDY,
                lambda o: ends.append(o) if o.finished else None,
                bootstrap=Bootstrap("127.0.0.1", port, 77),
            )
            assert wait_for(lambda: decode.role.receiver.links == 1)  # type: ignore[attr-defined]
            time.sleep(0.3)  # registered (the room waits for a prefill request)
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.8)  # four idle timeouts, under the 1.5 s health bound
            assert not ends and decode.role.receiver.links == 1  # type: ignore[attr-defined]
            assert wait_for(lambda: bool(ends), 10.0)
            out = ends[0]
            assert out.error is not None and "did not answer" in out.error  # type: ignore[attr-defined]
            # the room's pages stay fenced while the paused prefill may still write them,
            # so the link stays, resending the abort, until the prefill answers it
            time.sleep(0.5)
            assert decode.role.receiver.links == 1  # type: ignore[attr-defined]
            os.kill(proc.pid, signal.SIGCONT)
            assert wait_for(lambda: decode.role.receiver.links == 0, 5.0)  # type: ignore[attr-defined]
            assert wait_for(lambda: len(link_threads()) == before, 5.0), link_threads()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
