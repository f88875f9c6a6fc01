"""Every example runs as documented, at tiny size."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(script, *args, ranks=2):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, timeout=180, env=ENV, cwd=ROOT,
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
    assert done.returncode == 0, done.stdout + done.stderr
    assert expected in done.stdout


def test_diloco_over_fsdp2_runs_and_checkpoints(tmp_path):
    done = torchrun("diloco_fsdp2.py", "--steps", "12", "--sync-every", "4", "--shards", "2",
                    "--checkpoint", str(tmp_path / "checkpoint"), ranks=4)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done on 4 ranks" in done.stdout and "1/2 of the model" in done.stdout
    assert (tmp_path / "checkpoint" / ".metadata").is_file()
    assert "returned a view tensor" not in done.stderr


def test_the_property_example_runs_as_a_script():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "property_test.py")],
                          capture_output=True, text=True, timeout=180, env=ENV)
    assert done.returncode == 0, done.stderr
    assert "property holds" in done.stdout
