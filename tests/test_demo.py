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


def run_demo(output, *options: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    """The main job with ``options``, writing into ``output``: the finished process
    (asserted to have succeeded) and ``results.json``'s runs per algorithm."""
    done = subprocess.run([*DEMO, *options, "--output", str(output)], capture_output=True, text=True,
                          timeout=timeout, env=ENV)
    assert done.returncode == 0, done.stderr
    return done, json.loads((output / "results.json").read_text())["algorithms"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    done = subprocess.run(
        [*DEMO, "--world-size", "2", "--steps", "40", "--output", str(out)],
        capture_output=True, text=True, timeout=240, env=ENV,
    )
    return done, out


ALGORITHMS = ["ddp", "periodic", "hierarchical", "zero", "diloco", "streaming", "diloco_int8", "diloco_int4", "diloco_int2",
              "diloco_sparse", "diloco_ft"]


def test_the_demo_trains_every_algorithm_and_writes_its_report(tiny_run):
    done, out = tiny_run
    assert done.returncode == 0, done.stderr
    for algorithm in ALGORITHMS:
        assert f"  {algorithm}" in done.stdout
    assert "PROJECTED (network model, not measured)" in done.stdout
    assert (out / "demo.png").stat().st_size > 10_000
    summary = json.loads((out / "results.json").read_text())
    assert summary["task"] == "digits" and summary["world_size"] == 2
    assert list(summary["algorithms"]) == ALGORITHMS
    config = summary["config"]  # what ran, to run it again
    assert (config["task"], config["steps"], config["seed"], config["world_size"]) == ("digits", 40, 0, 2)
    assert config["optimizer"] == "sgd" and config["versions"]["puredist"] and config["versions"]["torch"]
    assert "(* the fastest on that link" in done.stdout and "(* the lowest on that link" in done.stdout
    for row in summary["algorithms"].values():
        assert row["eval_accuracy"] > 0.5  # 40 steps of SGD learn the digits well past chance (10 %)
        # the held-out loss of the averaged model falls below a uniform guess's (ln 10)
        assert row["eval_loss"] < 2.0 and row["eval_loss"] == row["evaluations"][-1]["loss"]
        assert len(row["train_losses"]) == 40 and len(row["step_bytes"]) == 40
        assert row["state_bytes_max"] > 0


def test_the_measured_bytes_follow_the_algorithms(tiny_run):
    _, out = tiny_run
    runs = json.loads((out / "results.json").read_text())["algorithms"]
    # ZeRO overlapped with DDP is DDP + SGD, step for step
    assert runs["zero"]["eval_loss"] == pytest.approx(runs["ddp"]["eval_loss"], rel=1e-5)
    # and a worker holds less optimizer state (its shard: here the largest of 4 tensors);
    # DiLoCo holds more (the global copy and the outer momentum besides the inner state)
    assert runs["zero"]["state_bytes_max"] < runs["ddp"]["state_bytes_max"] < runs["diloco"]["state_bytes_max"]
    # periodic averaging all-reduces parameters on 4 of 40 steps, DDP gradients on all 40
    assert runs["periodic"]["bytes_per_worker"] < 0.3 * runs["ddp"]["bytes_per_worker"]
    # ZeRO adds the owners' broadcasts to DDP's all-reduce
    assert runs["zero"]["bytes_per_worker"] > runs["ddp"]["bytes_per_worker"]
    # DiLoCo synchronizes after inner steps 16, 24, 32 and 40, periodic averaging (torch's count, from 0) after 17,
    # 25 and 33: each with bf16 pseudo-gradients, about half of an fp32 averaging
    def syncs(name):
        sent = runs[name]["step_bytes"]
        return [step for step, b in enumerate(sent) if b > 0.5 * max(sent)]

    assert syncs("diloco") == [15, 23, 31, 39] and syncs("periodic") == [16, 24, 32]
    assert 0.4 < (runs["diloco"]["bytes_per_worker"] / 4) / (runs["periodic"]["bytes_per_worker"] / 3) < 0.7
    # streaming DiLoCo sends each fragment as often as DiLoCo sends the whole model: the
    # same bytes in twice the messages, within the fixed overhead of each
    assert 0.7 < runs["streaming"]["bytes_per_worker"] / runs["diloco"]["bytes_per_worker"] < 1.5
    # int8, 4-bit, 2-bit, 64 values of 4096: less and less (the rest is fixed overhead)
    sent = [runs[a]["bytes_per_worker"] for a in ("diloco", "diloco_int8", "diloco_int4", "diloco_int2", "diloco_sparse")]
    assert sent == sorted(sent, reverse=True) and len(set(sent)) == 5
    # over torchft: the same synchronizations, with the quorums' and heartbeats' bytes instead of the rank checks'
    assert 0.7 < runs["diloco_ft"]["bytes_per_worker"] / runs["diloco"]["bytes_per_worker"] < 1.5
    # and without a fault the same training: the same model, up to the order of the sums
    assert runs["diloco_ft"]["eval_loss"] == pytest.approx(runs["diloco"]["eval_loss"], rel=1e-3)
    assert runs["diloco_ft"]["faults"] == {} and runs["diloco_ft"]["failed_syncs"] == 0


def test_the_projection_follows_the_network_model(tiny_run):
    _, out = tiny_run
    summary = json.loads((out / "results.json").read_text())
    model, runs = summary["network_model"], summary["algorithms"]
    assert model["projected_not_measured"] and model["target_from"] == "ddp"
    # the target: within 1% of DDP's final held-out loss, so a run ending 0.5% above it is marked as reaching it
    assert model["final_eval_loss"] == runs["ddp"]["eval_loss"] and model["target_tolerance"] == 0.01
    assert model["target_eval_loss"] == pytest.approx(1.01 * runs["ddp"]["eval_loss"], rel=1e-12)
    compute = model["compute_s_per_step"]
    assert 0 < compute < 1.0
    # only streaming DiLoCo's bytes travel behind compute: 2 steps of it, the delay before a fragment is applied
    assert {name: row["overlap_steps"] for name, row in runs.items() if row["overlap_steps"]} == {"streaming": 2}
    for row in runs.values():  # the training time at each evaluation, the slowest worker's: it grows step by step
        assert len(row["training_s"]) == len(row["evaluations"]) and row["training_s"] == sorted(row["training_s"])
    assert runs["ddp"]["steps_to_target"] is not None  # DDP reaches its own final loss, at the latest at the end
    # the hierarchical run's group size per step follows its schedule: given exactly where it sent bytes
    hierarchical = runs["hierarchical"]
    assert [g is not None for g in hierarchical["step_group_sizes"]] == [b > 0 for b in hierarchical["step_bytes"]]
    # the local methods' warm-up (16 steps) and their steps between synchronizations sent nothing: compute is
    # the mean of those steps' durations, so several runs have steps that sent nothing at all
    assert sum(row["step_bytes"].count(0) for row in runs.values()) > 40
    for name, row in runs.items():
        reached = next((e["step"] for e in row["evaluations"] if e["loss"] <= model["target_eval_loss"]), None)
        assert row["steps_to_target"] == reached, name
        for link in model["links"]:
            projected = row["projected_s"][link["name"]]
            if reached is None:
                assert projected is None
                continue
            expected = _projected(row, reached, compute, link, summary["world_size"])
            assert projected == pytest.approx(expected, rel=1e-9), (name, link)


def test_within_one_time_budget_each_link_compares_what_every_run_covers(tiny_run):
    _, out = tiny_run
    summary = json.loads((out / "results.json").read_text())
    model, runs = summary["network_model"], summary["algorithms"]
    for link in model["links"]:
        whole_runs = {name: _projected(row, 40, model["compute_s_per_step"], link, summary["world_size"])
                      for name, row in runs.items()}
        budget = model["budget_s"][link["name"]]
        assert budget == pytest.approx(min(whole_runs.values()), rel=1e-9)
        for name, row in runs.items():
            in_time = [e["loss"] for e in row["evaluations"]
                       if _projected(row, e["step"], model["compute_s_per_step"], link, summary["world_size"])
                       <= budget * (1 + 1e-9)]
            assert row["projected_loss_within_budget"][link["name"]] == min(in_time, default=None), (name, link)
    # on the slowest link, local methods send a fraction of DDP's bytes and so get further than DDP in the same time
    slowest = model["links"][-1]["name"]
    assert runs["diloco"]["projected_loss_within_budget"][slowest] < runs["ddp"]["projected_loss_within_budget"][slowest]


def _projected(row, steps, compute, link, world_size):
    """The network model, written out again: the training time measured up to the evaluated step, then per
    sending step its bytes in TCP's full frames (1514 bytes a 1448-byte segment, a 66-byte acknowledgement for
    each segment received) over the bandwidth less the compute it travels behind (streaming: 2 steps), and
    2 (g - 1) latencies over the g workers its collective spans (all but at a hierarchy's lower levels)."""
    sizes = row["step_group_sizes"] or [world_size] * len(row["step_bytes"])
    steps_evaluated = [e["step"] for e in row["evaluations"]]
    total = row["training_s"][steps_evaluated.index(steps)]
    hidden = row["overlap_steps"] * compute
    for sent, size in zip(row["step_bytes"][:steps], sizes):
        if sent:
            total += max(0.0, sent * (1514 + 66) / 1448 / link["bytes_per_second"] - hidden)
            total += 2 * ((size or world_size) - 1) * link["latency_s"]
    return total


@pytest.mark.parametrize(
    "options, message",
    [
        (["--world-size", "0"], "--world-size: must be at least 1, got 0"),
        (["--steps", "many"], "--steps: expected a whole number"),
        (["--algorithms", "ddp,sparkle"], "unknown algorithm(s) ['sparkle']"),
        (["--task", "poetry"], "--task: invalid choice: 'poetry'"),
        (["--sync-every", "0"], "argument --sync-every: must be a whole number of steps, at least 1, got 0"),
        (["--sync-every", "1.5"], "argument --sync-every: expected a whole number, got '1.5'"),
        (["--warmup-steps", "-1"], "argument --warmup-steps: must be a whole number of steps, at least 0, got -1"),
        (["--inner-lr", "0"], "argument --inner-lr: must be a finite number above 0, got 0"),
        (["--inner-lr", "inf"], "argument --inner-lr: must be a finite number above 0, got inf"),
        (["--outer-lr", "-0.7"], "argument --outer-lr: must be a finite number above 0, got -0.7"),
        (["--outer-lr", "fast"], "argument --outer-lr: expected a number, got 'fast'"),
        (["--outer-momentum", "1"], "argument --outer-momentum: must be a number in [0, 1), got 1"),
        (["--outer-momentum", "nan"], "argument --outer-momentum: must be a number in [0, 1), got nan"),
        (["--block-size", "63"], "argument --block-size: must be an even whole number, at least 2"),
        (["--block-size", "0"], "argument --block-size: must be an even whole number, at least 2"),
    ],
)
def test_bad_options_give_a_message_and_exit_2(options, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(options)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_period_streaming_cannot_overlap_is_refused_before_any_worker_starts(tmp_path, capsys):
    assert cli.main(["--algorithms", "ddp,streaming", "--sync-every", "2", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert ("--algorithms streaming cannot run with --sync-every 2 and --warmup-steps 16 (Arg ``delay`` must be an int "
            "in [0, 1] for sync_every=2, got 2.)") in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_period_only_streaming_cannot_run_trains_the_algorithms_asked_for(tmp_path):
    # every algorithm's setup was built in every worker: streaming's (its delay needs --sync-every >= 3) killed a
    # run of periodic alone with three tracebacks
    done, runs = run_demo(tmp_path, "--sync-every", "2", "--algorithms", "periodic,diloco", "--world-size", "2",
                          "--steps", "4", "--warmup-steps", "0", timeout=240)
    assert list(runs) == ["periodic", "diloco"] and "Traceback" not in done.stderr
    for algorithm in runs:  # H = 2 from the start: twice in 4 steps (the averager at counts 0 and 2: steps 1, 3)
        synchronized = [k for k, sent in enumerate(runs[algorithm]["step_bytes"], start=1) if sent > 1024]
        assert len(synchronized) == 2 and (algorithm != "periodic" or synchronized == [1, 3]), (algorithm, synchronized)


def test_the_study_options_reach_the_workers_and_the_record(tmp_path):
    options = ["--world-size", "2", "--steps", "20", "--algorithms", "periodic,diloco_int4,diloco_sparse",
               "--sync-every", "5", "--warmup-steps", "3", "--inner-lr", "0.02", "--outer-lr", "0.5",
               "--outer-momentum", "0.25", "--block-size", "32", "--top-k", "16"]
    _, runs = run_demo(tmp_path, *options, timeout=240)
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    assert (config["period"], config["warmup_steps"], config["block_size"]) == (5, 3, 32)
    assert config["optimizer_options"] == {"lr": 0.02, "momentum": 0.9}
    assert config["outer_options"] == {"lr": 0.5, "momentum": 0.25, "nesterov": True}
    assert config["sparse_outer_options"] == {"lr": 0.5, "momentum": 0.25, "nesterov": True} and config["top_k"] == 16
    # 20 minibatches of 32 digits of a shard of 719 (the 1438 training digits between 2 workers), with replacement
    assert config["data_passes"] == pytest.approx(20 * 32 / 719)
    # after inner step k (1-based): torch's periodic rule at the averager's count k - 1 (k - 1 >= warmup and
    # (k - 1 - warmup) % H == 0), DiLoCo's at the count of completed inner steps (k >= warmup and (k - warmup) % H
    # == 0); a synchronization sends kilobytes (the 4810-parameter model: 20 KB in fp32, 4 KB in 4-bit), the
    # compressed path's first call only its layout digest (a few hundred bytes)
    expected = {"periodic": [k for k in range(1, 21) if k - 1 >= 3 and (k - 1 - 3) % 5 == 0],
                "diloco_int4": [k for k in range(1, 21) if k >= 3 and (k - 3) % 5 == 0]}
    for algorithm in ("periodic", "diloco_int4"):
        synchronized = [k for k, sent in enumerate(runs[algorithm]["step_bytes"], start=1) if sent > 1024]
        assert synchronized == expected[algorithm], (algorithm, runs[algorithm]["step_bytes"])


def test_an_unwritable_output_folder_is_refused_before_any_worker_starts(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["--output", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "is not a writable folder" in err and "Traceback" not in err


@pytest.mark.parametrize("options, message", [
    (["--algorithms", "diloco", "--kill-worker", "5"], "--kill-worker 5 kills a worker of a fault-tolerant algorithm"),
    (["--algorithms", "diloco_ft", "--kill-worker", "5", "--world-size", "1"], "needs a worker that survives"),
    (["--algorithms", "diloco_ft", "--kill-worker", "500", "--steps", "40"], "and a step of the run (--steps 40)"),
])
def test_kill_worker_options_that_cannot_run_are_refused_before_any_worker_starts(options, message, tmp_path, capsys):
    assert cli.main([*options, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_without_torchft_the_default_run_leaves_diloco_ft_out_and_asking_for_it_gives_the_install_hint(
    tmp_path, capsys, monkeypatch
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    assert cli.main(["--algorithms", "diloco_ft", "--output", str(tmp_path)]) == 2
    assert "needs torchft: pip install -e '.[ft]' -c constraints.txt (in puredist's clone)" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["--output", str(tmp_path)])
    args.steps = 10
    assert cli._choose_algorithms(args) is None and "diloco_ft" not in args.algorithms
    assert "it needs torchft" in capsys.readouterr().out


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
    assert err.strip().endswith("pip install -e '.[demo]' -c constraints.txt (in puredist's clone)")
    assert len(err.strip().splitlines()) == 1
    assert cli.DEMO_EXTRAS[absent] in err


def test_an_algorithm_named_twice_trains_once():
    args = cli.build_parser().parse_args(["--algorithms", "ddp,diloco,ddp"])
    assert args.algorithms == ["ddp", "diloco"]


def test_the_ratio_to_the_first_algorithm_is_not_shown_when_it_sent_nothing():
    from puredist.demo.report import table

    row = {"eval_loss": 1.0, "eval_accuracy": 0.5, "wall_s": 1.0, "bytes_per_worker_max": 0, "state_bytes_max": 1}
    summary = {"algorithms": {"local": {**row, "bytes_per_worker": 0}, "ddp": {**row, "bytes_per_worker": 10**6}}}
    lines = table(summary).splitlines()
    assert all(" n/a " in line for line in lines[1:]), lines


def test_the_plot_has_one_legend_a_point_per_algorithm_against_bytes_and_the_wall_times(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    from puredist.demo.report import plot

    def row(loss, sent, wall, killed=None):
        evaluations = [{"step": s, "accuracy": 0.5, "loss": loss + 1 / s, "bytes_per_worker": sent * s // 4}
                       for s in (1, 2, 4)]  # bytes start at 0 before the first synchronization
        return {"evaluations": evaluations, "eval_loss": loss + 0.25, "bytes_per_worker": sent, "wall_s": wall,
                "faults": {"killed": killed}}

    runs = {"ddp": row(0.1, 2**24, 2.0), "diloco": row(0.2, 2**18, 1.0),
            "diloco_ft": row(0.2, 2**19, 3.0, killed={"worker": 1, "step": 2})}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    plot({"algorithms": runs, "title": "t", "world_size": 4}, tmp_path / "demo.png")
    (figure,) = figures
    curves, tradeoff, wall = figure.axes
    assert len(figure.legends) == 1 and all(axis.get_legend() is None for axis in figure.axes)
    assert [t.get_text() for t in figure.legends[0].texts] == [*runs, "diloco_ft: worker killed"]
    assert tradeoff.get_xscale() == "log" and not tradeoff.lines  # points only: no line through zero bytes
    points = [tuple(c.get_offsets()[0]) for c in tradeoff.collections]
    assert points == [(r["bytes_per_worker"] / 2**20, r["eval_loss"]) for r in runs.values()]
    assert [bar.get_width() for bar in wall.patches] == [r["wall_s"] for r in runs.values()]
    assert [label.get_text() for label in wall.get_yticklabels()] == list(runs)


def test_each_projected_table_explains_its_mark_in_a_line_of_its_own():
    from puredist.demo.network import LINKS
    from puredist.demo.report import projection_table

    links = [link._asdict() for link in LINKS]
    row = {"steps_to_target": 1, "projected_s": {}, "projected_loss_within_budget": {}}
    for link in links:
        row["projected_s"][link["name"]] = row["projected_loss_within_budget"][link["name"]] = 1.0
    model = {"compute_s_per_step": 0.1, "target_eval_loss": 0.0, "target_tolerance": 0.01, "final_eval_loss": 0.0,
             "target_from": "ddp", "links": links,
             "budget_s": {link["name"]: 1.0 for link in links}}
    lines = projection_table({"algorithms": {"ddp": row}, "network_model": model}).splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("ddp ")]
    assert len(rows) == 2 and all(lines[i + 1].startswith("(* the ") for i in rows)
    assert "lowest evaluation within the time" in lines[rows[1] + 1]  # why a run that ends lower is not marked


def test_outer_options_are_the_papers_or_sparselocos_then_the_tasks_then_the_knobs():
    from puredist.demo import charlm, digits
    from puredist.demo.knobs import Knobs, outer_options
    from puredist.demo.training import refusal

    assert outer_options(Knobs(), charlm.TASK) == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert outer_options(Knobs(), digits.TASK) == {"lr": 1.0, "momentum": 0.5, "nesterov": True}  # its sweep's
    assert outer_options(Knobs(outer_lr=0.3), digits.TASK) == {"lr": 0.3, "momentum": 0.5, "nesterov": True}
    # no momentum: plain SGD on the pseudo-gradient (Nesterov needs one), which runs
    assert outer_options(Knobs(outer_momentum=0.0), digits.TASK) == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    assert refusal(digits.TASK, Knobs(outer_momentum=0.0), 4, ["diloco", "streaming", "diloco_int8"]) is None
    # diloco_sparse: SparseLoCo's step (no momentum: error feedback stands in), not the task's; the knobs still apply
    assert outer_options(Knobs(), digits.TASK, sparse=True) == {"lr": 1.5, "momentum": 0.0, "nesterov": False}
    assert outer_options(Knobs(outer_lr=2.0), charlm.TASK, sparse=True) == {"lr": 2.0, "momentum": 0.0, "nesterov": False}


def test_help_explains_the_options():
    done = subprocess.run([*DEMO, "--help"], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0
    for option in ("--task", "--world-size", "--steps", "--algorithms", "--output", "--seed"):
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


def test_a_worker_killed_in_a_fault_tolerant_run_restarts_heals_and_the_run_ends(tmp_path):
    done, runs = run_demo(tmp_path, "--world-size", "3", "--steps", "60", "--algorithms",
                          "diloco_ft,diloco,torchft_diloco", "--kill-worker", "30", timeout=300)
    # in the order given, though the fault-tolerant runs run last: the first is the report's reference
    assert list(runs) == ["diloco_ft", "diloco", "torchft_diloco"] and "of diloco_ft's final " in done.stdout
    # the digits' period is 8: diloco_ft's synchronizations (each a commit) end its 16 warm-up steps, then steps 24,
    # 32...; torchft's DiLoCo (no warm-up) commits at steps 8, 16, 24...
    for algorithm, last_commit in (("diloco_ft", 24), ("torchft_diloco", 24)):
        faults = runs[algorithm]["faults"]
        assert faults["killed"] == {"worker": 2, "step": 30, "last_commit_step": last_commit}, algorithm
        assert faults["rejoined"]["worker"] == 2 and 30 <= faults["rejoined"]["step"] < 60, algorithm
        assert 0 < faults["recovery_s"] < 30 and faults["steps_lost"] == faults["rejoined"]["step"] - last_commit
        assert runs[algorithm]["failed_syncs"] == 0, algorithm  # the kill fell between synchronizations
        # the run goes on: the model still learns the digits, near the run without a fault
        assert runs[algorithm]["eval_accuracy"] > 0.8, algorithm
        assert runs[algorithm]["eval_loss"] < 1.25 * runs["diloco"]["eval_loss"], algorithm
        assert f"{algorithm:14s} worker 2 killed at step 30; rejoined" in done.stdout
    assert "FAULTS (fault-tolerant algorithms):" in done.stdout


def test_a_worker_killed_before_the_first_commit_rejoins_at_it(tmp_path):
    # torchft heals only a replica that is behind: killed before any commit, the restart is not behind its peers,
    # and it rejoins at their first commit (step H = 8) without a heal (or, if it missed that quorum, heals at
    # the next)
    _, runs = run_demo(tmp_path, "--world-size", "2", "--steps", "24", "--algorithms", "torchft_diloco",
                       "--kill-worker", "5", timeout=120)
    run = runs["torchft_diloco"]
    assert run["faults"]["killed"] == {"worker": 1, "step": 5, "last_commit_step": 0}
    rejoined = run["faults"]["rejoined"]
    assert rejoined in ({"worker": 1, "step": 8}, {"worker": 1, "step": 16})
    assert run["faults"]["steps_lost"] == rejoined["step"] and run["failed_syncs"] == 0


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
    # the four at once (each process mostly imports torch)
    running = [subprocess.Popen([*command, *arguments], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=ENV) for arguments in (["--help"], ["--version"], [], ["train"])]
    (helped, _), (versioned, _), (_, bare), (_, unknown) = (process.communicate(timeout=60) for process in running)
    codes = [process.returncode for process in running]
    assert codes == [0, 0, 2, 2], codes
    assert "commands:" in helped and "\n  demo " in helped
    assert versioned.strip() == puredist.__version__ == version("puredist")
    assert "commands:" in bare and "unknown command 'train'" in unknown
    assert (Path(puredist.__file__).parent / "py.typed").is_file()  # typed package (PEP 561)
