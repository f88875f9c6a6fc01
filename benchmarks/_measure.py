"""Timing and memory helpers shared by the benchmarks (run under torchrun)."""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--backend``, for :func:`init_distributed`."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the tensors live (cuda: every rank on GPU LOCAL_RANK modulo the GPUs there are)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl: the group is 'cpu:gloo,cuda:nccl' (host tensors, e.g. timings, go over Gloo)")


def init_distributed(args: argparse.Namespace) -> torch.device:
    """Join the process group torchrun describes, on ``args.device``; return the device."""
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.backend == "nccl" else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _finish(device_work: bool) -> None:
    if device_work:  # the GPU's queue, not just the launches
        torch.cuda.synchronize()


def interleaved_medians(methods: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each method over ``repeats`` rounds; each round runs every
    method once, in turn, so that drift of the machine's speed hits all alike. Ranks
    are aligned by a barrier before each run, and the slowest rank's time counts; with
    CUDA, a run ends when the GPU has finished its work."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    device_work = torch.cuda.is_initialized()
    for _ in range(repeats):
        for name, fn in methods.items():
            _finish(device_work)
            dist.barrier()
            start = time.perf_counter()
            fn()
            _finish(device_work)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            samples[name].append(elapsed.item())
    return {name: statistics.median(values) for name, values in samples.items()}


_M_MMAP_THRESHOLD = -3
_PAGE = os.sysconf("SC_PAGE_SIZE")


def return_large_blocks_to_the_os() -> None:
    """Make glibc serve every block of 128 KiB or more by mmap and unmap it on free
    (a fixed threshold disables glibc's adaptive one), so that the resident set
    follows torch's allocations and :func:`peak_extra_bytes` can see them."""
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def peak_extra_bytes(fn: Callable[[], object], interval_s: float = 1e-4) -> int:
    """Peak resident memory during ``fn`` beyond the resident memory before it,
    sampled every ``interval_s`` by a thread (every allocation a method makes is
    written, so it becomes resident). Counts everything: torch, Gloo, Python."""
    baseline = _resident_bytes()
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _resident_bytes())
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak, _resident_bytes()) - baseline


def peak_extra_device_bytes(fn: Callable[[], object]) -> int:
    """Peak GPU memory torch allocated during ``fn`` beyond what it held before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.1f} MiB"


def local_medians(methods: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """:func:`interleaved_medians` for one process (no process group): median wall time
    of each method over ``repeats`` interleaved rounds; with CUDA, until the GPU is done."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    device_work = torch.cuda.is_initialized()
    for _ in range(repeats):
        for name, fn in methods.items():
            _finish(device_work)
            start = time.perf_counter()
            fn()
            _finish(device_work)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def llm_like_shapes(width: int, blocks: int = 24, vocab: int = 50304) -> list[tuple[int, ...]]:
    """The parameter shapes of a GPT-like model in 291 tensors (24 blocks): token
    embedding, per block two norms, attention (qkv, projection) and MLP (in, out) with
    biases, and a final norm. ``width`` 608 gives about 137M parameters."""
    block = [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
             (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return [(vocab, width), *[shape for _ in range(blocks) for shape in block], (width,), (width,)]
