"""A functional training loop: ``torch.func`` gradients, a puredist optimizer and a
puredist averager, all state explicit — post-local SGD the way JAX users write it.

Launch with torch's launcher, on one machine or many::

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/functional_loop.py
    # many nodes, NCCL (GPUs): the same script
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        examples/functional_loop.py --backend nccl
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad_and_value

import puredist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.backend == "nccl" else torch.device("cpu")

    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}

    optimizer = puredist.sgd(lr=0.05, momentum=0.9)
    averager = puredist.periodic_averager(period=4, warmup_steps=10)
    collective = puredist.DistributedCollective()
    opt_state, avg_state = optimizer.init(params), averager.init(params)

    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)).to(device)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own data

    def loss_fn(p, x, y):
        return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    for step in range(args.steps):
        x = torch.randn(32, 16, generator=data).to(device)
        grads, loss = grad_and_value(loss_fn)(params, x, x @ true_w)
        opt_state = optimizer.update_(params, grads, opt_state)
        avg_state = averager.update_(params, avg_state, collective=collective)
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  averager step {avg_state.step}")

    consensus = puredist.average(params, collective=collective)  # pure: params untouched
    drift = max((consensus[n] - params[n]).abs().max().item() for n in params)
    if rank == 0:
        print(f"done on {world_size} ranks; largest distance to the consensus model: {drift:.2e}")
    dist.barrier()  # nobody leaves while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
