"""The language-model study (``benchmarks/bench_lm.py``) around the demo: a kept
report is one of the setup asked for, and an interrupt waits for the demo's own
cleanup. The demo itself is replaced by stand-ins here (a real run takes minutes)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_lm  # noqa: E402 - the benchmark under test


def _report(steps: int, algorithms: list[str]) -> dict:
    runs = {a: {"eval_loss": 2.0 + steps, "bytes_per_worker": 1000 * steps,
                "evaluations": [{"step": steps, "loss": 2.0 + steps, "bytes_per_worker": 1000 * steps}]}
            for a in algorithms}
    return {"config": {"steps": steps, "outer_options": {"lr": 0.7}, "sparse_outer_options": {"lr": 1.5}, "top_k": 64,
                       "data_passes": steps / 1000}, "algorithms": runs}


class FakeDemo:
    """Writes the report a demo of ``command`` would (its steps and algorithms)."""

    def __init__(self):
        self.runs = []

    def __call__(self, command):
        self.runs.append(command)
        option = lambda name: command[command.index(name) + 1]  # noqa: E731
        folder = Path(option("--output"))
        folder.mkdir(parents=True, exist_ok=True)
        report = _report(int(option("--steps")), option("--algorithms").split(","))
        (folder / "results.json").write_text(json.dumps(report))


def test_a_kept_report_is_used_only_for_the_setup_it_was_measured_with(tmp_path):
    # reports were keyed by H only: a rerun with --steps 5 after 3 returned the 3-step report as the 5-step study's,
    # another --grid left the algorithms the kept report lacked silently out
    demo = FakeDemo()
    assert bench_lm.main(["--steps", "3", "--grid", "8:ddp,diloco", "--output", str(tmp_path)], run=demo) == 0
    assert bench_lm.main(["--steps", "3", "--grid", "8:ddp,diloco", "--output", str(tmp_path)], run=demo) == 0
    assert len(demo.runs) == 1  # the same setup: resumed
    for argv in (["--steps", "5", "--grid", "8:ddp,diloco"], ["--steps", "5", "--grid", "8:ddp,diloco,diloco_int4"],
                 ["--steps", "5", "--grid", "8:ddp,diloco_int4", "--outer-lr", "0.5"]):
        runs = len(demo.runs)
        assert bench_lm.main([*argv, "--output", str(tmp_path)], run=demo) == 0
        assert len(demo.runs) == runs + 1, argv  # another setup: measured again
        study = json.loads((tmp_path / "study.json").read_text())
        grid = argv[argv.index("--grid") + 1].split(":")[1].split(",")
        assert study["steps"] == 5 and sorted(row["algorithm"] for row in study["rows"]) == sorted(grid)
        assert {row["eval_loss"] for row in study["rows"]} == {7.0}  # the 5-step report's
        assert study["data_passes"] == 0.005  # the most any run's workers passed over their shards


def test_the_study_sums_the_wall_time_of_its_own_runs(tmp_path):
    # every folder with a report counted, those of other grids' periods too
    demo = FakeDemo()
    bench_lm.main(["--steps", "3", "--grid", "8:ddp", "16:diloco", "--output", str(tmp_path)], run=demo)
    for folder, wall in (("H8", 5.0), ("H16", 100.0)):
        launch = json.loads((tmp_path / folder / "launch.json").read_text())
        (tmp_path / folder / "launch.json").write_text(json.dumps({**launch, "wall_s": wall}))
    bench_lm.main(["--steps", "3", "--grid", "8:ddp", "--output", str(tmp_path)], run=demo)
    assert json.loads((tmp_path / "study.json").read_text())["wall_s"] == 5.0


_CLEANS_UP = """
import pathlib, signal, sys, time
def interrupted(signum, frame):  # as the demo's network does inside its with block
    raise KeyboardInterrupt(signum)
signal.signal(signal.SIGTERM, interrupted)
folder = pathlib.Path(sys.argv[1])
(folder / "started").write_text("")
try:
    time.sleep(60)
except KeyboardInterrupt:  # the demo's own cleanup (a --link run's network namespaces): a second
    time.sleep(1.0)
    (folder / "cleaned").write_text("")
    sys.exit(130)
"""


@pytest.mark.parametrize("to, signum, raised", [
    ("its process group (Ctrl-C)", signal.SIGINT, "KeyboardInterrupt"), ("it alone", signal.SIGINT, "KeyboardInterrupt"),
    ("it alone", signal.SIGTERM, "CalledProcessError"),
])
def test_an_interrupt_waits_for_the_demos_own_cleanup(to, signum, raised, tmp_path):
    # subprocess.run killed the demo 0.25 s after the interrupt, before it removed its network namespaces
    (tmp_path / "demo.py").write_text(_CLEANS_UP)
    study = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import bench_lm; "
         f"bench_lm.run_demo([sys.executable, {str(tmp_path / 'demo.py')!r}, {str(tmp_path)!r}])"],
        process_group=0, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "started").exists()
        (os.killpg if to.startswith("its") else os.kill)(study.pid, signum)
        _, err = study.communicate(timeout=30)
    finally:
        if study.poll() is None:
            study.kill()
    assert (tmp_path / "cleaned").exists() and raised in err, err
