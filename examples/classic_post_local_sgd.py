"""torch's post-local SGD example (from ``PostLocalSGDOptimizer``'s docstring), on
CPU/Gloo, with only the imports changed to puredist's drop-ins.

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/classic_post_local_sgd.py
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

# Before: import torch.distributed.algorithms.model_averaging.averagers as averagers
import puredist.classic.averagers as averagers

# Before: from torch.distributed.optim import PostLocalSGDOptimizer
# Before: from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
#             PostLocalSGDState, post_localSGD_hook)
from puredist.classic import PostLocalSGDOptimizer
from puredist.classic.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
module = nn.Linear(1, 1, bias=False)
model = nn.parallel.DistributedDataParallel(module)

# Register a post-localSGD communication hook. (torch's example passes subgroup=None,
# the intra-node CUDA group; on CPU every rank is its own local group.)
local_group, _ = dist.new_subgroups(group_size=1)
state = PostLocalSGDState(process_group=None, subgroup=local_group, start_localSGD_iter=100)
model.register_comm_hook(state, post_localSGD_hook)

# Create a post-localSGD optimizer that wraps a local optimizer.
# Note that ``warmup_steps`` used in ``PostLocalSGDOptimizer`` must be the same as
# ``start_localSGD_iter`` used in ``PostLocalSGDState``.
local_optim = torch.optim.SGD(params=model.parameters(), lr=0.01)
opt = PostLocalSGDOptimizer(
    optim=local_optim,
    averager=averagers.PeriodicModelAverager(period=4, warmup_steps=100),
)

# In the first 100 steps, DDP runs global gradient averaging at every step.
# After 100 steps, DDP runs gradient averaging within each subgroup (intra-node by default),
# and post-localSGD optimizer runs global model averaging every 4 steps after applying the local optimizer.
data = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    inputs = torch.randn(8, 1, generator=data)
    labels = 3.0 * inputs
    opt.zero_grad()
    output = model(inputs)
    loss = nn.functional.mse_loss(output, labels)
    loss.backward()
    opt.step()

if rank == 0:
    print(f"weight {module.weight.item():.4f} (target 3.0), averager step {opt.averager.step}")
dist.barrier()  # nobody leaves while a peer still talks
dist.destroy_process_group()
