"""Fault-tolerant DiLoCo over torchft, with a real lighthouse and replica groups as
processes (``tests/ft_replica.py``): the synchronizations against a one-process
simulation, a slow replica, replicas killed between and inside synchronizations,
and a restarted replica healing to its peer's state bit for bit; and, over stand-in
managers that record failures as torchft does (paired by threads where two replicas
reduce), where a failed quorum or vote is said to have failed, that the next quorum
after a failed one averages, that a heal's replay contributes zeros and receives its
peers' mean, and that a healed compressed replica starts with zero residuals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import puredist

os.environ.setdefault("RUST_LOG", "error")  # torchft's lighthouse logs every quorum otherwise
torchft = pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer  # noqa: E402

from puredist.ft import FaultTolerantOuter, ManagerCollective  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import ft_replica  # noqa: E402

REPLICA = str(Path(__file__).parent / "ft_replica.py")
JOB_TIMEOUT_S = 120


@pytest.fixture
def lighthouse():
    # join_timeout: how long a quorum waits for a replica that heartbeats but has not asked; beyond the time
    # between two synchronizations, so that a restarted replica waits for its peers instead of going alone
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, quorum_tick_ms=20,
                              heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


@pytest.fixture
def store():
    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


class Replicas:
    """Replica processes of one test, each started from a spec; ``results`` waits for them."""

    def __init__(self, lighthouse: str, store, folder: Path) -> None:
        self.base = {"lighthouse": lighthouse, "port": store.port, "timeout": 5, "steps": 24}
        self.folder = folder
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, index: int, **spec) -> None:
        spec = {**self.base, "id": name, "index": index, "out": str(self.folder / f"{name}.pt"), **spec}
        env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
        self.processes[name] = subprocess.Popen([sys.executable, REPLICA, json.dumps(spec)], env=env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait(self, name: str) -> int:
        try:
            return self.processes[name].wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"replica {name} did not finish in {JOB_TIMEOUT_S} s") from None

    def result(self, name: str) -> dict:
        code = self.wait(name)
        error = self.processes[name].stderr.read().decode()[-3000:]
        assert code == 0, f"replica {name} exited with {code}:\n{error}"
        return torch.load(self.folder / f"{name}.pt")

    def kill(self) -> None:
        for process in self.processes.values():
            process.kill()


@pytest.fixture
def replicas(lighthouse, store, tmp_path):
    group = Replicas(lighthouse, store, tmp_path)
    yield group
    group.kill()


def simulated(steps: int, replicas: int, first: int = 0) -> puredist.OuterState:
    """The oracle: the same training with every replica in this process
    (:class:`puredist.SimulatedCollective`, a leading replica axis), the replicas'
    local steps those of indices ``first, first + 1, ...``."""
    transform = ft_replica.make_transform()
    params = {k: v.unsqueeze(0).repeat(replicas, *[1] * v.dim()) for k, v in ft_replica.make_params().items()}
    state = transform.init(params)
    collective = puredist.SimulatedCollective(replicas)
    for step in range(steps):
        for r in range(replicas):
            view = {k: v[r] for k, v in params.items()}
            ft_replica.local_step(view, first + r, step)
        state = transform.update_(params, state, collective=collective)
    return state


def test_replicas_synchronize_as_the_simulation_and_a_slow_one_is_waited_for(replicas):
    replicas.start("a", 0, wait_for=["up.b"], finish_with=["b"])
    replicas.start("b", 1, wait_for=["up.a"], finish_with=["a"], slow_at=7, slow_s=2.0)  # alive, 2 s late
    a, b = replicas.result("a"), replicas.result("b")
    oracle = simulated(24, 2)
    for result in (a, b):
        assert result["step"] == 24 and result["failed"] == 0 and result["heals"] == 0
        assert set(result["worlds"]) == {2}
        for mine, expected in zip(result["global"], oracle.global_params):
            torch.testing.assert_close(mine, expected[0], rtol=0, atol=0)  # the global copy is replicated
    assert all(torch.equal(x, y) for x, y in zip(a["outer"], b["outer"]))


def test_replica_groups_of_two_ranks_synchronize_rank_by_rank_as_the_simulation(replicas):
    # each group is two processes with torchrun's environment and a store of their own; rank r of one group
    # reduces with rank r of the other (torchft's replica dimension). Rank 0 of group g steps as replica g,
    # rank 1 as replica 2 + g (as shards of a model would differ), so each rank has an oracle of its own
    group_stores = [torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    names = [f"g{g}r{r}" for g in range(2) for r in range(2)]
    for name in names:
        g, r = int(name[1]), int(name[3])
        group = {"name": f"g{g}", "port": group_stores[g].port, "rank": r, "size": 2}
        replicas.start(name, g + 2 * r, group=group, wait_for=[f"up.{other}" for other in names],
                       finish_with=[other for other in names if other != name])
    oracles = [simulated(24, 2, first=0), simulated(24, 2, first=2)]
    for name in names:
        result, oracle = replicas.result(name), oracles[int(name[3])]
        assert result["step"] == 24 and result["failed"] == 0 and result["heals"] == 0
        assert set(result["worlds"]) == {2}  # the groups, not the processes
        expected = [*oracle.global_params, *(t for per_leaf in oracle.outer_state for t in per_leaf)]
        assert len(result["global"]) + len(result["outer"]) == len(expected)
        for mine, replicated in zip(result["global"] + result["outer"], expected):
            torch.testing.assert_close(mine, replicated[0], rtol=0, atol=0)


def test_a_replica_group_of_two_ranks_killed_and_restarted_heals_rank_by_rank(replicas):
    stores = [torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(3)]

    def start_group(g: int, store, suffix: str = "", **spec) -> list[str]:
        names = [f"g{g}r{r}{suffix}" for r in range(2)]
        for r, name in enumerate(names):
            replicas.start(name, g + 2 * r, group={"name": f"g{g}", "port": store.port, "rank": r, "size": 2}, **spec)
        return names

    first = ["g0r0", "g0r1", "g1r0", "g1r1"]
    survivors = start_group(0, stores[0], wait_for=[f"up.{n}" for n in first], pause_at=13, pause_until="up.g1r1b",
                            finish_with=["g1r0b", "g1r1b"], steps=30)
    dead = start_group(1, stores[1], wait_for=[f"up.{n}" for n in first], die_at=7)  # after the sync at step 6
    assert [replicas.wait(name) for name in dead] == [3, 3]
    restarted = start_group(1, stores[2], suffix="b", finish_with=survivors, steps=30)  # torchrun restarts it
    for survivor, healed in zip(survivors, restarted):  # rank r healed from rank r
        a, b = replicas.result(survivor), replicas.result(healed)
        assert a["failed"] == 0 and b["heals"] == 1 and a["step"] == b["step"] == 30
        assert 1 in a["worlds"] and a["worlds"][-1] == 2
        assert all(torch.equal(x, y) for x, y in zip(a["global"] + a["outer"], b["global"] + b["outer"]))
    a0, a1 = (replicas.result(name) for name in survivors)
    assert not torch.equal(a0["global"][0], a1["global"][0])  # the ranks hold different values: no mixing


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "int8"])
def test_a_replica_killed_between_synchronizations_leaves_the_other_going_and_rejoins_bit_for_bit(replicas, compressed):
    replicas.start("a", 0, wait_for=["up.b"], pause_at=13, pause_until="up.b2", finish_with=["b2"], steps=30,
                   compressed=compressed)
    replicas.start("b", 1, wait_for=["up.a"], die_at=7, compressed=compressed)  # after the sync at step 6
    assert replicas.wait("b") == 3
    # restarted: heals from a at a's next synchronization
    replicas.start("b2", 1, finish_with=["a"], steps=30, compressed=compressed)
    a, b = replicas.result("a"), replicas.result("b2")
    assert a["failed"] == 0  # a's next synchronization formed its quorum without b: nothing failed
    assert 1 in a["worlds"] and a["worlds"][-1] == 2  # alone, then with the restarted replica
    assert b["heals"] == 1
    assert b["worlds"][0] == 1 and b["worlds"][-1] == 2  # it healed in a synchronization it added nothing to
    assert a["step"] == b["step"] == 30
    assert all(torch.equal(x, y) for x, y in zip(a["global"], b["global"]))
    assert all(torch.equal(x, y) for x, y in zip(a["outer"], b["outer"]))


@pytest.mark.parametrize("failing", ["transform", "registered"])
def test_a_heal_whose_state_does_not_load_stops_that_replica_and_its_peer_goes_on(replicas, failing):
    # the transform's own checked load fails, or another load function registered with the manager (torchft runs
    # those inside start_quorum, after taking the peer's step); b2 then stays up, as a process that logs or
    # saves would: while its manager heartbeats, the lighthouse holds a's quorums for it
    inner = failing == "registered"
    replicas.start("a", 0, wait_for=["up.b"], pause_at=13, pause_until="up.b2", steps=30, inner=inner)
    replicas.start("b", 1, wait_for=["up.a"], die_at=7, inner=inner)
    assert replicas.wait("b") == 3
    replicas.start("b2", 1, steps=30, inner=inner, linger_s=40, linger_for="a",
                   **({"inner_load_fails": 1} if inner else {"heal_load_fails": 1}))
    a, b = replicas.result("a"), replicas.result("b2")
    message, same_error_again, cause = b["heal_errors"]
    expected = "a load_state_dict function registered with the manager raised (ValueError: injected: the inner" \
        if inner else "the peer's state did not load (ValueError: injected"
    assert expected in message and "restart the replica group" in message, message
    assert same_error_again and cause == "ValueError" and b["failures_changed_nothing"] and b["heals"] == 0
    # a waited for b2 in that synchronization until its timeout: it failed, changing nothing; then a went on alone
    # while b2 was still up (before, the heal was "nothing changed", and b2's next synchronization, at its peers'
    # torchft step with its own state, made both raise RankMismatchError)
    assert a["failed"] == 1 and a["failures_changed_nothing"] and a["step"] == 30 and a["worlds"][-1] == 1
    assert b["peer_went_on"]


def test_a_replica_killed_inside_a_synchronization_changes_nothing_on_the_survivor(replicas):
    # all-reduces: 1 = the initial check at step 0; then two per synchronization (rank check, data), at steps
    # 1, 4, 7, ...: 5 is the data all-reduce of the synchronization at step 4
    replicas.start("a", 0, wait_for=["up.b"])
    replicas.start("b", 1, wait_for=["up.a"], die_in_reduction=5)
    assert replicas.wait("b") == 3
    a = replicas.result("a")
    assert a["failed"] >= 1 and a["failures_changed_nothing"], a["last_error"]
    assert "CollectiveError" in a["last_error"] and "No tensor holds a partial result" in a["last_error"]
    assert "failed in the data all-reduce" in a["last_error"]  # where it failed: not "in the rank check"
    assert a["step"] == 24 and a["worlds"][0] == 2 and a["worlds"][-1] == 1


@pytest.mark.parametrize("contexts", [("step 3", "step 3"), ("step 3", "step 4")])
def test_replicas_average_or_all_refuse_a_mismatch_before_the_data_travels(replicas, contexts):
    for i, context in enumerate(contexts):
        replicas.start(f"r{i}", i, context=context, wait_for=[f"up.r{1 - i}"], finish_with=[f"r{1 - i}"])
    results = [replicas.result(f"r{i}") for i in range(2)]
    if contexts[0] == contexts[1]:  # the mean of 1 and 2
        assert all(r["raised"] is None and torch.equal(r["tensor"], torch.full((4,), 1.5)) for r in results)
    else:  # both raise, neither tensor changes
        for i, r in enumerate(results):
            assert "the replicas passed different tensor layouts or contexts" in r["raised"]
            assert torch.equal(r["tensor"], torch.full((4,), float(i + 1)))


def test_a_replica_that_heals_in_a_plain_averaging_raises_healed_and_its_peer_completes(replicas):
    replicas.start("a", 0, means=4, finish_with=["b"])
    # b starts after a's first averaging and takes part in a's last three
    replicas.start("b", 1, means=3, start_after=["first.a"], finish_with=["a"])
    a, b = replicas.result("a"), replicas.result("b")
    assert [kind for kind, _ in a] == ["ok"] * 4  # a never fails
    assert b[0][0] == "Healed" and torch.equal(b[0][1], torch.full((4,), 2.0))  # b behind: healed, unwritten
    assert all(kind == "ok" and torch.equal(t, torch.full((4,), 1.5)) for kind, t in b[1:])  # then a member
    assert any(torch.equal(tensor, torch.full((4,), 1.5)) for _, tensor in a)


def test_post_local_sgd_runs_over_the_quorum_unchanged(replicas):
    for i in range(2):
        replicas.start(f"r{i}", i, averager=True, wait_for=[f"up.r{1 - i}"], finish_with=[f"r{1 - i}"])
    results = [replicas.result(f"r{i}") for i in range(2)]
    # the oracle: the same steps in this process, averaging every 2 steps by hand (the mean of two: (a + b) / 2)
    oracle = [ft_replica.make_params() for _ in range(2)]
    for step in range(6):
        for i in range(2):
            ft_replica.local_step(oracle[i], i, step)
        if step % 2 == 0:
            for name in oracle[0]:
                mean = (oracle[0][name] + oracle[1][name]) / 2
                oracle[0][name], oracle[1][name] = mean.clone(), mean.clone()
    for result, expected in zip(results, oracle):
        assert result["step"] == 6
        for name, tensor in expected.items():
            torch.testing.assert_close(result["params"][name], tensor, rtol=0, atol=0)


def test_compressed_averaging_runs_over_the_quorum_by_gathering_the_payloads(replicas):
    for i in range(2):
        replicas.start(f"r{i}", i, compressed_averager=True, wait_for=[f"up.r{1 - i}"], finish_with=[f"r{1 - i}"])
    results = [replicas.result(f"r{i}") for i in range(2)]
    # the oracle, by hand: each replica's v = x + e as one fp32 row, encoded; the mean of the decoded rows in
    # replica order; e' = v - decode(encode(v))
    codec = puredist.int8_blocks(8)
    params = [ft_replica.make_params() for _ in range(2)]
    residuals = [torch.zeros(sum(t.numel() for t in p.values())) for p in params]
    for step in range(3):
        decoded = []
        for i in range(2):
            ft_replica.local_step(params[i], i, step)
            v = torch.cat([t.reshape(-1) for t in params[i].values()]) + residuals[i]
            decoded.append(codec.decode(codec.encode(v), v.numel()))
            residuals[i] = v - decoded[-1]
        mean = (decoded[0] + decoded[1]) / 2
        for i in range(2):
            parts = mean.split([t.numel() for t in params[i].values()])
            params[i] = {name: part.reshape(t.shape).clone() for (name, t), part in zip(params[i].items(), parts)}
    for i, result in enumerate(results):
        for name, tensor in params[i].items():
            torch.testing.assert_close(result["params"][name], tensor, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([r.reshape(-1) for r in result["residuals"]]), residuals[i], rtol=0, atol=0)
    assert not torch.equal(residuals[0], residuals[1])  # each replica's own error feedback


def test_a_compressed_averaging_refused_for_a_nan_is_not_committed_even_by_a_replica_alone(replicas):
    # alone in its quorum the refusing replica agrees with itself: the step must still not count as committed
    # (a replica synchronized with it but absent would otherwise heal for nothing, its residuals lost)
    replicas.start("r0", 0, compressed_averager=True, nan_at=1)
    refusals = replicas.result("r0")["refusals"]
    assert len(refusals) == 1
    message, before, after = refusals[0]
    assert message.startswith("Arg ``params`` (plus the error-feedback") and after == before


def test_a_replica_refusing_a_compressed_averaging_for_a_nan_makes_its_peer_refuse_it_too(replicas):
    # as over torch.distributed: a ValueError on every replica (not a layout mismatch), nothing committed, and
    # the step run again without the NaN goes through on both
    replicas.start("r0", 0, compressed_averager=True, nan_at=1, wait_for=["up.r1"], finish_with=["r1"])
    replicas.start("r1", 1, compressed_averager=True, peer_nan_at=1, wait_for=["up.r0"], finish_with=["r0"])
    results = [replicas.result(f"r{i}") for i in range(2)]
    for result in results:
        (message, before, after), = result["refusals"]
        assert message.startswith("Arg ``params`` (plus the error-feedback") and after == before, message
    for name in results[0]["params"]:
        assert torch.equal(results[0]["params"][name], results[1]["params"][name])


def test_fault_tolerant_outer_refuses_what_a_peer_cannot_hand_over():
    # the third and fourth would synchronize after the first inner step, as the first update_ checks the initial copy
    for options in ({"delay": 1}, {"lower_levels": {2: 1}}, {"warmup_steps": 1}, {"sync_every": 1}):
        transform = puredist.outer_optimizer(puredist.sgd(0.5), **{"sync_every": 4, **options})
        with pytest.raises(ValueError, match=r"delay=0, no lower_levels\), none after the first inner step"):
            FaultTolerantOuter(transform, manager=None)


def test_bad_arguments_are_refused_by_name_before_any_manager_call():
    with pytest.raises(TypeError, match="Arg ``transform`` must be an outer-optimization transform"):
        FaultTolerantOuter(puredist.sgd(0.5), manager=None)  # an optimizer, not a transform
    with pytest.raises(TypeError, match=r"Arg ``timeout`` must be a datetime.timedelta, got 5"):
        puredist.ft.replica_manager("r", "localhost:1", timeout=5)
    with pytest.raises(TypeError, match=r"Arg ``quorum_timeout`` must be a datetime.timedelta"):
        puredist.ft.replica_manager("r", "localhost:1", quorum_timeout=60.0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"Arg ``device`` is 'cuda:0', but this process has no CUDA device"):
            puredist.ft.replica_manager("r", "localhost:1", device="cuda:0")
    with pytest.raises(ValueError, match="Arg ``tensors`` must be a non-empty list"):
        ManagerCollective(manager=None).all_gather_rows([], context="x")  # (no quorum started: no manager call)


@pytest.mark.parametrize("setting", ["_use_async_quorum", "_init_sync"])
def test_manager_collective_refuses_a_manager_that_would_heal_unseen(setting):
    manager = type("Manager", (), {setting: True})()  # what torchft's Manager keeps of its arguments
    with pytest.raises(ValueError, match="use_async_quorum=False and init_sync=False"):
        ManagerCollective(manager)


def test_manager_collective_refuses_a_group_size_before_communicating():
    collective = ManagerCollective(manager=None)  # no manager call is made before the refusal
    with pytest.raises(ValueError, match="``group_size`` 2"):
        collective.mean_([torch.ones(3)], group_size=2)
    with pytest.raises(TypeError):
        collective.mean_([torch.ones(3, dtype=torch.int64)])


class _RecordingManager:
    """A stand-in for a torchft ``Manager`` at one replica, recording failures the way
    torchft does (``report_error``, read back by ``errored``; a failed group setup
    inside ``start_quorum`` is recorded, not raised), with a fault injected at the
    quorum or the vote."""

    def __init__(self, fault: str) -> None:
        self.fault, self.error = fault, None

    def current_step(self) -> int:
        return 0

    def batches_committed(self) -> int:
        return 0

    def start_quorum(self) -> None:
        if self.fault == "quorum":
            self.report_error(RuntimeError("injected: the process group's setup failed"))

    def report_error(self, error: Exception) -> None:
        self.error = torchft.manager.ExceptionWithTraceback(error)

    def errored(self):
        return self.error

    def allreduce(self, tensor, reduce_op):
        class Done:
            def wait(self):
                return True
        return Done()  # (torchft's all-reduce does nothing once an error is recorded; alone here, a sum is the tensor)

    def should_commit(self) -> bool:
        if self.fault == "vote":
            raise RuntimeError("injected: should_commit failed after max_retries")
        return self.error is None


@pytest.mark.parametrize("fault, stage", [("quorum", "torchft's quorum"), ("vote", "the vote")])
def test_a_failed_quorum_or_vote_is_named_and_changes_nothing(fault, stage):
    tensor = torch.arange(4.0)
    with pytest.raises(puredist.CollectiveError, match=f"failed in {stage} .*injected") as error:
        ManagerCollective(_RecordingManager(fault)).mean_([tensor], context="x")
    assert error.value.completed_elements == (0,) and torch.equal(tensor, torch.arange(4.0))


class _HealingManager(_RecordingManager):
    """A stand-in manager whose first quorum heals this replica (torchft takes a peer's
    step during ``start_quorum``), counting the quorums started."""

    def __init__(self) -> None:
        super().__init__(fault="")
        self.step, self.quorums = 0, 0

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None:
        self.quorums += 1
        if self.quorums == 1:
            self.step = 7


class _HealThatDoesNotLoadManager(_HealingManager):
    """A stand-in manager whose first quorum takes a peer's step, then a registered
    load function raises inside ``start_quorum`` (as torchft's ``_apply_pending_state_dict``)."""

    def start_quorum(self) -> None:
        super().start_quorum()
        if self.quorums == 1:
            raise KeyError("outer_v2")


def test_a_heal_whose_registered_state_does_not_load_fails_every_later_reduction_without_communicating():
    # the replica is at its peers' step with its own state: a later reduction would average its stale values
    # in as a member's (or fail every replica's rank check); before, the heal was reported as a failed quorum
    # that changed nothing, and the next reduction joined
    from puredist.ft import HealFailed
    manager, tensor = _HealThatDoesNotLoadManager(), torch.arange(4.0)
    collective = ManagerCollective(manager)
    with pytest.raises(HealFailed, match=r"torchft step 0 -> 7.*registered with the manager raised \(KeyError") as first:
        collective.mean_([tensor], context="x")
    with pytest.raises(HealFailed) as again:
        collective.mean_([tensor], context="x")
    assert str(again.value) == str(first.value) and isinstance(again.value.__cause__, KeyError)
    assert manager.quorums == 1 and torch.equal(tensor, torch.arange(4.0))  # no second quorum; nothing written


@pytest.mark.parametrize("abandoned", [False, True])
def test_an_abandoned_replay_leaves_the_quorum_its_heal_opened(abandoned):
    # after a heal (Healed), the next reduction replays the healing quorum's; after HealFailed the replay will
    # never run, and a reduction must start a quorum of its own rather than join its peers' stale one
    from puredist.ft import Healed

    manager = _HealingManager()
    collective = ManagerCollective(manager, restart_on_heal=True)
    with pytest.raises(Healed):
        collective.mean_([torch.ones(2)], context="x")
    if abandoned:  # a quorum of its own: this replica alone, a member
        collective.abandon_replay()
        collective.mean_([torch.ones(2)], context="x")
    else:  # the replay joins the open quorum with zeros: alone there, nobody contributes
        with pytest.raises(puredist.RankMismatchError, match="every one is healing"):
            collective.mean_([torch.ones(2)], context="x")
    assert manager.quorums == (2 if abandoned else 1)



class _HealingThenFailingManager(_HealingManager):
    """Heals this replica in its first quorum, where a peer contributes (its row in the
    rank check: a member with any digests), and then the vote fails."""

    def allreduce(self, tensor, reduce_op):
        if tensor.dtype == torch.float64 and tensor.numel() == 7:  # the rank check's row
            tensor.add_(torch.tensor([1.0, 5.0, 25.0, 3.0, 9.0, 1.0, 0.0], dtype=torch.float64))
        return super().allreduce(tensor, reduce_op)

    def should_commit(self) -> bool:
        raise RuntimeError("injected: should_commit failed after max_retries")


@pytest.mark.parametrize("manager", [_HealingManager, _HealingThenFailingManager])
def test_a_replica_healed_in_a_step_that_then_fails_is_told_it_healed(manager):
    # the manager's load functions ran: whatever became of the step (alone here nobody contributes, or the
    # vote fails), the caller must go on from the peers' state, not hear that nothing changed
    from puredist.ft import Healed

    tensor = torch.ones(2)
    with pytest.raises(Healed, match="healed from a peer") as error:
        ManagerCollective(manager(), restart_on_heal=False).mean_([tensor], context="x")
    expected = puredist.RankMismatchError if manager is _HealingManager else puredist.CollectiveError
    assert isinstance(error.value.__cause__, expected), error.value.__cause__
    assert torch.equal(tensor, torch.ones(2))


class _HealingOuterManager(_HealingManager):
    """A stand-in manager whose first quorum heals this replica with ``peer`` (a
    transform's ``state_dict``), loading it as torchft does during ``start_quorum``;
    each quorum clears the error recorded in the last, as torchft's does."""

    def __init__(self, peer: dict) -> None:
        super().__init__()
        self.peer, self.loads = peer, []

    def register_state_dict_fn(self, key, load, save) -> None:
        self.loads.append(load)

    def start_quorum(self) -> None:
        self.error = None
        super().start_quorum()
        if self.quorums == 1:
            for load in self.loads:
                load(self.peer)


def test_a_heal_is_kept_when_the_synchronization_run_again_after_it_raises():
    # the healed replica's replay joins the healing quorum, where here nobody contributes: it raises. The caller
    # still holds its state from before the heal, while the manager is at its peers' step; the next update_ given
    # that state goes on from the healed one (before, it ran from step 0 against the peers' step and failed forever)
    from puredist.ft import FaultTolerantOuter

    transform = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9), sync_every=2, warmup_steps=2)
    params = [torch.ones(3)]
    before = transform.init(params)
    peer = {**transform.state_dict(before, rank=0), "step": 3, "global.0": torch.full((3,), 5.0)}
    outer = FaultTolerantOuter(transform, _HealingOuterManager(peer))
    with pytest.raises(puredist.RankMismatchError, match="every one is healing"):
        outer.update_(params, before)
    assert outer.heals == 1 and torch.equal(params[0], torch.full((3,), 5.0))
    after = outer.update_(params, before)  # alone in a quorum of its own now: the synchronization at step 3 completes
    assert (after.step, outer.failed) == (4, 0)
    assert torch.equal(after.global_params[0], torch.full((3,), 5.0)) and torch.equal(params[0], after.global_params[0])


class _PairedManager(_RecordingManager):
    """One of two stand-in managers, each driven by its own thread, whose all-reduce
    sums over both (a real exchange, by a barrier), at a given count of committed
    batches."""

    def __init__(self, barrier, slots: list, index: int, committed: int) -> None:
        super().__init__(fault="")
        self.barrier, self.slots, self.index, self.committed = barrier, slots, index, committed

    def batches_committed(self) -> int:
        return self.committed

    def allreduce(self, tensor, reduce_op):
        self.slots[self.index] = tensor.clone()
        self.barrier.wait()
        total = self.slots[0] + self.slots[1]
        self.barrier.wait()
        tensor.copy_(total)
        return super().allreduce(tensor, reduce_op)


def _paired_replicas(make, calls) -> list:
    """``calls[i](make(barrier, slots, i))`` for two paired stand-in managers (see
    :class:`_PairedManager`), each in a thread of its own: each one's result, or the
    error it raised."""
    import threading

    barrier, slots, outcomes = threading.Barrier(2, timeout=30), [None, None], [None, None]
    managers = [make(barrier, slots, i) for i in range(2)]

    def replica(index: int) -> None:
        try:
            outcomes[index] = calls[index](managers[index])
        except Exception as error:  # noqa: BLE001 - the outcome under test
            outcomes[index] = error

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


@pytest.mark.parametrize("histories", [(8, 8), (11, 10)])
def test_replicas_with_different_committed_histories_all_refuse(histories):
    # torchft's vote is per replica group: where some replicas committed a step and others redid it without them,
    # both are at the same step with different tensors; their next common reduction must refuse, not average
    def replica(manager):
        tensor = torch.full((4,), float(manager.index))
        ManagerCollective(manager).mean_([tensor], context="the same")
        return tensor

    outcomes = _paired_replicas(lambda barrier, slots, i: _PairedManager(barrier, slots, i, histories[i]),
                                [replica, replica])
    if histories[0] == histories[1]:
        assert all(torch.equal(t, torch.full((4,), 0.5)) for t in outcomes)
    else:
        assert all(isinstance(e, puredist.RankMismatchError) and "committed different histories" in str(e)
                   for e in outcomes), outcomes


class _GatheringHealingOuterManager(_HealingOuterManager):
    """:class:`_HealingOuterManager` whose quorums can gather (compressed payloads): a
    torchft process group of this one replica."""

    def __init__(self, peer: dict) -> None:
        super().__init__(peer)
        self._pg = torchft.process_group.ProcessGroupDummy(0, 1)

    def num_participants(self) -> int:
        return 1


def test_a_healed_compressed_replica_starts_with_zero_residuals():
    # a peer's residuals are what its own payloads lost: a healed replica that kept them would send them as its own.
    # top_k(1.0) is lossless, and outer SGD at lr 1 sets the global copy to the mean of the local parameters: the
    # oracle is the local parameters themselves (with the peer's residual of 3 kept, 3 less)
    from puredist.ft import FaultTolerantOuter

    transform = puredist.outer_optimizer(puredist.sgd(1.0), sync_every=2, warmup_steps=2, compressor=puredist.top_k(1.0))
    params = [torch.ones(3)]
    before = transform.init(params)
    peer = {**transform.state_dict(before, rank=0), "step": 3, "global.0": torch.full((3,), 5.0),
            "residual.0.rank0": torch.full((3,), 3.0)}
    outer = FaultTolerantOuter(transform, _GatheringHealingOuterManager(peer))
    with pytest.raises(puredist.RankMismatchError, match="every one is healing"):  # the replay: nobody contributes
        outer.update_(params, before)
    assert outer.heals == 1 and torch.equal(params[0], torch.full((3,), 5.0))
    params[0].add_(1.0)  # a local step
    after = outer.update_(params, before)  # the synchronization at step 3, alone in a quorum of its own
    assert (after.step, outer.failed) == (4, 0)
    assert torch.equal(after.global_params[0], torch.full((3,), 6.0)) and torch.equal(params[0], after.global_params[0])
    assert torch.equal(after.residuals[0], torch.zeros(3))


class _PairedHealingManager(_PairedManager):
    """A paired stand-in manager whose first quorum heals this replica (torchft takes
    its peer's step, 7) where ``heals``."""

    def __init__(self, barrier, slots: list, index: int, heals: bool) -> None:
        super().__init__(barrier, slots, index, committed=7)
        self.heals, self.step = heals, 7 if not heals else 0

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None:
        self.step = 7


def test_a_replay_after_healed_contributes_zeros_and_receives_its_peers_mean():
    # replica 1 heals in the quorum of replica 0's averaging and replays it: its own tensor (stale, and here not
    # zero, as a plain averaging's are) must not be averaged in; both end with replica 0's mean, the mean over the
    # one contributor
    from puredist.ft import Healed

    tensors = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 20.0, 30.0, 40.0])]

    def member(manager):
        collective = ManagerCollective(manager, restart_on_heal=True)
        collective.mean_([tensors[0]], context="the same")
        return collective.world_size

    def healing(manager):
        collective = ManagerCollective(manager, restart_on_heal=True)
        with pytest.raises(Healed):
            collective.mean_([tensors[1]], context="the same")
        assert torch.equal(tensors[1], torch.tensor([10.0, 20.0, 30.0, 40.0]))  # nothing reduced, nothing written
        collective.mean_([tensors[1]], context="the same")  # the replay
        return collective.world_size

    healing_second = lambda barrier, slots, i: _PairedHealingManager(barrier, slots, i, heals=i == 1)  # noqa: E731
    assert _paired_replicas(healing_second, [member, healing]) == [1, 1]
    for tensor in tensors:
        assert torch.equal(tensor, torch.tensor([1.0, 2.0, 3.0, 4.0]))


class _QuorumFailsOnceManager(_PairedManager):
    """A paired stand-in manager whose ``start_quorum`` does as torchft's: it first
    waits for the previous quorum's future (re-raising its error), then starts a new
    one and waits for it; the first quorum times out."""

    def __init__(self, barrier, slots: list, index: int) -> None:
        super().__init__(barrier, slots, index, committed=0)
        self._quorum_future, self.quorums = None, 0

    def start_quorum(self) -> None:
        import concurrent.futures

        if self._quorum_future is not None:
            self._quorum_future.result()
        self.error, self.quorums = None, self.quorums + 1
        self._quorum_future = concurrent.futures.Future()
        if self.quorums == 1:
            self._quorum_future.set_exception(TimeoutError("injected: the quorum timed out"))
        else:
            self._quorum_future.set_result(None)
        self._quorum_future.result()


def test_a_failed_quorum_that_is_no_heal_changes_nothing_and_the_next_one_averages():
    # torchft's start_quorum raises its quorum's error, and re-raises it at every later start_quorum unless the
    # failed quorum is forgotten: the replicas would fail every reduction from then on
    tensors = [torch.full((4,), 1.0), torch.full((4,), 3.0)]

    def replica(manager):
        collective, tensor = ManagerCollective(manager), tensors[manager.index]
        before = tensor.clone()
        with pytest.raises(puredist.CollectiveError, match="failed in torchft's quorum.*injected: the quorum timed out"):
            collective.mean_([tensor], context="the same")
        assert torch.equal(tensor, before)
        collective.mean_([tensor], context="the same")
        return collective.world_size, manager.quorums

    assert _paired_replicas(_QuorumFailsOnceManager, [replica, replica]) == [(2, 2), (2, 2)]
    assert all(torch.equal(tensor, torch.full((4,), 2.0)) for tensor in tensors)  # the mean of 1 and 3
