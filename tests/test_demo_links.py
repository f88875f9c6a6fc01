"""``python -m puredist demo --link``: workers in network namespaces on rate-limited
links; nothing is left behind however the run ends."""

import json
import os
import re
import signal
import subprocess

import pytest

from namespaces import DEMO, ENV, namespaces as _namespaces, needs_namespaces, start_until
from puredist.demo import cli, links, network


def _prefix(banner: str) -> str:
    """The run's namespace prefix, from the line the demo prints when it has made them."""
    return re.search(r"network namespaces (puredist-\d+-[0-9a-f]+)-w0", banner)[1]


def test_rates_are_read_as_tc_reads_them():
    assert links.parse_rates("20mbit,100Mbit,20mbit,1.5gbit,500kbit") == [
        links.Rate("20mbit", 20e6), links.Rate("100mbit", 100e6), links.Rate("1.5gbit", 1.5e9),
        links.Rate("500kbit", 500e3)]
    for bad in ("20mbps", "fast", "", "10bit", "mbit"):
        with pytest.raises(ValueError, match="expected rates like 20mbit"):
            links.parse_rates(bad)


def test_a_bad_rate_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--link", "20mbps"])
    assert exited.value.code == 2 and "--link: expected rates like 20mbit" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--algorithms", "ddp,diloco_ft"], "--link runs the algorithms torch's launcher starts, not diloco_ft"),
    (["--device", "cuda"], None),  # refused for the device (no GPU here) or for --link: either way before a start
])
def test_link_options_that_cannot_run_are_refused_before_anything_starts(options, message, tmp_path, capsys):
    assert cli.main(["--link", "20mbit", *options, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert message is None or message in err


def test_without_what_links_need_one_line_says_what_is_missing_and_nothing_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(links, "unavailable", lambda: "needs iproute2 (tc not found): apt-get install iproute2")
    monkeypatch.setattr(links.Network, "__enter__", lambda self: pytest.fail("a network was built"))
    assert cli.main(["--link", "20mbit", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --link 20mbit needs iproute2 (tc not found): apt-get install iproute2"


def test_the_comparison_is_the_shaped_runs_time_beside_the_unshaped_runs_time_plus_its_bytes_at_the_rate():
    evaluations = [{"step": 2}, {"step": 4}, {"step": 6}]
    unshaped = {"eval_loss": 0.5, "evaluations": evaluations, "training_s": [0.1, 0.2, 0.3],
                "step_bytes": [0, 0, 1000, 0, 3000, 0], "step_group_sizes": None, "overlap_steps": 0,
                "wire_bytes_per_byte": 1.1}
    baseline = {"world_size": 2, "algorithms": {"ddp": unshaped}, "network_model": {"compute_s_per_step": 0.01}}
    shaped = {"eval_loss": 0.5, "evaluations": evaluations, "training_s": [0.2, 1.3, 4.6], "steps_to_target": 4}
    row = links.compare({"algorithms": {"ddp": shaped}}, baseline, links.Rate("8kbit", 8000.0))["ddp"]
    # 8 kbit/s = 1000 bytes/s, no latency: the unshaped run's 0.3 s and 4400 bytes of frames; to the target (step
    # 4) its 0.2 s and 1100 bytes; measured: the shaped run's training time at those evaluations
    assert row["baseline_s"] == 0.3 and row["transfer_s"] == pytest.approx(4.4)
    assert row["projected_s"] == pytest.approx(0.3 + 4.4) and row["measured_s"] == 4.6
    assert row["projected_to_target_s"] == pytest.approx(0.2 + 1.1) and row["measured_to_target_s"] == 1.3
    assert row["ratio"] == pytest.approx(4.6 / 4.7) and row["ratio_to_target"] == pytest.approx(1.3 / 1.3)
    assert row["wire_bytes_per_byte"] == 1.1 and row["eval_loss"] == 0.5
    # streaming: 2 steps of 10 ms compute hide 20 ms of each sending step's bytes in the projection, not in transfer_s
    unshaped["overlap_steps"] = 2
    row = links.compare({"algorithms": {"ddp": shaped}}, baseline, links.Rate("8kbit", 8000.0))["ddp"]
    assert row["projected_s"] == pytest.approx(0.3 + 4.4 - 2 * 0.02) and row["transfer_s"] == pytest.approx(4.4)
    shaped["steps_to_target"] = None
    row = links.compare({"algorithms": {"ddp": shaped}}, baseline, links.Rate("8kbit", 8000.0))["ddp"]
    assert row["measured_to_target_s"] is row["projected_to_target_s"] is row["ratio_to_target"] is None


@needs_namespaces
def test_the_demo_trains_over_shaped_links_and_leaves_no_namespace(tmp_path):
    done = subprocess.run([*DEMO, "--world-size", "2", "--steps", "24", "--algorithms", "ddp,diloco", "--link",
                           "20mbit", "--output", str(tmp_path)], capture_output=True, text=True, timeout=240, env=ENV)
    assert done.returncode == 0, done.stderr
    assert _namespaces(_prefix(done.stdout)) == []
    result = json.loads((tmp_path / "results.json").read_text())
    assert list(result["links"]) == ["20mbit"] and list(result["links"]["20mbit"]) == ["ddp", "diloco"]
    assert result["config"]["link"] == ["20mbit"] and list(result["runs"]) == ["unshaped", "20mbit"]
    runs, unshaped = result["runs"]["20mbit"]["algorithms"], result["runs"]["unshaped"]["algorithms"]
    for algorithm, row in result["links"]["20mbit"].items():
        assert row["eval_loss"] == runs[algorithm]["eval_loss"] == unshaped[algorithm]["eval_loss"] < 2.3  # < ln 10
        assert row["measured_s"] == runs[algorithm]["training_s"][-1]
        assert row["baseline_s"] == unshaped[algorithm]["training_s"][-1]
        assert row["projected_s"] > row["baseline_s"]
        assert row["ratio"] == pytest.approx(row["measured_s"] / row["projected_s"])
        # measured on the unshaped link: more bytes of frames than of payload (headers, acknowledgements), not twice
        assert 1.0 < row["wire_bytes_per_byte"] == unshaped[algorithm]["wire_bytes_per_byte"] < 2.0
    # the link is shaped: no worker sent its bytes faster than 20 Mbit/s (on loopback DDP's 24 steps take ~50 ms)
    ddp = result["links"]["20mbit"]["ddp"]
    assert ddp["measured_s"] >= runs["ddp"]["bytes_per_worker_max"] / (20e6 / 8)
    assert ddp["steps_to_target"] == 24 and ddp["measured_to_target_s"] == ddp["measured_s"]
    assert "MEASURED over real links" in done.stdout and "20mbit: by measured time to within 1% of ddp's final: " in done.stdout


@needs_namespaces
def test_a_network_that_fails_half_built_is_removed_and_says_which_command_failed(monkeypatch):
    real, calls = links._ip, []

    def failing(*arguments):
        calls.append(arguments)
        if len(calls) == 14:  # the second worker's namespace is made, its veth pair not yet
            raise links.LinkError("`ip link add` failed: no")
        real(*arguments)

    monkeypatch.setattr(links, "_ip", failing)
    network = links.Network(2)
    with pytest.raises(links.LinkError, match="ip link add"):
        network.__enter__()
    prefix = network.hub.removesuffix("-hub")
    assert any(c[:3] == ("ip", "netns", "add") and c[3] == network.workers[1] for c in calls)  # it got that far
    assert _namespaces(prefix) == []
    assert signal.getsignal(signal.SIGTERM) is not links._interrupt  # the handlers it set are put back


@needs_namespaces
@pytest.mark.parametrize("ending", ["ctrl-c", "sigterm", "killed worker"])
def test_no_namespace_is_left_behind_when_a_run_is_interrupted(ending, tmp_path):
    process, seen = start_until(["--world-size", "2", "--steps", "100000", "--algorithms", "ddp", "--link", "100mbit",
                                 "--output", str(tmp_path)], "  ddp")  # the banner, the namespaces, ddp's progress
    try:
        prefix = _prefix(seen)
        assert len(_namespaces(prefix)) == 3  # the hub and two workers
        if ending in ("ctrl-c", "sigterm"):
            os.killpg(process.pid, signal.SIGINT if ending == "ctrl-c" else signal.SIGTERM)
        else:
            pids = subprocess.run(["ip", "netns", "pids", f"{prefix}-w1"], capture_output=True, text=True).stdout
            os.kill(int(pids.split()[0]), signal.SIGKILL)  # the worker training in that namespace
        code = process.wait(timeout=60)
        assert code == (1 if ending == "killed worker" else 130), process.stderr.read()
        assert _namespaces(prefix) == []
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
