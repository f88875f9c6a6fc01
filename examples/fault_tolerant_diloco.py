"""DiLoCo that survives replica groups dying and coming back (puredist.ft over torchft).

One lighthouse for the job, then one torchrun per replica group, on any machines:

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 &
    TORCHFT_LIGHTHOUSE=http://HOST:29510 torchrun --nproc-per-node 1 --master-port 29601 \
        examples/fault_tolerant_diloco.py --replica-id 0
    TORCHFT_LIGHTHOUSE=http://HOST:29510 torchrun --nproc-per-node 1 --master-port 29602 \
        examples/fault_tolerant_diloco.py --replica-id 1

(``--min_replicas 2`` would make the first quorum wait for two replica groups, and
every step need two.) Kill a replica group (Ctrl-C, ``kill -9``) and start it again:
the others go on without it, and the restarted one heals from a peer at their next synchronization
(step, global copy, outer momentum) and trains on with them. Each prints its step and
a digest of its global copy every synchronization: equal on every replica group.
"""

import argparse
import os
import zlib
from datetime import timedelta

import torch
from torch import nn
from torch.func import functional_call, grad

import puredist
from puredist.ft import FaultTolerantOuter, replica_manager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", required=True, help="this replica group's name, unique in the job")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial model in every replica group
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    inner = puredist.adamw(1e-2)
    inner_state = inner.init(params)
    # (fault tolerance synchronizes nothing after the first inner step: sync_every >= 2)
    transform = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True), sync_every=args.sync_every)
    manager = replica_manager(args.replica_id, os.environ["TORCHFT_LIGHTHOUSE"], min_replicas=1,
                              timeout=timedelta(seconds=30))
    outer = FaultTolerantOuter(transform, manager)
    state = transform.init(params)

    data = torch.Generator().manual_seed(zlib.crc32(args.replica_id.encode()))  # each replica group its own data
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))

    def loss(p, x):
        return (functional_call(model, p, (x,)) - x @ target).pow(2).mean()

    while state.step < args.steps:
        x = torch.randn(64, 16, generator=data)
        inner_state = inner.update_(params, grad(loss)(params, x), inner_state)
        commits = manager.current_step()
        state = outer.update_(params, state)  # a synchronization every sync_every steps, over the quorum of then
        if manager.current_step() != commits and state.step > 1:  # a synchronization committed
            digest = sum(float(t.double().sum()) for t in state.global_params)
            print(f"step {state.step}: global copy digest {digest:.9f}, {outer.collective.world_size} replica "
                  f"group(s) contributed, {outer.failed} failed synchronizations, {outer.heals} heals", flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
