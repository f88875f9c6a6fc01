"""The functional optimizers' step against ``torch.optim``'s, one process.

AdamW over a GPT-like model in 291 tensors: ``torch.optim.AdamW`` with the
multi-tensor (foreach) and the fused kernel, against puredist's ``adamw`` with the
same kernel, in place (``update_``) and pure (``update``: new parameters and state,
the inputs untouched), and the pure ``update`` compiled with ``torch.compile``
(fullgraph; the compiler fuses the multi-tensor form itself), with inductor's default
input checks and without them (``options={"size_asserts": False}``: inductor's
check of each input's sizes and strides at every call). The ratios are against
``torch.optim`` with the same kernel, in the same run.

Run with ``python bench_optim.py`` (CPU: width 64 and 512 tokens, 1.2M parameters,
where the host work shows) or ``python bench_optim.py --device cuda`` (width 608, 137M parameters).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import puredist
from _measure import device_name, llm_like_shapes, local_medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--width", type=int, default=None, help="model width (default: 64 on a CPU, 608 on a GPU)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled update")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    shapes = llm_like_shapes(args.width or (608 if on_gpu else 64), vocab=50304 if on_gpu else 512)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).to(device) for shape in shapes]
    grads = [torch.randn(shape, generator=gen).to(device) * 1e-3 for shape in shapes]

    def torch_step(**kernel):
        own = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(own, grads):
            p.grad = g
        optimizer = torch.optim.AdamW(own, lr=1e-4, **kernel)
        return optimizer.step

    def in_place(**kernel):
        opt, own = puredist.adamw(1e-4, **kernel), [p.clone() for p in params]
        state = [opt.init(own)]

        def step():
            state[0] = opt.update_(own, grads, state[0])
        return step

    def pure(update, opt):
        carried = [[p.clone() for p in params], opt.init(params)]

        def step():
            carried[0], carried[1] = update(carried[0], grads, carried[1])
        return step

    foreach, fused = dict(foreach=True), dict(fused=True)
    methods = {
        "torch.optim.AdamW foreach": torch_step(**foreach),
        "puredist update_ foreach": in_place(**foreach),
        "puredist update foreach": pure(puredist.adamw(1e-4, **foreach).update, puredist.adamw(1e-4, **foreach)),
        "torch.optim.AdamW fused": torch_step(**fused),
        "puredist update_ fused": in_place(**fused),
        "puredist update fused": pure(puredist.adamw(1e-4, **fused).update, puredist.adamw(1e-4, **fused)),
    }
    compile_s = None
    if not args.no_compile:
        start = time.perf_counter()
        # inductor checks every input's sizes and strides at each call by default (1455 checks here)
        for name, size_asserts in (("puredist update compiled", True), ("  without size asserts", False)):
            opt = puredist.adamw(1e-4)
            compiled = torch.compile(opt.update, fullgraph=True, options={"size_asserts": size_asserts})
            methods[name] = pure(compiled, opt)
            methods[name]()  # compiles
        compile_s = time.perf_counter() - start
    for fn in methods.values():
        fn()
    times = local_medians(methods, args.repeats)
    numel = sum(math.prod(shape) for shape in shapes)
    print(f"AdamW step, {len(shapes)} tensors, {numel / 1e6:.1f}M fp32 parameters, on {device_name(device)}, "
          f"torch {torch.__version__} (median of {args.repeats})"
          + (f"; compiling took {compile_s:.0f} s" if compile_s is not None else ""))
    print(f"  {'method':28s} {'median':>9s} {'vs torch, same kernel':>22s} {'vs torch fused':>15s}")
    for name, seconds in times.items():
        kernel = "fused" if "fused" in name else "foreach"
        same = times[f"torch.optim.AdamW {kernel}"]
        print(f"  {name:28s} {seconds * 1e3:7.3f}ms {seconds / same:21.2f}x "
              f"{seconds / times['torch.optim.AdamW fused']:14.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
