"""KV blocks over NIXL (``"kv_connector": "NixlConnector"``): the consumer READs the producer's blocks out of
its registered KV cache, one-sided, through NIXL's UCX backend.

The ZMQ side channel (``lbd.engine.kv_transfer.agent``) stays: it checks the lease and the prompt's tokens
exactly as for ``LbdConnector``, and hands the consumer a ``NixlRemote`` (the producer agent's metadata, once
per producer, and where each cache tensor lives). The READ itself runs without the producer's CPU and carries
the transfer id and the lend's secret (``NixlRemote.notif``, fresh per lend, sent only over the side channel)
as its notification, on which the producer releases the lease: a NIXL peer that names a transfer id without
that secret ends nothing. The consumer READs into a
registered staging buffer laid out as ``KVBlockIO.read`` lays out bytes, so importing the blocks is the same
step for both connectors.

Where this runs: CPU caches (DRAM, tested on this machine class with the ``nixl-cu13`` wheel, which carries
UCX's shared-memory and TCP transports) and CUDA caches (VRAM: unverified until a GPU is lent). Security:
NIXL's data path is not authenticated; the metadata (UCX worker address and memory keys) travels only over
the side channel, which beyond loopback is CURVE-secured with the cluster token. On loopback UCX is held to
the ``lo`` device unless ``UCX_NET_DEVICES`` says otherwise, so nothing listens beyond it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from typing import Any

import torch

from lbd.engine.kv_transfer.blocks import KVBlockIO
from lbd.wire.kv_transfer import NixlRemote

_ABANDONED_KEPT = 4
_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")  # the meta package, then its CUDA builds
INSTALL_HINT = "pip install 'lbd[nixl]' (nixl-cu13, as the locked torch), or nixl-cu12 on CUDA 12"


def notification(transfer_id: str, notif: str) -> bytes:
    """A READ's notification: the transfer id and the secret of its lend (``NixlRemote.notif``)."""
    return f"{transfer_id}\n{notif}".encode()


def parse_notification(msg: bytes) -> tuple[str, str]:
    tid, _, notif = msg.decode(errors="replace").partition("\n")
    return tid, notif


class NixlError(Exception):
    """A transfer that cannot be done; the consumer recomputes the prefill."""


def agent_api() -> Any:
    """NIXL's Python agent module; ImportError naming the install when there is none."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"NixlConnector needs NIXL: {INSTALL_HINT}")


def _agent(name: str, loopback: bool) -> Any:
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    api = agent_api()
    # no progress thread: NIXL's spins a core even when idle; the callers progress it (the consumer while it
    # waits for its READ, the producer's block server while a READ of its blocks is in flight)
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _memory(tensor: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", tensor.device.index or 0) if tensor.device.type == "cuda" else ("DRAM", 0)


class NixlSource:
    """A producer's cache, registered for READs by consumers; its notifications name released transfers.
    Used from the block server's thread only."""

    def __init__(self, io: KVBlockIO, engine_id: str, loopback: bool) -> None:
        self.io, self.name = io, f"lbd-{engine_id}-p"
        self.agent = _agent(self.name, loopback)
        self.mem_type, self.dev_id = _memory(io.tensors[0])
        regions = [(t.data_ptr(), t.numel() * t.element_size(), self.dev_id, "") for t in io.tensors]
        self._descs = self.agent.get_reg_descs(regions, self.mem_type)
        self.agent.register_memory(self._descs)
        self._metadata: bytes = self.agent.get_agent_metadata()

    def remote(self, known: bool) -> NixlRemote:
        regions = [(t.data_ptr(), size) for t, size in zip(self.io.tensors, self.io.per_tensor, strict=True)]
        return NixlRemote(self.name, b"" if known else self._metadata, regions, self.mem_type, self.dev_id)

    def released(self) -> list[tuple[str, str]]:
        """(transfer id, the lend's secret) of READs that completed since the last call, as the consumers'
        notifications say (``notification``'s format; the block server checks the secret)."""
        notifs = self.agent.get_new_notifs()
        return [parse_notification(msg) for msgs in notifs.values() for msg in msgs]

    def close(self) -> None:
        self.agent.deregister_memory(self._descs)


class NixlSink:
    """A consumer's READs, into a registered staging buffer grown as pulls need. Used from the puller's
    thread only."""

    def __init__(self, io: KVBlockIO, engine_id: str, loopback: bool) -> None:
        self.io, self.name = io, f"lbd-{engine_id}-c"
        self.agent = _agent(self.name, loopback)
        self.peers: dict[str, str] = {}  # producer engine id -> its agent's name, metadata loaded
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._descs: Any = None
        self._abandoned: list[tuple[torch.Tensor, Any]] = []  # staging a timed-out READ may still write

    def knows(self, engine_id: str) -> bool:
        return engine_id in self.peers

    def read(self, engine_id: str, remote: NixlRemote, block_ids: list[int], transfer_id: str,
             timeout_s: float) -> bytes:
        """The blocks' bytes (``KVBlockIO.read``'s format), READ from the producer; NixlError on failure."""
        peer = self._peer(engine_id, remote)
        sizes = self.io.per_tensor
        if [size for _, size in remote.regions] != sizes:
            raise NixlError("the producer's KV layout is not this rank's")
        n = len(block_ids)
        self._reserve(n * self.io.block_bytes)
        base, off, local, far = self._staging.data_ptr(), 0, [], []
        for (start, size) in remote.regions:
            for k, b in enumerate(block_ids):
                far.append((start + b * size, size, remote.dev_id))
                local.append((base + off + k * size, size, 0))
            off += n * size
        handle = self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(local, "DRAM"), self.agent.get_xfer_descs(far, remote.mem_type),
            peer, notification(transfer_id, remote.notif))
        try:
            self._wait(handle, timeout_s)
        except NixlError:
            self._abandon()  # a late READ may still land in the staging buffer: it is never reused
            self.peers.pop(engine_id, None)  # and the next pull asks for metadata again (a restart)
            raise
        finally:
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)
        return self._staging[:n * self.io.block_bytes].numpy().tobytes()

    def _peer(self, engine_id: str, remote: NixlRemote) -> str:
        if remote.metadata:  # a producer new to us, or one that restarted under the same id
            name = self.agent.add_remote_agent(remote.metadata)
            self.peers[engine_id] = name.decode() if isinstance(name, bytes) else str(name)
        elif engine_id not in self.peers:
            raise NixlError(f"no NIXL metadata for producer {engine_id}")
        return self.peers[engine_id]

    def _abandon(self) -> None:
        self._abandoned.append((self._staging, self._descs))
        if len(self._abandoned) > _ABANDONED_KEPT:  # long past any READ's end: free the oldest
            _, descs = self._abandoned.pop(0)
            if descs is not None:
                with contextlib.suppress(Exception):
                    self.agent.deregister_memory(descs)
        self._staging, self._descs = torch.empty(0, dtype=torch.uint8), None

    def _reserve(self, nbytes: int) -> None:
        if self._staging.numel() >= nbytes:
            return
        if self._descs is not None:
            self.agent.deregister_memory(self._descs)
        self._staging = torch.empty(max(nbytes, 2 * self._staging.numel()), dtype=torch.uint8)
        self._descs = self.agent.get_reg_descs(
            [(self._staging.data_ptr(), self._staging.numel(), 0, "")], "DRAM")
        self.agent.register_memory(self._descs)

    def _wait(self, handle: Any, timeout_s: float) -> None:
        state = self.agent.transfer(handle)
        deadline, pause = time.monotonic() + timeout_s, 0.0002
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise NixlError(f"the NIXL read did not finish in {timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
            state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise NixlError("the NIXL read failed (the producer gone, or its memory released)")

    def close(self) -> None:
        if self._descs is not None:
            self.agent.deregister_memory(self._descs)
