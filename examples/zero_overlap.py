"""ZeRO's optimizer step overlapped with DDP's backward, on Gloo (torch's own hooks
refuse Gloo) and from the very first iteration.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/zero_overlap.py
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from puredist.classic import ZeroRedundancyOptimizer, hook_with_zero_step_interleaved

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)),
            bucket_cap_mb=0.25)
zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=1e-3)
model.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, model, zero, shard_buckets=True))

before = [p.detach().clone() for p in model.parameters()]
data = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    x = torch.randn(64, 32, generator=data)
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    loss.backward()  # the sharded AdamW step happens in here
    zero.zero_grad()
    if rank == 0 and (step % 25 == 0 or step == args.steps - 1):
        print(f"step {step:4d}  loss {loss.item():.4f}")

moved = all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
owned = len(zero.optim.state)  # the local optimizer holds the owned parameters' state
print(f"rank {rank}: owns the AdamW state of {owned} of {len(before)} parameters; every parameter moved: {moved}")
dist.barrier()  # nobody leaves while a peer still talks
dist.destroy_process_group()
