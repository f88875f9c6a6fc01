"""``python -m puredist demo --islands``: islands of workers joined by shaped links,
one torchrun per island; nothing is left behind however the run ends."""

import json
import os
import re
import signal
import subprocess

import pytest

from namespaces import DEMO, ENV, namespaces as _namespaces, needs_namespaces, start_until
from puredist.demo import cli, island_report, islands, links


def _prefix(banner: str) -> str:
    return re.search(r"network namespaces (puredist-\d+-[0-9a-f]+)-router", banner)[1]


@pytest.mark.parametrize("options, message", [
    (["--islands", "3"], "--islands 3 needs at least 2 islands and --world-size a multiple of them (got --world-size 4)"),
    (["--islands", "1"], "--islands 1 needs at least 2 islands"),
    (["--islands", "2", "--algorithms", "ddp,periodic"], "--islands 2 runs ddp, hierarchical, diloco, streaming, "
                                                        "diloco_int4, not periodic"),
    (["--islands", "2", "--link", "10mbit,20mbit"], "--islands 2 takes one --link rate (the inter-island links'), got "
                                                   "10mbit,20mbit"),
    (["--islands", "2", "--kill-worker", "3"], "--islands 2 trains on the cpu (Gloo over the links), without --kill-worker"),
    (["--islands", "2", "--sync-every", "4", "--algorithms", "streaming"], "--algorithms streaming cannot run on islands "
                                                                          "with --sync-every 4"),
])
def test_island_options_that_cannot_run_are_refused_in_one_line_before_anything_starts(options, message, tmp_path,
                                                                                       capsys, monkeypatch):
    monkeypatch.setattr(islands.Islands, "__enter__", lambda self: pytest.fail("islands were built"))
    assert cli.main([*options, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: " + message), err


def test_without_what_islands_need_one_line_says_what_is_missing_and_nothing_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(links, "unavailable", lambda: "needs root (network namespaces and tc)")
    monkeypatch.setattr(islands.Islands, "__enter__", lambda self: pytest.fail("islands were built"))
    assert cli.main(["--islands", "2", "--output", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: --islands 2 needs root (network namespaces and tc)"


def _record(steps, step_s, blocked, crossed, evaluations, training_s, link=None, waits=()):
    return {"step_s": [step_s] * steps, "blocked_s": blocked, "crossed": crossed, "evaluations": evaluations,
            "training_s": training_s, "bytes_written": 1000, "link_bytes": link, "evaluation_waits_s": list(waits)}


def test_the_summary_reads_wall_time_utilization_time_to_target_and_the_model_as_documented():
    # two workers (one island each: the first of each reads its links); ddp: 4 steps unshaped, 2 shaped (cut)
    ddp = {"unshaped": [_record(4, 0.1, [0.05] * 4, [1, 2, 3, 4], [(2, 0.5, 2.0), (4, 0.6, 1.0)], [0.2, 0.4],
                                [800, 700]) for _ in range(2)],
           "shaped": [_record(2, 1.0, [0.9, 0.9], [1, 2], [(2, 0.5, 2.0)], [2.0], [800, 800]) for _ in range(2)]}
    # diloco: 8 steps, a crossing at steps 4 and 8 each 1000 bytes, the loss at step 4 within 1% of ddp's 1.0
    evaluations = [(4, 0.6, 1.009), (8, 0.7, 0.9)]
    diloco = {"unshaped": [_record(8, 0.1, [0.0] * 3 + [0.1] + [0.0] * 3 + [0.1], [4, 8], evaluations, [0.5, 1.0],
                                   [2000, 1500]) for _ in range(2)],
              "shaped": [_record(8, 0.1, [0.0] * 3 + [0.2] + [0.0] * 3 + [0.3], [4, 8], evaluations, [0.6, 1.25],
                                 [2000, 2000], waits=[0.05, 0.1]),
                         _record(8, 0.1, [0.0] * 8, [4, 8], evaluations, [0.6, 1.2], None, waits=[0.0, 0.2])]}
    results = {r: {"parameters": 1000, "algorithms": {"ddp": {k: v[r] for k, v in ddp.items()},
                                                      "diloco": {k: v[r] for k, v in diloco.items()}}}
               for r in range(2)}
    job = {"algorithms": ["ddp", "diloco"], "rate": ["8kbit", 8000.0], "task": "lm", "namespaces": [["a"], ["b"]],
           "options": {"delay": 2}}
    summary = island_report.summarize(job, results, {}, "title")
    model, rows = summary["network_model"], summary["islands"]["algorithms"]
    assert model["target_eval_loss"] == pytest.approx(1.01) and model["target_tolerance"] == 0.01
    # ddp: its shaped time per step (1 s) times its 4 steps; the target (1.01) first at step 4 of its unshaped curve
    assert rows["ddp"]["wall_s"] == pytest.approx(4.0) and rows["ddp"]["wall_from"] == "per step"
    assert rows["ddp"]["to_target_s"] == pytest.approx(4.0) and rows["ddp"]["steps_to_target"] == 4
    assert rows["ddp"]["utilization"] == pytest.approx(1 - 1.8 / 2.0)
    # the model: 0.4 s unshaped, then 4 crossings sharing the busiest direction's 800 bytes at 1000 bytes/s
    assert rows["ddp"]["projected_s"] == pytest.approx(0.4 + 0.8)
    # diloco: measured in full, its target at step 4 (1.009 <= 1.01) at the shaped run's 0.6 s
    assert rows["diloco"]["wall_s"] == 1.25 and rows["diloco"]["to_target_s"] == 0.6
    assert rows["diloco"]["utilization"] == pytest.approx(1 - 0.5 / 1.25)  # the lower of the two workers
    # of which waited before evaluations (counted in blocked): the most any worker did
    assert rows["diloco"]["evaluation_waits_s"] == pytest.approx(0.2)
    assert rows["diloco"]["projected_s"] == pytest.approx(1.0 + 2.0) and rows["diloco"]["eval_loss"] == 0.9
    assert rows["diloco"]["ratio"] == pytest.approx(1.25 / 3.0)
    # rho: 1000 fp32 parameters (32 kbit) take 4 s at 8 kbit/s; a step computes in (training - blocked) / steps
    compute = ((2.0 - 1.8) * 2 + (1.25 - 0.5) + 1.2) / (2 * 2 + 8 * 2)
    assert summary["islands"]["compute_s_per_step"] == pytest.approx(compute)
    assert summary["islands"]["rho"] == pytest.approx(4.0 / compute)
    table = island_report.islands_table(summary)
    assert "ddp's wall time is its time per step over the link (a run of 2 steps)" in table


def test_streaming_bytes_travel_behind_its_delay_in_the_model():
    unshaped = {"crossings": 4, "link_bytes": 4000, "training_s": [1.0], "compute_s_per_step": 0.1}
    # 1000 bytes a crossing at 1000 bytes/s: 1 s each; 2 steps of 0.1 s hide 0.2 s of each
    assert island_report.projected_seconds(unshaped, 8000.0, 2) == pytest.approx(1.0 + 4 * 0.8)
    assert island_report.projected_seconds(unshaped, 8000.0, 20) == pytest.approx(1.0)  # all hidden: no less
    assert island_report.projected_seconds({**unshaped, "crossings": 0}, 8000.0, 0) == 1.0


@needs_namespaces
def test_a_network_that_fails_half_built_is_removed_and_says_which_command_failed(monkeypatch):
    real, calls = links._ip, []

    def failing(*arguments):
        calls.append(arguments)
        if arguments[:3] == ("ip", "netns", "add") and arguments[3].endswith("i1w0"):
            raise links.LinkError("`ip netns add` failed: no")
        real(*arguments)

    monkeypatch.setattr(links, "_ip", failing)  # (Namespaces makes the namespaces, Islands the rest)
    monkeypatch.setattr(islands, "_ip", failing)
    built = islands.Islands(2, 1)
    with pytest.raises(links.LinkError, match="ip netns add"):
        built.__enter__()
    assert _namespaces(built.prefix) == [] and any(c[-1:] == (built.workers[0][0],) for c in calls)
    assert signal.getsignal(signal.SIGTERM) is not links._interrupt


@needs_namespaces
def test_islands_train_over_shaped_links_and_leave_nothing_behind(tmp_path):
    done = subprocess.run([*DEMO, "--islands", "2", "--world-size", "4", "--task", "digits", "--steps", "16",
                           "--algorithms", "ddp,diloco", "--sync-every", "4", "--warmup-steps", "4", "--link", "20mbit",
                           "--output", str(tmp_path)], capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr
    assert _namespaces(_prefix(done.stdout)) == [] and not list(tmp_path.glob(".islands-*"))
    summary = json.loads((tmp_path / "results.json").read_text())
    rows, runs = summary["islands"]["algorithms"], summary["runs"]
    assert summary["islands"]["rate"] == "20mbit" and summary["islands"]["rho"] > 0
    assert summary["network_model"]["target_tolerance"] == 0.01
    # ddp crosses the link every step; diloco after its warm-up (4) and every 4 steps: 8 of its 32 steps
    assert runs["ddp"]["unshaped"]["crossings"] == 16 and runs["diloco"]["shaped"]["crossings"] == 8
    # inside an island nothing crosses: diloco's DDP inside (4810 fp32 gradients a step, 32 steps) would be 615 KB
    assert runs["diloco"]["shaped"]["link_bytes"] < 32 * 4 * 4810 < runs["diloco"]["shaped"]["bytes_per_worker"]
    for row in rows.values():
        assert 0 < row["utilization"] <= 1 and row["wall_s"] > 0 and row["projected_s"] > 0
    # the links are shaped: a DDP step sends 29 KB each way (its ring all-reduce: 1.5 x the 4810 fp32 parameters)
    assert rows["ddp"]["wall_s"] / 16 >= 1.5 * 4 * 4810 * 8 / 20e6


@needs_namespaces
@pytest.mark.parametrize("ending", ["ctrl-c", "killed worker"])
def test_nothing_is_left_behind_when_an_islands_run_is_interrupted(ending, tmp_path):
    process, seen = start_until(["--islands", "2", "--world-size", "2", "--task", "digits", "--steps", "100000",
                                 "--algorithms", "ddp", "--output", str(tmp_path)], "ddp unshaped", timeout=120)
    try:
        prefix = _prefix(seen)
        assert len(_namespaces(prefix)) == 5  # the router, two gateways, a worker each
        if ending == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)
        else:
            pids = subprocess.run(["ip", "netns", "pids", f"{prefix}-i1w0"], capture_output=True, text=True).stdout
            os.kill(int(pids.split()[0]), signal.SIGKILL)
        code = process.wait(timeout=90)
        assert code == (1 if ending == "killed worker" else 130), process.stderr.read()
        assert _namespaces(prefix) == [] and not list(tmp_path.glob(".islands-*"))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.parametrize("sync_every, fragments, delay, warmup", [(96, 4, 8, 32), (96, 4, 23, 0), (48, 3, 15, 7),
                                                                 (16, 2, 7, 1)])
def test_no_evaluation_falls_while_a_streaming_synchronization_is_in_flight(sync_every, fragments, delay, warmup):
    # an evaluation drains what is in flight first (blocked time that training would not have): none may be
    import puredist
    from puredist.demo.island_run import evaluation_steps
    from puredist.outer.config import OuterConfig
    from puredist.outer.timeline import started_in_flight

    options = {"sync_every": sync_every, "fragments": fragments, "delay": delay, "warmup_steps": warmup}
    every, at = evaluation_steps(320, options)
    config = OuterConfig(puredist.sgd(lr=1.0), sync_every, warmup, delay, fragments)
    evaluated = [k for k in range(1, 641) if k % every == at]
    assert len(evaluated) >= 10 * 2  # about 15 in DDP's 320 steps, twice that in the local methods' 640
    assert all(started_in_flight(config, f, k) == -1 for k in evaluated for f in range(fragments))
