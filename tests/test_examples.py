"""Every example runs as documented, at tiny size."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launched import assert_ran, with_exit_marker

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(script, *args, ranks=2):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, timeout=180, env=with_exit_marker(ENV), cwd=ROOT,
    )


@pytest.mark.parametrize(
    "script, expected",
    [
        ("functional_loop.py", "done on 2 ranks"),
        ("classic_post_local_sgd.py", "averager step 30"),
        ("zero_overlap.py", "every parameter moved: True"),
    ],
)
def test_launched_examples_run(script, expected):
    done = torchrun(script, "--steps", "30")
    assert_ran(done)
    assert expected in done.stdout


def test_diloco_over_fsdp2_runs_and_checkpoints(tmp_path):
    done = torchrun("diloco_fsdp2.py", "--steps", "12", "--sync-every", "4", "--shards", "2",
                    "--checkpoint", str(tmp_path / "checkpoint"), ranks=4)
    assert_ran(done)
    assert "done on 4 ranks" in done.stdout and "1/2 of the model" in done.stdout
    assert (tmp_path / "checkpoint" / ".metadata").is_file()
    assert "returned a view tensor" not in done.stderr


def test_diloco_between_clusters_with_ddp_inside_runs_and_ends_on_the_global_copy():
    done = torchrun("diloco_two_clusters.py", "--steps", "16", "--sync-every", "8", "--clusters", "2", ranks=4)
    assert_ran(done)
    assert "done on 2 clusters of 2" in done.stdout and "16 steps, every rank on the global copy: True" in done.stdout


def test_the_property_example_runs_as_a_script():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "property_test.py")],
                          capture_output=True, text=True, timeout=180, env=ENV)
    assert done.returncode == 0, done.stderr
    assert "property holds" in done.stdout


def test_the_jax_style_example_compiles_its_whole_vmapped_step():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "jax_style_diloco.py"), "--steps", "5",
                           "--sync-every", "2", "--backend", "aot_eager", "--compare-eager"],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("first layer equal on every replica: True") == 3, done.stdout  # steps 0, 2, 4
    assert "done: 4 replicas, 5 steps" in done.stdout
    difference = float(done.stdout.split("largest |compiled - eager| over the parameters and the state: ")[1].split()[0])
    assert difference < 1e-6  # (aot_eager: the graph itself, Adam's step rounded by its decompositions)
    assert "performance drop" not in done.stderr


def test_the_fault_tolerant_example_runs_per_replica_group_under_torchrun():
    os.environ.setdefault("RUST_LOG", "error")  # torchft's lighthouse logs every quorum otherwise
    lighthouse_server = pytest.importorskip("torchft.coordination").LighthouseServer
    # min_replicas=2: the first quorum waits for both groups (torchrun starts them seconds apart on 2 busy cores;
    # one alone would finish its 60 steps before the other started)
    lighthouse = lighthouse_server(bind="[::]:0", min_replicas=2, join_timeout_ms=3000, quorum_tick_ms=20,
                                   heartbeat_timeout_ms=1000)
    try:
        env = with_exit_marker({**ENV, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "RUST_LOG": "error"})
        groups = [
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                 str(ROOT / "examples" / "fault_tolerant_diloco.py"), "--replica-id", str(i), "--steps", "60"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
            )
            for i in range(2)
        ]
        outputs = [group.communicate(timeout=180) for group in groups]
    finally:
        lighthouse.shutdown()
    for group, (out, err) in zip(groups, outputs):
        assert_ran(subprocess.CompletedProcess(group.args, group.returncode, out, err))
    finals = [out.strip().splitlines()[-1] for out, _ in outputs]  # the same global copy in both groups
    assert finals[0] == finals[1] and finals[0].startswith("step 60: global copy digest")  # syncs after 20, 40, 60
    assert "2 replica group(s) contributed, 0 failed synchronizations, 0 heals" in finals[0]
