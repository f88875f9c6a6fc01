"""DiLoCo between clusters, DDP inside each: the shape that cross-datacenter runs take
(INTELLECT-1; torchtitan with torchft). Inside a cluster the workers share a fast
fabric and stay equal every step (DDP all-reduces their gradients); between clusters
one slow link carries only DiLoCo's synchronizations, one every ``--sync-every`` inner
steps.

The ranks form a ``(cluster, inside)`` mesh: DDP runs over ``inside``; DiLoCo's
collective is ``DistributedCollective.from_mesh(mesh, "cluster")``, so each rank
averages its pseudo-gradient with the rank at its place in every other cluster (the
HSDP shape: one replica group per cluster). Each cluster trains on its own shard of
the data. Every cluster is one launcher, as on N machines (torchrun numbers the ranks
node by node, the mesh's order):

    # one machine, 2 clusters of 2 workers
    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/diloco_two_clusters.py --clusters 2
    # two clusters of 8 GPUs: one command on each, the host of the rendezvous store first
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-conf is_host=1 examples/diloco_two_clusters.py --backend nccl
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        examples/diloco_two_clusters.py --backend nccl
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import puredist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--clusters", type=int, default=int(os.environ.get("GROUP_WORLD_SIZE", 2)),
                        help="clusters (default: the launchers' node count)")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    world = dist.get_world_size()
    if args.clusters < 2 or world % args.clusters:
        raise SystemExit(f"--clusters {args.clusters}: at least 2 (DiLoCo across one cluster averages nothing; under "
                         f"--standalone pass --clusters), dividing the world size {world}")
    mesh = init_device_mesh("cuda" if args.backend == "nccl" else "cpu", (args.clusters, world // args.clusters),
                            mesh_dim_names=("cluster", "inside"))
    cluster, inside = mesh.get_coordinate()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.backend == "nccl" else "cpu")

    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts it inside a cluster only)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device),
        process_group=mesh.get_group("inside"),
    )
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    diloco = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=args.sync_every,
                                      comm_dtype=torch.bfloat16)  # the slow link carries bf16
    params = list(model.parameters())
    state = diloco.init(params)
    across = puredist.DistributedCollective.from_mesh(mesh, "cluster")

    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)).to(device)
    data = torch.Generator().manual_seed(1000 * cluster + inside)  # a shard per worker, a share per cluster
    losses = []
    for step in range(args.steps):
        x = torch.randn(64, 16, generator=data).to(device)
        loss = (model(x) - x @ target).pow(2).mean()
        losses.append(loss.item())
        inner.zero_grad()
        loss.backward()  # DDP: the cluster's gradients averaged, over the fast fabric
        inner.step()
        state = diloco.update_(params, state, collective=across)  # every sync_every steps: across the clusters

    # the run ends after a synchronization (steps a multiple of sync_every): every rank holds the global copy
    equal = all(torch.equal(p, g) for p, g in zip(params, state.global_params))
    if dist.get_rank() == 0:
        print(f"done on {args.clusters} clusters of {world // args.clusters}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"{state.step} steps, every rank on the global copy: {equal}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
