"""Every code block of the README is exercised: Python blocks run on 4 Gloo ranks,
shell blocks name make targets and files that exist, and the sample output has the
demo's real table header."""

import re
import sys
import types
from pathlib import Path

import pytest

from puredist.demo.report import table
from workers import run_workers

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [code for lang, code in BLOCKS if lang == "sh"]
TEXT = [code for lang, code in BLOCKS if lang == "text"]


def _run_block(rank, world_size, code):
    module = types.ModuleType("readme")  # a real module: torch.compile looks its globals up by name
    sys.modules["readme"] = module
    exec(compile(code, "README.md", "exec"), module.__dict__)
    return True


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_blocks_run_on_real_ranks(index):
    assert run_workers(_run_block, 4, PYTHON[index]) == [True] * 4


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


def test_sample_output_has_the_demo_table_header():
    row = {"heldout_accuracy": 1.0, "heldout_loss": 0.0, "wall_s": 1.0, "bytes_sent": 1, "bytes_sent_max": 1,
           "state_bytes_max": 1}
    header = table({"ddp": row}).splitlines()[0]
    assert header in TEXT[0]
