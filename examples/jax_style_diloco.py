"""DiLoCo the way JAX users write it: one training step written for one replica,
``vmap`` over R simulated replicas (a VmapCollective averages over the replica axis,
as ``lax.pmean`` does), the whole step compiled with ``torch.compile(fullgraph=True)``.
The state, from ``vmap(init)`` on, keeps one structure: one compiled function serves
every step.

    python examples/jax_style_diloco.py --replicas 4 --steps 48

The inner AdamW and the outer Nesterov SGD are written out here, out of place:
puredist's own optimizers run under ``vmap`` eagerly, but not inside a compiled ``vmap``.
"""

import argparse
import time
import warnings
from typing import NamedTuple

import torch
from torch.func import functional_call, grad_and_value, vmap

import puredist
from puredist.tree import tree_flatten, tree_leaves, tree_unflatten, vmap_axes



def adamw_init(params):
    zeros = {k: torch.zeros_like(p) for k, p in params.items()}
    return {"m": zeros, "v": dict(zeros), "t": torch.zeros(())}


def adamw_update(params, grads, state, lr=3e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2):
    t = state["t"] + 1
    m = {k: b1 * state["m"][k] + (1 - b1) * g for k, g in grads.items()}
    v = {k: b2 * state["v"][k] + (1 - b2) * g * g for k, g in grads.items()}
    new = {k: p * (1 - lr * weight_decay) - lr * (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
           for k, p in params.items()}
    return new, {"m": m, "v": v, "t": t}


class Momentum(NamedTuple):
    buffer: torch.Tensor


def nesterov_sgd(lr: float, momentum: float) -> puredist.Optimizer:
    """The outer optimizer (torch's rule: ``b <- m b + g``, ``p <- p - lr (g + m b)``)."""

    def init(params):
        return [Momentum(torch.zeros_like(p)) for p in tree_leaves(params)]

    def update(params, grads, state):
        leaves, spec = tree_flatten(params)
        grads = spec.flatten_up_to(grads)
        buffers = [momentum * s.buffer + g for s, g in zip(state, grads)]
        new = [p - lr * (g + momentum * b) for p, g, b in zip(leaves, grads, buffers)]
        return tree_unflatten(spec, new), [Momentum(b) for b in buffers]

    def update_(params, grads, state):
        new, stepped = update(params, grads, state)
        for p, n in zip(tree_leaves(params), tree_leaves(new)):
            p.copy_(n)
        return stepped

    return puredist.Optimizer(init, update, update_, config=f"nesterov_sgd(lr={lr}, momentum={momentum})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    args = parser.parse_args()
    R = args.replicas
    warnings.filterwarnings("ignore", message=".*performance drop.*")  # torch's vmap fallbacks, where they run

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = {k: p.detach() for k, p in model.named_parameters()}
    diloco = puredist.outer_optimizer(nesterov_sgd(0.7, 0.9), sync_every=args.sync_every, fragments=2,
                                      comm_dtype=torch.bfloat16)
    collective = puredist.VmapCollective(R)

    def step(p, state, x, y):  # one replica's step
        grads, loss = grad_and_value(lambda q: torch.nn.functional.mse_loss(functional_call(model, q, (x,)), y))(p)
        p, inner = adamw_update(p, grads, state[0])
        p, outer = diloco.update(p, state[1], collective=collective)
        return p, (inner, outer), loss

    # the state's axes: every tensor mapped, the step (a Python int) not
    axes = (vmap_axes(adamw_init(params)), vmap_axes(diloco.init(params)))
    stacked = {k: p.expand(R, *p.shape).clone() for k, p in params.items()}  # the same start on every replica
    state = vmap(lambda p: (adamw_init(p), diloco.init(p)), out_dims=axes)(stacked)
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
