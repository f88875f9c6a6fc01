"""DiLoCo the way JAX users write it: one training step written for one replica,
``vmap`` over R simulated replicas (a VmapCollective averages over the replica axis,
as ``lax.pmean`` does), the whole step compiled with ``torch.compile(fullgraph=True)``.
The state, from ``vmap(init)`` on, keeps one structure: one compiled function serves
every step.

    python examples/jax_style_diloco.py --replicas 4 --steps 48 --compare-eager
    python examples/jax_style_diloco.py --replicas 4 --steps 48 --compare-eager --payload int8
"""

import argparse
import time
import warnings

import torch
from torch.func import functional_call, grad_and_value, vmap

import puredist
from puredist.tree import tree_leaves, vmap_axes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--payload", choices=["bf16", "int8"], default="bf16",
                        help="pseudo-gradients sent in bf16, or as int8 blocks with error feedback")
    parser.add_argument("--compare-eager", action="store_true",
                        help="run the same steps eagerly too and print the largest difference")
    args = parser.parse_args()
    R = args.replicas
    warnings.filterwarnings("ignore", message=".*performance drop.*")  # torch's vmap fallbacks, where they run

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = {k: p.detach() for k, p in model.named_parameters()}
    inner = puredist.adamw(3e-3)
    payload = ({"comm_dtype": torch.bfloat16} if args.payload == "bf16"
               else {"compressor": puredist.compression.int8_blocks()})
    diloco = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True), sync_every=args.sync_every,
                                      fragments=2, **payload)
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
    vmapped = vmap(step, in_dims=(0, axes, 0, 0), out_dims=(0, axes, 0))
    train = torch.compile(vmapped, fullgraph=True, backend=args.backend)

    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(2)  # each replica its own batches
    batches = [torch.randn(R, 32, 16, generator=data) for _ in range(args.steps)]
    started = time.perf_counter()
    compiled = (stacked, state)
    for k, x in enumerate(batches):
        *compiled, loss = train(*compiled, x, x @ true_w)
        # fragment 0 (the first layer's weight) synchronizes after inner steps H/2, H/2 + H, ...: replicas agree
        if (k + 1) % args.sync_every == args.sync_every // 2:
            w = compiled[0]["0.weight"]
            print(f"step {k:3d}  mean loss {loss.mean().item():.4f}  first layer equal on every replica: "
                  f"{torch.equal(w, w[:1].expand_as(w))}  ({time.perf_counter() - started:.1f} s)")
    print(f"done: {R} replicas, {compiled[1][1].step} steps, mean loss {loss.mean().item():.4f}")
    if args.compare_eager:
        eager = (stacked, state)
        for x in batches:
            *eager, _ = vmapped(*eager, x, x @ true_w)
        differences = [(a - b).abs().max().item() for a, b in zip(tree_leaves(compiled), tree_leaves(eager))
                       if isinstance(a, torch.Tensor)]
        print(f"largest |compiled - eager| over the parameters and the state: {max(differences):.2e}")

if __name__ == "__main__":
    main()
