"""The main job, at tiny size: it trains, measures, reports; bad options and Ctrl-C
end cleanly."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from puredist.demo import cli

DEMO = [sys.executable, "-m", "puredist", "demo"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    done = subprocess.run(
        [*DEMO, "--world-size", "2", "--steps", "40", "--output", str(out)],
        capture_output=True, text=True, timeout=240, env=ENV,
    )
    return done, out


def test_the_demo_trains_every_algorithm_and_writes_its_report(tiny_run):
    done, out = tiny_run
    assert done.returncode == 0, done.stderr
    algorithms = ["ddp", "periodic", "hierarchical", "zero", "diloco", "diloco_int4", "diloco_topk"]
    for algorithm in algorithms:
        assert f"  {algorithm}" in done.stdout
    assert (out / "demo.png").stat().st_size > 10_000
    summary = json.loads((out / "results.json").read_text())
    assert list(summary) == algorithms
    for row in summary.values():
        assert row["heldout_accuracy"] > 0.5  # 40 steps of SGD learn the digits well past chance (10 %)
        # the held-out loss of the averaged model falls below a uniform guess's (ln 10)
        assert row["heldout_loss"] < 2.0 and row["heldout_loss"] == row["evaluations"][-1][2]
        assert len(row["train_losses"]) == 40
        assert row["state_bytes_max"] > 0


def test_the_measured_bytes_follow_the_algorithms(tiny_run):
    _, out = tiny_run
    summary = json.loads((out / "results.json").read_text())
    # ZeRO overlapped with DDP is DDP + SGD, step for step
    assert summary["zero"]["heldout_loss"] == pytest.approx(summary["ddp"]["heldout_loss"], rel=1e-5)
    # and a worker holds less optimizer state (its shard: here the largest of 4 tensors);
    # DiLoCo holds more (the global copy and the outer momentum besides the inner state)
    assert summary["zero"]["state_bytes_max"] < summary["ddp"]["state_bytes_max"] < summary["diloco"]["state_bytes_max"]
    # periodic averaging all-reduces parameters on 4 of 40 steps, DDP gradients on all 40
    assert summary["periodic"]["bytes_sent"] < 0.3 * summary["ddp"]["bytes_sent"]
    # ZeRO adds the owners' broadcasts to DDP's all-reduce
    assert summary["zero"]["bytes_sent"] > summary["ddp"]["bytes_sent"]
    # DiLoCo syncs as often as periodic averaging, with bf16 pseudo-gradients: about half
    assert 0.4 < summary["diloco"]["bytes_sent"] / summary["periodic"]["bytes_sent"] < 0.7
    # 4-bit payloads send less than bf16, top-1 % less still (the rest is fixed overhead)
    assert summary["diloco_topk"]["bytes_sent"] < summary["diloco_int4"]["bytes_sent"] < summary["diloco"]["bytes_sent"]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--world-size", "0"], "--world-size: must be at least 1, got 0"),
        (["--steps", "many"], "--steps: expected a whole number"),
        (["--algorithms", "ddp,sparkle"], "unknown algorithm(s) ['sparkle']"),
    ],
)
def test_bad_options_give_a_message_and_exit_2(options, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(options)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unwritable_output_folder_is_refused_before_any_worker_starts(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["--output", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "is not a writable folder" in err and "Traceback" not in err


def test_more_workers_than_the_machine_holds_are_refused(tmp_path, capsys):
    assert cli.main(["--world-size", "1000", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--world-size 1000 is more worker processes than this machine holds" in err and "at most" in err


@pytest.mark.parametrize("absent", ["sklearn", "matplotlib"])
def test_missing_demo_extras_give_the_install_hint_before_anything_starts(absent, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else real(name, *a))
    assert cli.main(["--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("pip install 'puredist[demo]'") and len(err.strip().splitlines()) == 1
    assert cli.DEMO_EXTRAS[absent] in err


def test_help_explains_the_options():
    done = subprocess.run([*DEMO, "--help"], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0
    for option in ("--world-size", "--steps", "--algorithms", "--output", "--seed"):
        assert option in done.stdout


def _session_processes(session_id):
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session_id and fields[0] != "Z":
                alive.append(int(entry))
    return alive


def test_ctrl_c_stops_every_worker(tmp_path):
    process = subprocess.Popen(
        [*DEMO, "--world-size", "2", "--steps", "100000", "--output", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True,
    )
    try:
        seen = ""  # the banner, then ddp's progress bar (tqdm ends its line only when done)
        deadline = time.monotonic() + 60
        while "ddp" not in seen and time.monotonic() < deadline:
            if select.select([process.stdout], [], [], 1.0)[0]:
                seen += os.read(process.stdout.fileno(), 4096).decode()
        assert "ddp" in seen, seen  # workers are training
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        interrupted = time.monotonic()
        code = process.wait(timeout=60)
        assert time.monotonic() - interrupted <= 5.0, "Ctrl-C took more than 5 s to exit"
        assert code == 130
        assert "interrupted" in process.stderr.read()
        deadline = time.monotonic() + 30
        while _session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session_processes(process.pid) == []
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_the_package_lists_its_commands_and_version():
    from importlib.metadata import version
    from pathlib import Path

    import puredist

    command = [sys.executable, "-m", "puredist"]
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0 and "commands:" in done.stdout and "\n  demo " in done.stdout
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0 and done.stdout.strip() == puredist.__version__ == version("puredist")
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 2 and "commands:" in done.stderr
    assert (Path(puredist.__file__).parent / "py.typed").is_file()  # typed package (PEP 561)
