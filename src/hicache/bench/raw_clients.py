"""The bare clients ``hicache bench storage`` sets each L3 backend against: the same page
bytes through the library the backend wraps, without hicache's records (no header, no
checksum, no namespace), so the bench's hicache / raw ratio is what hicache adds.

:class:`RawClient` is the contract (``put`` / ``get`` of same-size byte buffers under
string keys); one subclass per backend (see :mod:`hicache.bench.storage` for what each
does).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch

from hicache.storage.backends.aibrix_config import AibrixConfig
from hicache.storage.pageio import byte_view

__all__ = ["RawAibrix", "RawClient", "RawFile", "RawMooncake", "RawNixl", "RawRedis"]


class RawClient:
    """A bare client: ``put(keys, bufs)`` and ``get(keys, bufs)`` of same-size byte buffers."""

    def buffers(self, n: int, nbytes: int) -> list[torch.Tensor]:
        """``n`` flat uint8 buffers of ``nbytes`` the client can move data from / into."""
        return [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(n)]

    def put(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def get(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RawFile(RawClient):
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        for k, b in zip(keys, bufs, strict=True):
            with open(self.root / k, "wb") as f:
                f.write(byte_view(b))

    def get(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        for k, b in zip(keys, bufs, strict=True):
            with open(self.root / k, "rb", buffering=0) as f:
                f.readinto(byte_view(b))


class RawRedis(RawClient):
    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)

    def put(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k, b in zip(keys, bufs, strict=True):
            pipe.set(k, byte_view(b))
        pipe.execute()

    def get(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        for v, b in zip(pipe.execute(), bufs, strict=True):
            byte_view(b)[:] = v

    def close(self) -> None:
        self.client.close()


class RawMooncake(RawClient):
    def __init__(self, master: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"raw mooncake client setup returned {rc}")
        self._areas: list[torch.Tensor] = []

    def buffers(self, n: int, nbytes: int) -> list[torch.Tensor]:
        area = torch.zeros(n * nbytes, dtype=torch.uint8)
        if self.store.register_buffer(area.data_ptr(), area.numel()) != 0:
            raise RuntimeError("raw mooncake client could not register its buffer")
        self._areas.append(area)
        return list(area.view(n, nbytes).unbind(0))

    def put(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        codes = self.store.batch_put_from(
            keys, [b.data_ptr() for b in bufs], [b.numel() for b in bufs]
        )
        if any(c != 0 for c in codes):
            raise RuntimeError(f"raw mooncake put failed: {sorted(set(codes))}")

    def get(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        codes = self.store.batch_get_into(
            keys, [b.data_ptr() for b in bufs], [b.numel() for b in bufs]
        )
        if any(c < 0 for c in codes):
            raise RuntimeError(f"raw mooncake get failed: {sorted(set(codes))}")

    def close(self) -> None:
        self.store.close()


class RawAibrix(RawClient):
    """AIBrix's manager without hicache's records: the page bytes as blocks."""

    def __init__(self, config: AibrixConfig, page_bytes: int, objects: int) -> None:
        from hicache.storage.backends.aibrix_client import block_bytes_for, open_manager

        self.manager = open_manager(
            config, block_bytes_for(page_bytes), timeout_s=120.0, concurrency=objects
        )

    def put(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        done = self.manager.put_from(keys, [byte_view(b) for b in bufs])
        if done != len(keys):
            raise RuntimeError(f"raw aibrix put stored {done} of {len(keys)} blocks")

    def get(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        views = [byte_view(b) for b in bufs]

        def sink(i: int, block: memoryview) -> None:
            views[i][:] = block[: views[i].nbytes]

        run = self.manager.get_into(keys, sink)
        if run.fetched != len(keys):
            raise RuntimeError(f"raw aibrix get read {run.fetched} of {len(keys)} ({run.why})")

    def close(self) -> None:
        self.manager.close()


class RawNixl(RawClient):
    """NIXL's POSIX plugin without hicache's records: the page bytes, one file each."""

    def __init__(self, root: Path) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from hicache.storage.backends.nixl_client import require_nixl

        require_nixl()  # quiets NIXL's INFO lines on stdout
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.agent = nixl_agent(
            f"raw-{uuid.uuid4().hex[:8]}",
            nixl_agent_config(enable_prog_thread=False, backends=[]),
        )
        self.agent.create_backend("POSIX", {})
        self._regs: list[Any] = []

    def buffers(self, n: int, nbytes: int) -> list[torch.Tensor]:
        area = torch.zeros(n * nbytes, dtype=torch.uint8)
        self._regs.append(
            self.agent.register_memory([(area.data_ptr(), area.numel(), 0, "")], "DRAM")
        )
        self._regs.append(area)  # registered memory must outlive its registration
        return list(area.view(n, nbytes).unbind(0))

    def _move(self, op: str, keys: list[str], bufs: list[torch.Tensor], flags: int) -> None:
        agent = self.agent
        fds = [os.open(self.root / k, flags, 0o600) for k in keys]
        try:
            files = agent.register_memory(
                [(0, b.numel(), fd, "") for fd, b in zip(fds, bufs, strict=True)], "FILE"
            )
            local = agent.get_xfer_descs([(b.data_ptr(), b.numel(), 0) for b in bufs], "DRAM")
            remote = agent.get_xfer_descs(
                [(0, b.numel(), fd) for fd, b in zip(fds, bufs, strict=True)], "FILE"
            )
            handle = agent.initialize_xfer(op, local, remote, agent.name)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            handle.release()
            agent.deregister_memory(files)
            if state != "DONE":
                raise RuntimeError(f"raw nixl {op} ended {state}")
        finally:
            for fd in fds:
                os.close(fd)

    def put(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        self._move("WRITE", keys, bufs, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def get(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        self._move("READ", keys, bufs, os.O_RDONLY)

    def close(self) -> None:
        for reg in self._regs:
            if not isinstance(reg, torch.Tensor):
                self.agent.deregister_memory(reg)
