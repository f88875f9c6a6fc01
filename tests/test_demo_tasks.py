"""The demo's tasks and its network model, piece by piece: the language task's data
split and causal model, the projection's arithmetic, and a short LM run end to end."""

import json
import math
import pathlib
import subprocess

import pytest
import torch

from puredist.demo import charlm, network
from test_demo import DEMO, ENV


SIZES = pytest.mark.parametrize("size", [charlm.SMALL, charlm.LARGE], ids=["lm", "lm-large"])


@SIZES
def test_the_corpus_splits_into_disjoint_shards_and_a_held_out_tail(size):
    codes, vocabulary = charlm.corpus()
    assert len(codes) > 5_000_000 and vocabulary == charlm.VOCABULARY and int(codes.max()) < len(vocabulary)
    world_size = 4
    shards = [charlm.load(0, rank, world_size, size)[0].shard for rank in range(world_size)]
    split = int(len(codes) * (1 - charlm.HELD_OUT_FRACTION))
    # the shards tile the training part in rank order; nothing of the held-out tail is in them
    assert torch.equal(torch.cat(shards), codes[: sum(len(s) for s in shards)])
    assert sum(len(s) for s in shards) <= split
    inputs, targets = charlm.load(0, 0, world_size, size)[1]
    assert inputs.shape == targets.shape == (charlm.EVAL_WINDOWS, size.context)
    tail = "".join(vocabulary[c] for c in codes[split:].tolist())
    for window_in, window_out in zip(inputs, targets):
        decoded = "".join(vocabulary[c] for c in window_in.tolist())
        assert decoded in tail  # held-out text only
        assert torch.equal(window_in[1:], window_out[:-1])  # targets: the next characters


def test_the_corpus_is_the_standard_librarys_own_files_in_an_order_fixed_by_their_paths(tmp_path):
    import hashlib
    import sysconfig

    files = ["a.py", "json/decoder.py", "test/test_a.py", "tkinter/font.py", "encodings/cp1252.py", "b.txt",
             "site-packages/x.py", "config-3.11-x86_64-linux-gnu/python-config.py", "_sysconfigdata__linux.py",
             "turtle.py", "unittest/test/test_case.py", "email/mime/text.py"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    kept = ["a.py", "json/decoder.py", "email/mime/text.py"]  # the rest: tests, split off, built here, not .py
    assert charlm.sources(str(tmp_path)) == sorted(kept, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    # the corpus is those files of the running interpreter, each ending in one newline, in that order
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    first, second = charlm.sources()[:2]
    text = [(root / path).read_text(encoding="utf-8").rstrip("\n") + "\n" for path in (first, second)]
    head = charlm.encode("".join(text), charlm.VOCABULARY)
    assert torch.equal(charlm.corpus()[0][: len(head)], head)
    assert charlm.encode("ab\u2019\n", charlm.VOCABULARY).tolist() == [charlm.VOCABULARY.index(c) for c in "ab"] + [0, 2]


@SIZES
def test_minibatches_are_next_character_pairs_read_front_to_back_each_character_once_a_pass(size):
    stream = charlm.load(0, 1, 4, size)[0]
    inputs, targets = charlm.sample(stream, torch.Generator().manual_seed(3))
    assert inputs.shape == (size.batch_size, size.context)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    positions = charlm.Stream(torch.arange(len(stream.shard)), size)  # the same reading, of positions
    read = [charlm.sample(positions) for _ in range(min(positions.windows_per_row, 50))]
    seen = torch.cat([torch.cat([x, y[:, -1:]], dim=1).flatten() for x, y in read])
    assert len(seen) == len(set(seen.tolist()))  # no character twice within a pass
    codes = charlm.Stream(stream.shard, size)  # the codes at those positions, minibatch by minibatch
    for x, y in read[:3]:
        codes_x, codes_y = charlm.sample(codes)
        assert torch.equal(stream.shard[x].long(), codes_x) and torch.equal(stream.shard[y].long(), codes_y)
    assert positions.passes(positions.windows_per_row) == 1.0
    # the study's 960 steps (4 workers) read less than each worker's shard once
    assert charlm.data_passes(960, 4, charlm.SMALL) < 1.0


@pytest.mark.parametrize("task, parameters", [(charlm.TASK, (300_000, 1_000_000)),
                                              (charlm.LARGE_TASK, (15_000_000, 25_000_000))], ids=["lm", "lm-large"])
def test_the_model_is_causal_and_starts_near_a_uniform_guess(task, parameters):
    model = task.make_model(0)
    vocabulary = len(charlm.corpus()[1])
    codes = torch.randint(vocabulary, (2, 64), generator=torch.Generator().manual_seed(0))  # (the small context)
    changed = codes.clone()
    changed[:, 40] = (changed[:, 40] + 1) % vocabulary
    with torch.no_grad():
        before, after = model(codes), model(changed)
    assert before.shape == (2, 64, vocabulary)
    assert torch.equal(before[:, :40], after[:, :40])  # no position sees a later one
    assert not torch.allclose(before[:, 40:], after[:, 40:])
    loss = torch.nn.functional.cross_entropy(before.flatten(0, 1), codes.flatten())
    assert abs(loss.item() - math.log(vocabulary)) < 0.5
    low, high = parameters
    assert low < sum(p.numel() for p in model.parameters()) < high


def test_compute_time_is_the_mean_of_the_steps_that_sent_nothing():
    seconds = [[0.5, 0.1, 0.2, 9.0], [0.3]]
    sent = [[10, 0, 0, 0], [0]]
    # the mean of 0.1, 0.2, 9.0, 0.3: four such steps last as long as these did, the slow one included
    assert network.compute_seconds(seconds, sent) == pytest.approx(9.6 / 4)
    assert 4 * network.compute_seconds(seconds, sent) == pytest.approx(0.1 + 0.2 + 9.0 + 0.3)
    assert network.compute_seconds([[1.0]], [[5]]) is None
    # a step a killed worker never reported is not measured: left out, not a quiet step of no time
    assert network.compute_seconds([[None, 0.2, None, 0.4]], [[0, 0, 0, 0]]) == pytest.approx(0.3)


def test_the_projection_adds_the_bytes_frames_and_latencies_to_the_measured_training_time():
    link = network.Link("test", bytes_per_second=100.0, latency_s=0.01)
    # evaluated at steps 2 and 4 after 1 s and 3 s of training; step 2 sent 100 bytes, step 4 50, in 1.1 bytes of
    # frames a byte: 1.1 s and 0.55 s at 100 B/s, and 2 (W - 1) = 4 latencies each at W = 3
    run = network.Measured([2, 4], [1.0, 3.0], [0, 100, 0, 50], wire_bytes_per_byte=1.1)
    assert network.projected_seconds(run, 2, link, 3, compute_s=0.5) == pytest.approx(1.0 + 1.1 + 0.04)
    assert network.projected_seconds(run, 4, link, 3, compute_s=0.5) == pytest.approx(3.0 + 1.1 + 0.55 + 0.08)
    # a hierarchy's pair step: its all-reduce spans 2 of the 4 workers, 2 (2 - 1) = 2 latencies; the whole group's 6
    pairs = run._replace(group_sizes=[None, 2, None, 4])
    assert network.projected_seconds(pairs, 4, link, 4, compute_s=0.5) == pytest.approx(3.0 + 1.65 + 0.02 + 0.06)
    # without a measured framing: TCP's, a 1514-byte frame for 1448 bytes and a 66-byte acknowledgement
    assert network.Measured([2], [1.0], [0, 1448]).wire_bytes_per_byte == pytest.approx(1580 / 1448)
    assert network.steps_to_reach([(10, 3.0), (20, 2.0), (30, 2.5)], 2.5) == 20
    assert network.steps_to_reach([(10, 3.0)], 2.5) is None


def test_streaming_bytes_travel_behind_the_compute_of_the_steps_before_they_are_applied():
    link = network.Link("test", bytes_per_second=100.0, latency_s=0.0)
    # 2 steps of 0.3 s compute hide 0.6 s of each sending step's bytes: 1.0 s -> 0.4 s, 0.5 s -> 0, never below
    run = network.Measured([3], [2.0], [100, 50, 0], overlap_steps=2, wire_bytes_per_byte=1.0)
    assert network.transfer_seconds(run, 3, link, 2, compute_s=0.3) == pytest.approx(0.4)
    assert network.projected_seconds(run, 3, link, 2, compute_s=0.3) == pytest.approx(2.4)
    # the compute unknown (no step sent nothing): nothing hidden; no overlap: nothing hidden either
    assert network.transfer_seconds(run, 3, link, 2, compute_s=None) == pytest.approx(1.5)
    assert network.transfer_seconds(run._replace(overlap_steps=0), 3, link, 2, compute_s=0.3) == pytest.approx(1.5)


def test_a_short_language_model_run_learns_and_reports(tmp_path):
    done = subprocess.run(
        [*DEMO, "--task", "lm", "--world-size", "2", "--steps", "12", "--algorithms", "ddp,diloco_int4",
         "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=ENV,
    )
    assert done.returncode == 0, done.stderr
    assert "character-level GPT" in done.stdout
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["task"] == "lm" and list(summary["algorithms"]) == ["ddp", "diloco_int4"]
    uniform = math.log(len(charlm.corpus()[1]))
    for row in summary["algorithms"].values():
        first_loss = row["evaluations"][0]["loss"]
        assert row["eval_loss"] < first_loss and row["eval_loss"] < uniform - 0.5  # 12 AdamW steps learn something
    # 12 steps are all inside the 32-step warm-up: DiLoCo sent nothing, though every step was evaluated (the
    # barrier before each evaluation is not counted), so the compute time per step is known
    first, *rest = summary["algorithms"]["diloco_int4"]["step_bytes"]
    assert 0 < first < 4096 and rest == [0] * 11  # step 0 checks that the initial models are the same: a digest each
    assert min(summary["algorithms"]["ddp"]["step_bytes"]) > 4 * 400_000  # every step all-reduces 0.43M fp32 gradients
    assert summary["network_model"]["compute_s_per_step"] > 0


def test_the_loss_within_a_budget_is_the_best_evaluation_projected_in_time():
    link = network.Link("test", bytes_per_second=10.0, latency_s=0.0)
    run = network.Measured([2, 4, 6], [1.0, 2.0, 3.0], [0, 0, 10, 0, 0, 0], wire_bytes_per_byte=1.0)
    losses = [3.0, 2.0, 1.0]  # projected at 1 s, 3 s, 4 s (1 s of sending at step 3)
    assert network.best_loss_within(run, losses, link, 2, None, budget_s=3.5) == 2.0
    assert network.best_loss_within(run, losses, link, 2, None, budget_s=0.9) is None
    rising = [1.0, 2.0, 3.0]  # a run whose loss rises: its lowest evaluation in time is read, not its last
    assert network.best_loss_within(run, rising, link, 2, None, budget_s=3.5) == 1.0
