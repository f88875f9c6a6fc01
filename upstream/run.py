"""Run PyTorch's own tests for the seeds against ``puredist.classic`` (``make upstream``).

Two suites, adapted only as far as CPU/Gloo requires:

- ``test/distributed/optim/test_zero_redundancy_optimizer.py`` from PyTorch's
  repository (not shipped in the wheel): taken from ``.upstream/`` or downloaded
  there for the installed torch version. It runs unchanged behind one first line,
  ``import swap`` (see ``swap.py``), which swaps the import and lifts the skips of
  tests that only ask for a GPU device.
- the model-averaging and post-local-SGD tests of the installed
  ``torch.testing._internal.distributed.distributed_test``: copied with their
  device placements rewritten to CPU (``.cuda(...)`` dropped, ``device_ids=None``,
  ``backend="gloo"``) and the GPU-count skips dropped, only in those tests and their
  helpers; run at world size 4 on Gloo.
- the ZeRO file's overlap tests once more with their warm-up iterations removed (the
  one reason they fail on purpose): then they must pass.

Every test must pass except those in :data:`DELIBERATE` (each a difference the
README lists, with the reason); an unexpected failure *or* an expected failure that
passes makes the run fail, so the list stays true.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".upstream"
BUILD = CACHE / "build"
DISTRIBUTED_TEST = "torch.testing._internal.distributed.distributed_test"  # imported only with BACKEND set
ZERO_TESTS = "test_zero_redundancy_optimizer.py"
ZERO_TESTS_URL = "https://raw.githubusercontent.com/pytorch/pytorch/v{version}/test/distributed/optim/" + ZERO_TESTS

AVERAGING_TESTS = (
    "test_average_parameters",
    "test_periodic_model_averager",
    "test_periodic_model_averager_param_group",
    "test_1_level_hierarchical_model_averager_equivalent_to_periodic_model_averager",
    "test_3_level_hierarchical_model_averager",
    "test_ddp_hook_parity_post_localSGD",
    "test_post_localSGD_optimizer_parity",
    "test_post_localSGD_optimizer_parity_grad_is_view",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
    "test_post_localSGD_optimizer_step_reload",
)
AVERAGING_HELPERS = (
    "_test_ddp_hook_parity",
    "_test_post_localSGD_optimizer_parity",
    "_test_post_localSGD_optimizer_step_reload",
)
CPU_REWRITES = (
    (re.compile(r"\.cuda\([^()]*\)"), ""),
    (re.compile(r"\.to\(rank\)"), ""),
    (re.compile(r"rank_to_GPU\[rank\]\[0\]"), '"cpu"'),
    (re.compile(r"device_ids=\[(?:self\.)?rank\]"), "device_ids=None"),
    (re.compile(r"torch\.cuda\.set_device\([^()]*\)"), "None"),
    (re.compile(r'backend="nccl"'), 'backend="gloo"'),
    (re.compile(r'map_location = \{"cuda:0": f"cuda:\{self\.rank:d\}"\}'), 'map_location = "cpu"'),
)
WARM_UP = "num_warmup_inputs = 2 if not static_graph else 3"
"""The line of torch's overlap test that runs iterations torch's hooks do not apply."""
GPU_COUNT_SKIP = re.compile(r"^\s*@(skip_if_lt_x_gpu\(.*\)|skip_if_no_gpu)\s*$")

DELIBERATE = {
    "test_same_dense_param_type": "parameters of several dtypes are accepted (torch refuses them)",
    "test_post_localSGD_optimizer_step_reload": "the averager's step is also kept in every param group (where "
    "torch.distributed.checkpoint keeps it): a state dict without the top-level step still resumes it, "
    "instead of warning and restarting at 0",
    **{
        f"test_ddp_zero_overlap_{variant}": "the ZeRO hooks update from iteration 0: the test's 2-3 warm-up "
        "iterations, which do not update with torch's hooks, do with puredist's"
        for variant in (
            f"use_gpu_True_use_interleaved_hook_{a}_gradient_as_bucket_view_{b}_static_graph_{c}_shard_buckets_{d}"
            for a in (False, True)
            for b in (False, True)
            for c in (False, True)
            for d in (False, True)
        )
    },
}
"""Tests that fail on purpose, with the reason (the README lists them)."""


def zero_tests_source() -> Path:
    """PyTorch's ZeRO test file: from ``.upstream/``, else downloaded there."""
    path = CACHE / ZERO_TESTS
    if path.exists():
        return path
    url = ZERO_TESTS_URL.format(version=torch.__version__.split("+")[0])
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read()
    except OSError as error:
        sys.exit(
            f"Cannot download {url} ({error}).\nPut PyTorch's {ZERO_TESTS} (the version of the installed "
            f"torch {torch.__version__}) at {path} and run again."
        )
    CACHE.mkdir(exist_ok=True)
    path.write_bytes(text)
    return path


def method_spans(tree: ast.Module, names: set[str]) -> list[tuple[int, int]]:
    """1-based inclusive line spans (decorators included) of the methods ``names``."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first, node.end_lineno))
    found = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)} & names
    if found != names:
        sys.exit(f"distributed_test.py of torch {torch.__version__} lacks {sorted(names - found)}")
    return spans


def cpu_copy_of_distributed_test(text: str) -> str:
    """The installed distributed_test.py with the averaging tests moved to CPU."""
    lines = text.splitlines(keepends=True)
    for first, last in method_spans(ast.parse(text), set(AVERAGING_TESTS + AVERAGING_HELPERS)):
        for number in range(first - 1, last):
            line = lines[number]
            if GPU_COUNT_SKIP.match(line):
                line = ""
            for pattern, replacement in CPU_REWRITES:
                line = pattern.sub(replacement, line)
            if ".cuda(" in line or "cuda:" in line:
                sys.exit(f"distributed_test.py line {number + 1} still places tensors on CUDA: {line.strip()}")
            lines[number] = line
    return "".join(lines)


def build() -> list[Path]:
    """Write the adapted test files into ``.upstream/build``; return the ones to run."""
    shutil.rmtree(BUILD, ignore_errors=True)
    BUILD.mkdir(parents=True)
    prelude = "import swap  # puredist: torch's names resolve to puredist.classic\n"
    zero = BUILD / ZERO_TESTS
    zero_text = zero_tests_source().read_text()
    zero.write_text(prelude + zero_text)
    if WARM_UP not in zero_text:
        sys.exit(f"{ZERO_TESTS} no longer has the line {WARM_UP!r}: review DELIBERATE")
    without_warm_up = BUILD / "test_zero_overlap_without_warm_up.py"
    without_warm_up.write_text(prelude + zero_text.replace(WARM_UP, "num_warmup_inputs = 0"))
    source = Path(importlib.util.find_spec(DISTRIBUTED_TEST).origin).read_text()
    (BUILD / "distributed_test_on_cpu.py").write_text(cpu_copy_of_distributed_test(source))
    averaging = BUILD / "test_averaging_on_cpu.py"
    averaging.write_text(
        prelude
        + "from distributed_test_on_cpu import DistributedTest, TestDistBackend\n\n\n"
        "class TestAveragingOnGloo(TestDistBackend, DistributedTest._DistTestBase):\n"
        "    def setUp(self):\n"
        "        super().setUp()\n"
        "        self._spawn_processes()\n"
    )
    return [zero, averaging, without_warm_up]


def run(path: Path, selection: str | None, world_size: int, timeout: int) -> dict[str, str]:
    """Run one test file under pytest; ``{test name: outcome}``."""
    report = BUILD / f"{path.stem}.xml"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "upstream"), str(BUILD)]),
        BACKEND="gloo",
        WORLD_SIZE=str(world_size),
        TEMP_DIR=tempfile.mkdtemp(prefix="puredist-upstream-"),
        OMP_NUM_THREADS="1",
    )
    command = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-c", os.devnull,
               "--rootdir", str(BUILD), f"--junitxml={report}"]
    if selection:
        command += ["-k", selection]
    subprocess.run(command, cwd=BUILD, env=env, timeout=timeout, check=False)
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcomes[f"{case.get('classname').rpartition('.')[2]}.{case.get('name')}"] = outcome
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per suite")
    args = parser.parse_args()
    zero, averaging, without_warm_up = build()
    started = time.perf_counter()
    outcomes = run(zero, None, 2, args.timeout)
    outcomes |= run(averaging, " or ".join(AVERAGING_TESTS), 4, args.timeout)
    # the overlap tests' only difference is the warm-up: without it they must pass
    outcomes |= {f"{name} (no warm-up)": outcome
                 for name, outcome in run(without_warm_up, "test_ddp_zero_overlap", 2, args.timeout).items()}
    unexpected = []
    for name, outcome in sorted(outcomes.items()):
        reason = DELIBERATE.get(name.rpartition(".")[2])
        expected_failure = reason is not None
        note = f"  (on purpose: {reason})" if expected_failure else ""
        print(f"{outcome:8s} {name}{note}")
        if outcome != "skipped" and (outcome == "failed") != expected_failure:
            unexpected.append(name)
    counts = {kind: sum(o == kind for o in outcomes.values()) for kind in ("passed", "failed", "skipped")}
    print(f"\n{counts} in {time.perf_counter() - started:.0f} s; {len(DELIBERATE)} fail on purpose")
    if unexpected:
        print(f"UNEXPECTED: {unexpected}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
