"""torchft 0.2's own DiLoCo, run for real: one replica (one process) of the differential
tests in ``tests/test_diloco_paper.py``, started as
``python tests/torchft_diloco.py SPEC_JSON``. Also the definitions every side of
those tests shares (the model, each replica's batches, the inner optimizers), so that
the sides differ only in the outer algorithm.

For every case of ``spec["cases"]`` the replica makes a fresh torchft ``Manager``
(Gloo, synchronous quorum, ``init_sync=False``, at least 2 replicas in a quorum) on
that case's lighthouse, wraps its inner optimizer in ``torchft.local_sgd.DiLoCo``,
trains ``STEPS`` inner steps and records its parameters after every one (after
DiLoCo's hook, which synchronizes inside ``inner.step()``). Nothing of puredist is
imported here. The replicas meet at the job's ``TCPStore`` after every case, so that
no manager shuts down while its peer still reduces; it saves ``{case: trajectory}``
(a trajectory is a list, one entry per inner step, of the parameters' values) to
``spec["out"]``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
from torch import nn

SYNC_EVERY = 4  # H
STEPS = 12
REPLICAS = 2
OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)
CASES = {  # name: (inner optimizer, fragments)
    "sgd-1": ("sgd", 1),
    "adamw-1": ("adamw", 1),
    "sgd-2": ("sgd", 2),
    "adamw-2": ("adamw", 2),
}


def make_model() -> nn.Module:
    """A 2-layer MLP, the same initial weights everywhere. Its leaves, in
    ``parameters()`` order, are ``w0, b0, w1, b1`` (32, 8, 32, 4 elements): cut into two
    contiguous runs of about equal size they are its two Linear layers."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


def module_fragments(model: nn.Module, fragments: int) -> list[nn.Module]:
    """torchft's ``model_fragments``: the whole model, or one Linear layer each."""
    return [model] if fragments == 1 else [model[0], model[2]]


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s batch for inner step ``step`` (0-based): its own data."""
    generator = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(8, 4, generator=generator)
    return x, torch.sin(3 * x) + 0.1 * torch.randn(8, 4, generator=generator)


def make_inner(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def inner_step(model: nn.Module, inner: torch.optim.Optimizer, replica: int, step: int) -> None:
    """One inner step: MSE on the replica's batch, then ``inner.step()``."""
    x, y = batch(replica, step)
    inner.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    inner.step()


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def run_case(case: str, replica: int, lighthouse: str, timeout_s: float, meet) -> list[list[torch.Tensor]]:
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    kind, fragments = CASES[case]
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None, min_replica_size=REPLICAS,
        use_async_quorum=False, init_sync=False, timeout=timeout, quorum_timeout=timedelta(seconds=30),
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=f"{case}-{replica}",
    )
    try:
        model = make_model()
        parts = module_fragments(model, fragments)
        inner = make_inner(kind, model.parameters())
        # one outer optimizer per fragment: after an inner step every parameter still holds its inner gradient,
        # and one optimizer over the whole model would step the other fragments with it
        outers = [torch.optim.SGD(part.parameters(), **OUTER) for part in parts]
        trajectory = []
        with DiLoCo(manager, parts, inner, outers if fragments > 1 else outers[0], sync_every=SYNC_EVERY):
            for step in range(STEPS):
                inner_step(model, inner, replica, step)  # DiLoCo's hook synchronizes inside inner.step()
                trajectory.append(snapshot(model))
        assert manager.current_step() == STEPS // (SYNC_EVERY // fragments), "a synchronization did not commit"
        meet(case)  # (the peer's last reduction is over before this manager's process group goes)
        return trajectory
    finally:
        manager.shutdown(wait=False)


def main(spec: dict) -> None:
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", spec["port"], is_master=False,
                                       timeout=timedelta(seconds=spec["timeout"] * 4))

    def meet(case: str) -> None:
        store.add(f"done.{case}.{spec['replica']}", 1)
        store.wait([f"done.{case}.{r}" for r in range(REPLICAS)])

    results = {case: run_case(case, spec["replica"], lighthouse, spec["timeout"], meet)
               for case, lighthouse in spec["cases"].items()}
    torch.save(results, spec["out"])


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "error")
    main(json.loads(sys.argv[1]))
