"""Every code block of the README is exercised: Python blocks run as a reader would run
them, copied into a file (with ``python``, or with torchrun on 4 local Gloo ranks where
they use ``torch.distributed``); shell blocks name make targets and files that exist; the
sample output has the demo's real table header."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launched import assert_ran, with_exit_marker
from puredist.demo.network import LINKS
from puredist.demo.report import projection_table, table

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [code for lang, code in BLOCKS if lang == "sh"]
TEXT = [code for lang, code in BLOCKS if lang == "text"]


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_blocks_run_as_copied_into_a_file(index, tmp_path):
    code = PYTHON[index]
    script = tmp_path / f"block{index}.py"
    script.write_text(code)
    distributed = "torch.distributed" in code
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"] if distributed \
        else [sys.executable]
    env = with_exit_marker({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")})
    done = subprocess.run([*launcher, str(script)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert_ran(done)


def test_shell_blocks_use_real_targets_and_files():
    makefile = (ROOT / "Makefile").read_text()
    commands = [line for block in SHELL for line in block.splitlines() if line.strip()]
    assert commands
    for line in commands:
        command = line.split("#")[0].strip()
        if command.startswith("make "):
            assert re.search(rf"^{command.split()[1]}:", makefile, flags=re.M), command
        for path in re.findall(r"\S+\.py", command):
            assert (ROOT / path).is_file(), path


def _summary():
    row = {"eval_accuracy": 1.0, "eval_loss": 0.0, "wall_s": 1.0, "bytes_per_worker": 1, "bytes_per_worker_max": 1,
           "state_bytes_max": 1, "steps_to_target": 1, "projected_s": {}, "projected_loss_within_budget": {}}
    links = [link._asdict() for link in LINKS]
    for link in links:
        row["projected_s"][link["name"]] = row["projected_loss_within_budget"][link["name"]] = 1.0
    model = {"compute_s_per_step": 0.1, "target_eval_loss": 0.0, "target_from": "ddp", "links": links,
             "budget_s": {link["name"]: 1.0 for link in links}}
    return {"algorithms": {"ddp": row}, "network_model": model}


def test_sample_outputs_have_the_demo_tables_headers():
    header = table(_summary()).splitlines()[0]
    measured = [block for block in TEXT if block.startswith("algorithm")]
    assert len(measured) == 2  # digits and the language model
    assert all(block.splitlines()[0] == header for block in measured)
    links_header = next(line for line in projection_table(_summary()).splitlines() if line.startswith("algorithm"))
    projected = [block for block in TEXT if block.startswith("PROJECTED")]
    assert len(projected) == 1 and links_header in projected[0].splitlines()
