"""A training step written once for one rank (local SGD on a small MLP, then
hierarchical averaging), run for 4 simulated ranks under ``torch.func.vmap`` with a
``puredist.VmapCollective``: steps per second eager vs ``torch.compile(fullgraph=True)``
in the same run, and the compile time. ``python benchmarks/bench_vmap_compile.py``.
"""

import time, torch, puredist
from torch.func import grad, vmap
torch.set_num_threads(1)
averager = puredist.hierarchical_averager({2: 2, 4: 4})
def train_step(params, batch, state, collective):
    x, y = batch
    grads = grad(lambda p: ((torch.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).mean())(params)
    params = {k: p - 0.1 * grads[k] for k, p in params.items()}
    return averager.update(params, state, collective=collective)
R = 4
gen = torch.Generator().manual_seed(0)
params = {"w1": torch.randn(R, 32, 64, generator=gen) * 0.1, "w2": torch.randn(R, 64, 8, generator=gen) * 0.1}
batch = (torch.randn(R, 64, 32, generator=gen), torch.randn(R, 64, 8, generator=gen))
c = puredist.VmapCollective(R)
eager = vmap(train_step, in_dims=(0, 0, None, None), out_dims=(0, None))
compiled = torch.compile(eager, fullgraph=True)
def run(f, steps):
    p, s = params, averager.init()
    for _ in range(steps):
        p, s = f(p, batch, s, c)
    return p
t = time.perf_counter(); run(compiled, 8); print(f"compile (first 8 steps) {time.perf_counter()-t:.1f}s")
for name, f in (("eager", eager), ("compiled", compiled)):
    run(f, 8)
    t = time.perf_counter(); run(f, 200); dt = time.perf_counter() - t
    print(f"{name}: {200/dt:.0f} steps/s")
