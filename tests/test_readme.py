"""Every code block of the README and of the guides in ``docs/`` is exercised: Python
blocks run as a reader would run them, copied into a file (with ``python``, or with
torchrun on 4 local Gloo ranks where they use ``torch.distributed``); shell blocks name
make targets and files that exist; the sample outputs have the demo's real table
headers. A block that is not meant to run has another fence language than ``python``."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launched import assert_ran, with_exit_marker
from puredist.demo.network import LINKS
from puredist.demo.report import projection_table, table

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT).as_posix(), lang, code)
          for page in PAGES for lang, code in re.findall(r"```(\w+)\n(.*?)```", page.read_text(), flags=re.S)]
PYTHON = [(page, code) for page, lang, code in BLOCKS if lang == "python"]
DISTRIBUTED = [(page, code) for page, code in PYTHON if "torch.distributed" in code]
LOCAL = [(page, code) for page, code in PYTHON if "torch.distributed" not in code]
SHELL = [code for _, lang, code in BLOCKS if lang == "sh"]
TEXT = [code for _, lang, code in BLOCKS if lang == "text"]

# Runs each file given in a fresh namespace, in this one process (one import of torch for
# all of them), as ``python file`` would; a failure names its file.
_RUN_EACH = """
import runpy, sys, traceback
for path in sys.argv[1:]:
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        traceback.print_exc()
        sys.exit(f"failed: {path}")
"""


def _env() -> dict[str, str]:
    return with_exit_marker({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")})


def test_the_pages_have_python_blocks_of_both_kinds():
    pages = {page for page, _ in PYTHON}
    assert {"README.md", "docs/index.md", "docs/functional.md", "docs/sharded.md", "docs/classic.md"} <= pages
    assert LOCAL and DISTRIBUTED


def test_the_readme_is_short_and_every_page_says_what_is():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 350
    assert lines.index("```python") < 120  # code early: the first example within the first screens
    history = re.compile(r"session|sitting|this round|last round|independent review|reviewer|first design|which now|"
                         r"now include|not yet|on this machine|this \d-core machine", flags=re.I)
    for page in PAGES:
        found = [line for line in page.read_text().splitlines() if history.search(line)]
        assert not found, (page.name, found)


def test_python_blocks_without_torch_distributed_run_as_copied_into_a_file(tmp_path):
    scripts = []
    for index, (page, code) in enumerate(LOCAL):
        script = tmp_path / f"{page.replace('/', '_')}_{index}.py"
        script.write_text(code)
        scripts.append(str(script))
    done = subprocess.run([sys.executable, "-c", _RUN_EACH, *scripts], capture_output=True, text=True,
                          timeout=600, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.mark.parametrize("index", range(len(DISTRIBUTED)), ids=[page for page, _ in DISTRIBUTED])
def test_python_blocks_with_torch_distributed_run_under_torchrun(index, tmp_path):
    page, code = DISTRIBUTED[index]
    script = tmp_path / f"block{index}.py"
    script.write_text(code)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    done = subprocess.run([*launcher, str(script)], capture_output=True, text=True, timeout=240, env=_env(),
                          cwd=tmp_path)
    assert_ran(done)


def test_shell_blocks_use_real_targets_and_files():
    makefile = (ROOT / "Makefile").read_text()
    commands = [line for block in SHELL for line in block.splitlines() if line.strip()]
    assert commands
    for line in commands:
        command = line.split("#")[0].strip()
        if command.startswith("make "):
            assert re.search(rf"^{command.split()[1]}:", makefile, flags=re.M), command
        for path in re.findall(r"(?:^|\s)([\w./-]+\.py)(?=\s|$)", command):  # a file, not a URL's host
            assert (ROOT / path).is_file(), path


def _summary():
    row = {"eval_accuracy": 1.0, "eval_loss": 0.0, "wall_s": 1.0, "bytes_per_worker": 1, "bytes_per_worker_max": 1,
           "state_bytes_max": 1, "steps_to_target": 1, "projected_s": {}, "projected_loss_within_budget": {}}
    links = [link._asdict() for link in LINKS]
    for link in links:
        row["projected_s"][link["name"]] = row["projected_loss_within_budget"][link["name"]] = 1.0
    model = {"compute_s_per_step": 0.1, "target_eval_loss": 0.0, "target_tolerance": 0.01, "final_eval_loss": 0.0,
             "target_from": "ddp", "links": links,
             "budget_s": {link["name"]: 1.0 for link in links}}
    return {"algorithms": {"ddp": row}, "network_model": model}


def test_sample_outputs_have_the_demo_tables_headers():
    header = table(_summary()).splitlines()[0]
    measured = [block for block in TEXT if block.startswith("algorithm")]
    assert len(measured) == 3  # digits (the README, the sweep in docs/benchmarks.md) and the language model
    assert all(block.splitlines()[0] == header for block in measured)
    links_header = next(line for line in projection_table(_summary()).splitlines() if line.startswith("algorithm"))
    projected = [block for block in TEXT if block.startswith("PROJECTED")]
    assert len(projected) == 1 and links_header in projected[0].splitlines()


def test_every_install_command_installs_from_the_clone_with_the_tested_versions():
    # one story: puredist is installed from its clone, an extra at a time, at constraints.txt's versions
    sources = [*PAGES, *sorted((ROOT / "src" / "puredist").rglob("*.py"))]
    commands = [(path.name, command) for path in sources
                for command in re.findall(r"pip install[^`\"\n]*", path.read_text())]
    assert len(commands) >= 5
    for name, command in commands:
        assert re.match(r"pip install -e '\.\[([a-z,]+|{extra})\]' -c constraints\.txt", command), (name, command)
    landing = (ROOT / "docs" / "index.md").read_text()  # the site's first page: install and quick start too
    assert "## Install" in landing and "pip install -e" in landing and "make demo" in landing
    readme = (ROOT / "README.md").read_text()
    property_test = readme[readme.index("## A property test"):]
    assert "'.[testing]'" in property_test[:property_test.index("```python")]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_demo_installs_what_the_demo_needs_and_make_test_everything():
    def planned(target):  # make's commands from an empty .venv, run none
        done = subprocess.run(["make", "-n", "-B", target], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if " pip install " in line]

    assert planned("demo") == ['.venv/bin/python -m pip install --quiet -e ".[demo,ft]" -c constraints.txt']
    assert planned("test") == [".venv/bin/python -m pip install --quiet -r requirements-dev.txt"]
    assert "-e .[test,demo]" in (ROOT / "requirements-dev.txt").read_text()  # (the demo's extras among the rest)
