"""The nodes of a tensor-parallel group, in one process: their config, the rendezvous's
verdict over a real ``TCPStore`` (:mod:`hicache.engine.nodes`), and the liveness link
over real sockets (:mod:`hicache.engine.node_link`)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from hicache.engine.config import EngineConfig
from hicache.engine.node_link import NodeLink, NodeLinks
from hicache.engine.nodes import (
    NodeCard,
    NodeConfig,
    NodeStartError,
    announce,
    check_listenable,
    check_nodes,
    interface_of,
)


def test_a_node_config_is_validated_and_splits_the_ranks() -> None:
    two = NodeConfig(nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert two.address == ("10.0.0.1", 5000)
    assert two.ranks(4) == range(2, 4)
    assert two.node_of(3, 4) == 1
    assert not two.leader
    assert NodeConfig().ranks(3) == range(0, 3)
    assert NodeConfig(nnodes=2, dist_init_addr="[::1]:7").address == ("::1", 7)
    for kwargs, needle in [
        ({"nnodes": 0}, "nnodes=0 is invalid"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank=2 is invalid"),
        ({"node_rank": -1}, "node_rank=-1 is invalid"),
        ({"nnodes": 2}, "dist_init_addr=None is invalid with nnodes=2"),
        ({"nnodes": 2, "dist_init_addr": "host"}, "dist_init_addr='host' is invalid"),
        ({"nnodes": 2, "dist_init_addr": "h:0"}, "dist_init_addr='h:0' is invalid"),
    ]:
        with pytest.raises(ValueError, match=needle):
            NodeConfig(**kwargs)
    with pytest.raises(ValueError, match="tp_size=3 is invalid with nnodes=2"):
        two.local_size(3)


def test_an_engine_config_refuses_ranks_the_nodes_cannot_share() -> None:
    nodes = NodeConfig(nnodes=2, dist_init_addr="127.0.0.1:5000")
    assert EngineConfig(tp_size=4, nodes=nodes, device="cpu").nodes.ranks(4) == range(0, 2)
    with pytest.raises(ValueError, match="tp_size=3 is invalid with nnodes=2"):
        EngineConfig(tp_size=3, nodes=nodes, device="cpu")


def card(node: int, nnodes: int = 3, tp: int = 6, model: str = "m") -> NodeCard:
    return NodeCard(node_rank=node, nnodes=nnodes, tp_size=tp, model=model)


def test_a_card_names_what_differs() -> None:
    mine = card(0)
    assert card(1).differs(mine) is None
    assert card(1, nnodes=2).differs(mine) == (
        "node 1 was started with --nnodes 2, node 0 with --nnodes 3"
    )
    assert "--tp-size 4, node 0 with --tp-size 6" in str(card(2, tp=4).differs(mine))
    assert "--model-path x" in str(card(2, model="x").differs(mine))
    assert "--node-rank 0 is out of range" in str(card(0).differs(mine))


def store_pair() -> tuple[Any, Any]:
    master = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(
        "127.0.0.1", master.port, 3, is_master=False, timeout=timedelta(seconds=10)
    )
    return master, client


def announcing(
    store: Any, c: NodeCard, timeout_s: float = 10.0
) -> tuple[threading.Thread, list[str]]:
    out: list[str] = []

    def run() -> None:
        try:
            announce(store, c, timeout_s)
            out.append("ok")
        except NodeStartError as exc:
            out.append(str(exc))

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_node_0_accepts_the_nodes_started_alike() -> None:
    master, client = store_pair()
    threads = [announcing(client, card(2)), announcing(client, card(1))]
    check_nodes(master, card(0), time.monotonic() + 10)
    for t, out in threads:
        t.join(timeout=10)
        assert out == ["ok"]


@pytest.mark.parametrize(
    ("other", "needle"),
    [
        (card(1, nnodes=2), "node 1 was started with --nnodes 2, node 0 with --nnodes 3"),
        (card(1), "node 1: --node-rank 1 is taken twice"),
    ],
)
def test_node_0_refuses_a_node_started_otherwise(other: NodeCard, needle: str) -> None:
    master, client = store_pair()
    first, out1 = announcing(client, card(1))
    first.join(timeout=0.5)  # the first card is in before the second
    second, out2 = announcing(client, other)
    with pytest.raises(NodeStartError, match=needle):
        check_nodes(master, card(0), time.monotonic() + 10)
    for t in (first, second):
        t.join(timeout=10)
    assert out1 == out2 and len(out1) == 1 and needle in out1[0]


def test_node_0_names_the_nodes_that_never_came() -> None:
    master, client = store_pair()
    t, out = announcing(client, card(2))
    began = time.monotonic()
    with pytest.raises(NodeStartError, match="node 1 did not reach --dist-init-addr in time"):
        check_nodes(master, card(0), began + 1.0)
    assert time.monotonic() - began < 1.0 + 5.5  # the refused node reads why first
    t.join(timeout=10)
    assert "node 1 did not reach" in out[0]


def test_a_node_whose_node_0_never_answers_fails_in_time() -> None:
    _, client = store_pair()
    began = time.monotonic()
    with pytest.raises(NodeStartError, match=r"node 1: node 0 did not accept it within 0\.5 s"):
        announce(client, card(1), 0.5)
    assert time.monotonic() - began < 3


def test_the_link_carries_ready_beats_and_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    import hicache.engine.node_link as node_link

    monkeypatch.setattr(node_link, "SILENT_AFTER_S", 0.3)
    links = NodeLinks(nnodes=2, local=2)
    address = links.start("127.0.0.1")
    lost: list[str] = []
    links.watch(lost.append)
    try:
        link = NodeLink(address, 1, timeout_s=5)
        link.send({"ready": True})
        links.wait_ready(time.monotonic() + 5, 5)
        link.send({"beat": {"2": 0.0, "3": 9.0}})  # rank 3 silent on its own host
        time.sleep(0.1)
        assert links.silent() == (
            "rank 3 (node 1) has not answered for 9 s (frozen or overloaded): the ranks wait for it"
        )
        time.sleep(0.5)  # node 1 as a whole says nothing
        assert "rank 2 (node 1) has not answered" in str(links.silent())
        link.close()
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost == ["node 1 (rank 2, 3) was lost: its link to rank 0 closed"]
        assert links.failure() == lost[0]
    finally:
        links.close()


def test_a_node_that_fails_to_start_is_named() -> None:
    links = NodeLinks(nnodes=3, local=1)
    address = links.start("127.0.0.1")
    try:
        NodeLink(address, 2, timeout_s=5).send({"error": "rank 2 failed while building"})
        with pytest.raises(RuntimeError, match="node 2: rank 2 failed while building"):
            links.wait_ready(time.monotonic() + 5, 5)
        with pytest.raises(RuntimeError, match="node 1 did not build"):
            NodeLinks(nnodes=2, local=1).wait_ready(time.monotonic() + 0.1, 0.1)
    finally:
        links.close()


def test_the_link_reads_rank_0_gone() -> None:
    links = NodeLinks(nnodes=2, local=1)
    link = NodeLink(links.start("127.0.0.1"), 1, timeout_s=5)
    assert not link.lost
    links.close()
    assert link.wait_lost(5)


def test_node_0_listens_only_on_its_own_address() -> None:
    check_listenable(NodeConfig(nnodes=2, dist_init_addr="127.0.0.1:5000"))
    with pytest.raises(NodeStartError, match="node 0 cannot listen on --dist-init-addr 203"):
        check_listenable(NodeConfig(nnodes=2, dist_init_addr="203.0.113.7:5000"))


def test_an_address_names_its_interface() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("0.0.0.0") is None
    assert interface_of("localhost") is None
    assert interface_of("203.0.113.7") is None
