"""Host work per averaging: many tensors, measured against torch and a bare all-reduce.

On a GPU the bytes move at TB/s and an averaging's cost is its host work: checks,
plans, copies launched per tensor. This benchmark times it, in one run, against
torch's ``average_parameters`` and a bare all-reduce (plus its division) of one
pre-flattened buffer of the same bytes, and times a DiLoCo synchronization (outer
Nesterov SGD, multi-tensor kernel) of the same tensors: as they are, with bf16
pseudo-gradients (the README's configuration) and int8-compressed.

Layouts (``--layouts``):

- ``tiny291``: 291 tensors of 4 fp32 elements: the bytes are nothing, the host work is
  everything (the CPU run of ``make bench``);
- ``80``: 40 matrices [866, 866] and their biases, 30M fp32 parameters;
- ``291``: a GPT-like model in 291 tensors, 137M fp32 parameters (``make bench-gpu``).

Run with ``python -m torch.distributed.run --standalone --nproc-per-node 2 bench_host.py``
(Gloo, CPU), or ``--nproc-per-node 1 bench_host.py --device cuda --backend nccl``. At one
rank ``average_`` returns at once (the mean of one rank), so the table shows its body
instead, as it runs at several ranks: the checks (once per layout), the rank check (a
host exchange) and the staged buckets; DiLoCo at one rank skips its mean too.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import utils as torch_utils

import puredist
from _measure import add_device_arguments, device_name, init_distributed, interleaved_medians, llm_like_shapes
from puredist._inputs import checked

LAYOUTS = {
    "tiny291": lambda: [(4,)] * 291,
    "80": lambda: [shape for _ in range(40) for shape in ((866, 866), (866,))],
    "291": lambda: llm_like_shapes(608),
}


def methods_for(shapes: list[tuple[int, ...]], device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)  # the same on every rank: DiLoCo starts from replicated parameters
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for shape in shapes]
    # torch's own copy: average_parameters rebinds p.data to a new buffer at every call, which would make
    # every call of puredist's a first one (new storage: checked and planned anew)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    diloco_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    flat = torch.zeros(sum(math.prod(shape) for shape in shapes), device=device)
    world = dist.get_world_size()
    collective = puredist.DistributedCollective()
    unchecked = puredist.DistributedCollective(check_consistency=False)
    diloco = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True, foreach=True), sync_every=1)
    state = [diloco.init(diloco_params)]
    bf16_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    bf16 = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True, foreach=True), sync_every=1,
                                    comm_dtype=torch.bfloat16)
    bf16_state = [bf16.init(bf16_params)]
    int8_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    int8 = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True, foreach=True), sync_every=1,
                                    compressor=puredist.int8_blocks())
    int8_state = [int8.init(int8_params)]

    def bare():
        dist.all_reduce(flat)
        flat.div_(world)

    def sync():
        state[0] = diloco.update_(diloco_params, state[0], collective=collective)

    def bf16_sync():
        bf16_state[0] = bf16.update_(bf16_params, bf16_state[0], collective=collective)

    def int8_sync():
        int8_state[0] = int8.update_(int8_params, int8_state[0], collective=collective)

    def body(of):
        return lambda: of._average_over(of.process_group, checked(params), async_op=False, context="")

    methods = {
        "bare all_reduce + division": bare,
        "torch average_parameters": lambda: torch_utils.average_parameters(iter(torch_params), dist.group.WORLD),
    }
    if world == 1:
        methods["puredist body (1 rank)"] = body(collective)
        methods["puredist body, no rank check"] = body(unchecked)
        if device.type != "cpu":  # the host default's smaller buckets: more collectives, each launched by the host
            host_cap = puredist.DistributedCollective(bucket_cap_bytes=puredist.DEFAULT_BUCKET_CAP_BYTES)
            methods["puredist body, 32 MiB buckets"] = body(host_cap)
        methods["DiLoCo sync (1 rank: no mean)"] = sync
    else:
        methods["puredist average_"] = lambda: puredist.average_(params, collective=collective)
        methods["puredist average_, no rank check"] = lambda: puredist.average_(params, collective=unchecked)
        methods["DiLoCo sync"] = sync
        methods["DiLoCo sync, bf16 sent"] = bf16_sync
        methods["DiLoCo sync, int8"] = int8_sync
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=None, help="comma-separated, of " + ", ".join(LAYOUTS)
                        + " (default: tiny291 on a CPU, 80,291 on a GPU)")
    parser.add_argument("--repeats", type=int, default=31)
    add_device_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = init_distributed(args)
    layouts = (args.layouts or ("80,291" if device.type == "cuda" else "tiny291")).split(",")
    for layout in layouts:
        shapes = LAYOUTS[layout]()
        methods = methods_for(shapes, device)
        for fn in methods.values():  # warm up: the first call checks and plans a layout
            fn()
        times = interleaved_medians(methods, args.repeats)
        if dist.get_rank() != 0:
            continue
        numel = sum(math.prod(shape) for shape in shapes)
        print(f"\n{layout}: {len(shapes)} fp32 tensors, {numel / 1e6:.2f}M parameters, on {device_name(device)}, "
              f"backend {dist.get_backend()}, world size {dist.get_world_size()} (median of {args.repeats})")
        bare, reference = times["bare all_reduce + division"], times["torch average_parameters"]
        puredist_name = next(name for name in times if name.startswith("puredist"))
        print(f"  {'method':34s} {'median':>9s} {'vs bare':>8s} {'vs torch':>9s}")
        for name, seconds in times.items():
            print(f"  {name:34s} {seconds * 1e3:7.3f}ms {seconds / bare:7.2f}x {seconds / reference:8.2f}x")
        sync = next(seconds for name, seconds in times.items() if name.startswith("DiLoCo"))
        print(f"  DiLoCo sync / {puredist_name}: {sync / times[puredist_name]:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
