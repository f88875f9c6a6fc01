"""DiLoCo the way JAX users write it: one training step written for one replica,
``vmap`` over R simulated replicas (a VmapCollective averages over the replica axis,
as ``lax.pmean`` does), the whole step compiled with ``torch.compile(fullgraph=True)``.
The state, from ``vmap(init)`` on, keeps one structure: one compiled function serves
every step.

    python examples/jax_style_diloco.py --replicas 4 --steps 48
"""

import argparse
import time
import warnings

import torch
import torch._dynamo
from torch.func import functional_call, grad_and_value, vmap

import puredist
from puredist.tree import vmap_axes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    args = parser.parse_args()
    R = args.replicas
    warnings.filterwarnings("ignore", message=".*performance drop.*")  # torch's vmap fallbacks, where they run
    # compiled, dynamo rewrites Adam's addcmul_(value=) as prims.fma, which vmap runs replica by replica (and warns
    # from C++, past Python's filters): kept whole, it is one batched op
    torch._dynamo.config.enable_dynamo_decompositions = False

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = {k: p.detach() for k, p in model.named_parameters()}
    inner = puredist.adamw(3e-3)
    diloco = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True), sync_every=args.sync_every,
                                      fragments=2, comm_dtype=torch.bfloat16)
    collective = puredist.VmapCollective(R)

    def step(p, state, x, y):  # one replica's step
        grads, loss = grad_and_value(lambda q: torch.nn.functional.mse_loss(functional_call(model, q, (x,)), y))(p)
        p, inner_state = inner.update(p, grads, state[0])
        p, outer_state = diloco.update(p, state[1], collective=collective)
        return p, (inner_state, outer_state), loss

    # the state's axes: every tensor mapped, the step (a Python int) not
    axes = (vmap_axes(inner.init(params)), vmap_axes(diloco.init(params)))
    stacked = {k: p.expand(R, *p.shape).clone() for k, p in params.items()}  # the same start on every replica
    state = vmap(lambda p: (inner.init(p), diloco.init(p)), out_dims=axes)(stacked)
    train = torch.compile(vmap(step, in_dims=(0, axes, 0, 0), out_dims=(0, axes, 0)), fullgraph=True,
                          backend=args.backend)

    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(2)  # each replica its own batches
    started = time.perf_counter()
    for k in range(args.steps):
        x = torch.randn(R, 32, 16, generator=data)
        stacked, state, loss = train(stacked, state, x, x @ true_w)
        if k % args.sync_every == 0:  # fragment 0 (the first layer's weight) synchronized: replicas agree
            w = stacked["0.weight"]
            print(f"step {k:3d}  mean loss {loss.mean().item():.4f}  first layer equal on every replica: "
                  f"{torch.equal(w, w[:1].expand_as(w))}  ({time.perf_counter() - started:.1f} s)")
    print(f"done: {R} replicas, {state[1].step} steps, mean loss {loss.mean().item():.4f}")


if __name__ == "__main__":
    main()
