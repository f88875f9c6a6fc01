"""Build a torchft ``Manager`` the way :class:`~puredist.ft.ManagerCollective` needs it.

This module must not reduce anything: it only builds managers.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from puredist._validation import AT_LEAST_ONE, INSTANCE, check

__all__ = ["replica_manager"]

_STORES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""The store each manager built here connects to, kept as long as the manager."""


def replica_manager(
    replica_id: str,
    lighthouse: str | None = None,
    *,
    min_replicas: int = 1,
    timeout: timedelta = timedelta(seconds=30),
    quorum_timeout: timedelta = timedelta(seconds=300),
    device: torch.device | str = "cpu",
):
    """A torchft ``Manager`` for this process's replica group, as
    :class:`~puredist.ft.ManagerCollective` needs it: synchronous quorums (a replica
    heals before its tensors are read), no initial copy (puredist checks that the
    initial parameters are replicated), Gloo for CPU tensors or NCCL for CUDA ones.

    Inside a replica group started by ``torchrun`` (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` set, the group's own store listening), the
    manager uses that store; otherwise the replica group is this one process, with a
    store of its own on 127.0.0.1.

    Args:
        replica_id: this replica group's name, unique in the job (torchft appends a
            fresh id, so that a restarted group is told apart).
        lighthouse: the lighthouse's address (``None``: ``TORCHFT_LIGHTHOUSE``).
        min_replicas: the fewest replica groups a step commits with.
        timeout: for each collective, the vote and a heal's transfer.
        quorum_timeout: the longest a replica waits for a quorum (a restarted one
            waits for its peers' next synchronization).
        device: where the tensors to reduce live.

    Raises:
        ValueError: ``min_replicas < 1``, no lighthouse given or in the
            environment, or a CUDA ``device`` where there is none.
        TypeError: a ``timeout`` or ``quorum_timeout`` that is not a ``timedelta``.
    """
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    check("min_replicas", min_replicas, AT_LEAST_ONE)
    check("timeout", timeout, INSTANCE, kind=timedelta, a="a datetime.timedelta")
    check("quorum_timeout", quorum_timeout, INSTANCE, kind=timedelta, a="a datetime.timedelta")
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"Arg ``device`` is {device!r}, but this process has no CUDA device (torch "
                         f"{torch.__version__}): NCCL cannot reduce its tensors.")
    lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise ValueError("Arg ``lighthouse`` is None and TORCHFT_LIGHTHOUSE is not set: give the lighthouse's address.")
    if "MASTER_PORT" in os.environ and "RANK" in os.environ:
        store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = None
    else:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_addr, store_port, rank, world_size = "127.0.0.1", store.port, 0, 1
    manager = Manager(
        pg=ProcessGroupNCCL(timeout=timeout) if cuda else ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_replicas,
        use_async_quorum=False,
        init_sync=False,
        timeout=timeout,
        quorum_timeout=quorum_timeout,
        rank=rank,
        world_size=world_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
    )
    # a replica that is behind heals before any reduction; over plain averaging there is nothing to hand over
    # (it takes part with zeros, its tensors left unwritten, and raises Healed), but torchft needs a state to serve
    manager.register_state_dict_fn("puredist", lambda saved: None, dict)
    if store is not None:
        _STORES[manager] = store
    return manager
