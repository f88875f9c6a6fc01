"""DiLoCo over FSDP2: each replica group trains a sharded model, and every ``H`` steps
the groups take an outer step on their averaged pseudo-gradients, shard by shard.

The ranks form a ``(replicate, shard)`` mesh: ``fully_shard`` shards the model (a
character-level GPT on CPython's documentation, from the demo) over ``shard``;
``DistributedCollective.from_mesh(mesh, "replicate")`` averages each rank's shards
with the same shards of the other replica groups. The global copy and the outer
momentum are DTensors sharded like the parameters (their memory divided by the shard
degree), kept in fp32 (``global_dtype``) while FSDP2 computes in bf16
(``MixedPrecisionPolicy``). At the end each replica group's model and the DiLoCo state
are saved with ``torch.distributed.checkpoint``, which reshards them for any other
shard degree.

Launch with torch's launcher (Gloo on CPU, or NCCL on GPUs)::

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/diloco_fsdp2.py --shards 2
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        examples/diloco_fsdp2.py --shards 8 --backend nccl
"""

import argparse
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import puredist
from puredist.demo import charlm


# FSDP2 warns that the model returns a view (in-place ops on it would skip a hook); this script makes none
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--shards", type=int, default=2, help="ranks per replica group (FSDP2 shard degree)")
    parser.add_argument("--sync-every", type=int, default=16, help="H: inner steps between outer steps")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--checkpoint", default=None, help="folder for a DCP checkpoint at the end")
    parser.add_argument("--global-device", default=None, choices=["cpu"],
                        help="keep the global copy and outer momentum in host memory (default: with the parameters)")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    world_size = dist.get_world_size()
    if world_size % args.shards:
        raise SystemExit(f"--shards {args.shards} does not divide the {world_size} ranks")
    device_type = "cuda" if args.backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh(device_type, (world_size // args.shards, args.shards), mesh_dim_names=("replicate", "shard"))
    replica = mesh.get_coordinate()[0]

    model = charlm.make_model(seed=0).to(device_type)  # the same initial model on every rank
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"], mp_policy=policy)
    fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
    params = dict(model.named_parameters())  # DTensors: this rank's shards

    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    diloco = puredist.outer_optimizer(
        puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=args.sync_every, warmup_steps=args.sync_every,
        comm_dtype=torch.bfloat16, global_dtype=torch.float32, global_device=args.global_device,
    )
    collective = puredist.DistributedCollective.from_mesh(mesh, "replicate")
    state = diloco.init(params)

    # each replica group reads its own part of the corpus (the ranks of a group read the same batches)
    shard, test = charlm.load(seed=0, rank=replica, world_size=world_size // args.shards)
    batches = torch.Generator().manual_seed(replica)
    for step in range(args.steps):
        inputs, targets = (t.to(device_type) for t in charlm.sample(shard, batches))
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        inner.zero_grad()
        loss.backward()
        inner.step()
        state = diloco.update_(params, state, collective=collective)
        if dist.get_rank() == 0 and (step + 1) % max(1, args.steps // 5) == 0:
            print(f"step {step + 1}: replica 0 training loss {loss.item():.3f}", flush=True)

    with torch.no_grad():
        held_out = torch.nn.functional.cross_entropy(model(test[0].to(device_type)).flatten(0, 1),
                                                     test[1].to(device_type).flatten()).item()
    global_bytes = sum(g.to_local().numel() * g.to_local().element_size() for g in state.global_params)
    if args.checkpoint:
        # between outer steps the replica groups' models differ: each group saves its own (under one shared key,
        # DCP would keep one group's shards for all); the DiLoCo state is the same in every group
        dcp.save({f"model.replica{replica}": model.state_dict(),
                  "diloco": diloco.state_dict(state, rank=dist.get_rank())}, checkpoint_id=args.checkpoint)
    if dist.get_rank() == 0:
        whole = sum(p.numel() for p in params.values()) * 4
        print(f"replica 0 held-out loss {held_out:.3f}; global copy on this rank: {global_bytes} of {whole} bytes "
              f"(fp32, 1/{args.shards} of the model); done on {world_size} ranks")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
