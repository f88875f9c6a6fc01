"""Bad input to the classic layer: the same exception type as torch's class where
torch raises, a clear error where torch stays silent, and torch's warnings."""

import contextlib
import os
import time
import warnings

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hierarchical
from torch.distributed.algorithms.model_averaging import utils as torch_utils

from puredist import classic
from workers import run_workers

CASES = {
    "period 0": (lambda m: m.PeriodicModelAverager(period=0), ValueError),
    "negative warmup": (lambda m: m.PeriodicModelAverager(period=2, warmup_steps=-1), ValueError),
    "period 0 and negative warmup": (lambda m: m.PeriodicModelAverager(0, -1), ValueError),
    "empty hierarchy": (lambda m: m.HierarchicalModelAverager({}), ValueError),
    "no hierarchy": (lambda m: m.HierarchicalModelAverager(), ValueError),
    "period 0 in hierarchy": (lambda m: m.HierarchicalModelAverager({0: 2, 4: 4}), ValueError),
    "last size is not the world": (lambda m: m.HierarchicalModelAverager({2: 2, 4: 2}), ValueError),
    "size does not divide the world": (lambda m: m.HierarchicalModelAverager({2: 3, 4: 4}), ValueError),
    "negative warmup in hierarchy": (lambda m: m.HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=-2), ValueError),
    "last size is not the world, and negative warmup": (
        lambda m: m.HierarchicalModelAverager({2: 2, 4: 2}, warmup_steps=-1), ValueError),
    "unsupported param type": (lambda m: m.get_params_to_average([torch.zeros(2)]), NotImplementedError),
}
# torch accepts a hierarchy whose periods are not increasing and then never reaches
# the lower levels' "largest period wins" rule as documented; puredist refuses it.
PUREDIST_ONLY = {"periods out of order": (lambda m: m.HierarchicalModelAverager({4: 2, 2: 4}), ValueError)}
# what torch accepts: numpy's integers (from a config or argparse with numpy types), and
# at a step without averaging, anything as ``params`` (it is not read)
ACCEPTED = {
    "numpy ints": lambda m: m.PeriodicModelAverager(period=np.int64(2), warmup_steps=np.int64(1)),
    "numpy ints in hierarchy": lambda m: m.HierarchicalModelAverager({np.int64(2): np.int64(2), 4: 4}, np.int64(0)),
    "params not read when not due": lambda m: _not_due(m.PeriodicModelAverager(period=2, warmup_steps=0)),
    "params not read when not due, hierarchy": lambda m: _not_due(m.HierarchicalModelAverager({2: 2, 4: 4})),
}


def _not_due(averager):
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.zeros(3)
    averager.average_parameters([param])  # step 0: averages
    unread = iter([torch.zeros(3)])  # a plain tensor would be refused if it were read
    averager.average_parameters(unread)  # step 1: nothing due
    assert averager.step == 2 and next(unread) is not None


def _raised(build, module):
    try:
        build(module)
    except Exception as error:  # noqa: BLE001 - the type is the result
        return type(error).__name__, str(error)
    return None, ""


class _TorchNamespace:
    PeriodicModelAverager = torch_averagers.PeriodicModelAverager
    HierarchicalModelAverager = torch_hierarchical.HierarchicalModelAverager
    get_params_to_average = staticmethod(torch_utils.get_params_to_average)


def _all_cases(rank, world_size):
    results = {}
    for name, (build, _) in {**CASES, **PUREDIST_ONLY}.items():
        results[name] = (_raised(build, _TorchNamespace), _raised(build, classic))
    for name, build in ACCEPTED.items():
        results[name] = (_raised(build, _TorchNamespace), _raised(build, classic))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_averagers.PeriodicModelAverager(period=1)
        classic.PeriodicModelAverager(period=1)
        torch_hierarchical.HierarchicalModelAverager({1: 4})
        classic.HierarchicalModelAverager({1: 4})
        for module in (torch_hierarchical, classic):  # warns, then refuses the warm-up
            with contextlib.suppress(ValueError):
                module.HierarchicalModelAverager({1: 4}, warmup_steps=-1)
    # the file and line a warning is attributed to: the caller's (filters by module select on it)
    results["warnings"] = [(w.category.__name__, str(w.message), os.path.basename(w.filename)) for w in caught]
    return results


@pytest.fixture(scope="module")
def outcomes():
    return run_workers(_all_cases, 4)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_exception_type_as_torch(outcomes, case):
    (torch_type, _), (our_type, message) = outcomes[case]
    assert torch_type == CASES[case][1].__name__
    assert our_type == torch_type, message


@pytest.mark.parametrize(
    "case, words",
    [
        ("period 0", "got 0"),
        ("negative warmup", "got -1"),
        ("period 0 and negative warmup", "warmup_steps.*got -1"),  # torch checks the warm-up first
        ("last size is not the world", "2 must be equal to the size of arg ``process_group`` 4"),
        # torch checks the group sizes before the warm-up
        ("last size is not the world, and negative warmup", "2 must be equal to the size of arg ``process_group`` 4"),
        ("size does not divide the world", "divisor of the group's size 4, got 3"),
        ("periods out of order", "strictly increasing.*\\[4, 2\\]"),
    ],
)
def test_errors_name_the_argument_and_value(outcomes, case, words):
    import re

    assert re.search(words, outcomes[case][1][1]), outcomes[case][1][1]


def test_unordered_periods_are_refused(outcomes):
    (torch_type, _), (our_type, _) = outcomes["periods out of order"]
    assert torch_type is None and our_type == "ValueError"


def test_period_one_warns_like_torch(outcomes):
    torch_periodic, ours_periodic, torch_hier, ours_hier, torch_refused, ours_refused = outcomes["warnings"]
    assert ours_periodic == torch_periodic and torch_periodic[2] == "test_classic_errors.py"
    assert ours_hier == torch_hier
    assert ours_refused == torch_refused  # the warning comes before the warm-up's refusal


def _steps_that_average(averager, rank, steps, changes):
    """The steps at which ``averager`` averaged (a rank-local value moved), with the
    attribute ``changes`` made at the given steps."""
    param = torch.nn.Parameter(torch.zeros(1))
    averaged = []
    for step in range(steps):
        for attribute, value in changes.get(step, {}).items():
            setattr(averager, attribute, value)
        with torch.no_grad():
            param.fill_(float(rank))
        param.grad = torch.zeros(1)
        averager.average_parameters([param])
        if param.item() != rank:
            averaged.append(step)
    return averaged


def _schedules_after_attribute_changes(rank, world_size):
    changes = {2: {"period": 3, "warmup_steps": 2}, 9: {"period": 1}}
    hierarchy_changes = {1: {"warmup_steps": 6}}
    return {
        "periodic": [_steps_that_average(m.PeriodicModelAverager(period=4), rank, 16, changes)
                     for m in (torch_averagers, classic)],
        "hierarchical": [_steps_that_average(m.HierarchicalModelAverager({2: 2}), rank, 12, hierarchy_changes)
                         for m in (torch_hierarchical, classic)],
    }


def test_a_changed_period_or_warm_up_takes_effect_as_in_torch():
    # torch reads the attributes at every call; the oracle is torch's class, side by side
    for torchs, ours in run_workers(_schedules_after_attribute_changes, 2)[0].values():
        assert ours == torchs and len(torchs) > 2, (ours, torchs)


def _one_rank_passes_a_plain_tensor(rank, world_size):
    averager = classic.PeriodicModelAverager(period=2)
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.zeros(3)
    start = time.monotonic()
    try:
        averager.average_parameters([torch.ones(3)] if rank == 1 else [param])
    except Exception as error:  # noqa: BLE001 - the type and the time are the result
        return type(error).__name__, time.monotonic() - start, str(error)
    return None, time.monotonic() - start, ""


def test_a_rank_passing_an_unsupported_element_makes_its_peers_raise_at_once():
    (peer, peer_s, message), (refusing, _, _) = run_workers(_one_rank_passes_a_plain_tensor, 2, gloo_timeout=20)
    assert refusing == "NotImplementedError"
    assert peer == "RankMismatchError" and peer_s < 10 and "not supported" in message, (peer, peer_s, message)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_what_torch_accepts_is_accepted(outcomes, case):
    (torch_type, torch_message), (our_type, message) = outcomes[case]
    assert torch_type is None, torch_message
    assert our_type is None, message


def test_without_a_default_group_the_error_is_torchs_type():
    import torch.distributed as dist

    assert not dist.is_initialized()
    for module in (_TorchNamespace, classic):
        with pytest.raises(TypeError, match="Invariant encountered: value was None"):
            module.PeriodicModelAverager(period=2)


def _resources_after_constructions(rank, world_size):
    import os

    from puredist.classic import HierarchicalModelAverager

    def used():
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=0)
    first = used()
    for _ in range(5):
        averager = HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=0)
        param = torch.nn.Parameter(torch.full((3,), float(rank)))
        param.grad = torch.zeros(3)
        averager.average_parameters([param])  # the reused subgroups still work
        assert torch.equal(param.detach(), torch.full((3,), 1.5))
    return first, used()


def test_constructing_hierarchical_averagers_does_not_leak_process_groups():
    for first, last in run_workers(_resources_after_constructions, 4):
        assert last == first, f"file descriptors and threads grew from {first} to {last}"


TORCH_MODULES = {
    "averagers": "torch.distributed.algorithms.model_averaging.averagers",
    "utils": "torch.distributed.algorithms.model_averaging.utils",
    "hierarchical_model_averager": "torch.distributed.algorithms.model_averaging.hierarchical_model_averager",
    "post_localSGD_hook": "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook",
    "post_localSGD_optimizer": "torch.distributed.optim.post_localSGD_optimizer",
    "zero_redundancy_optimizer": "torch.distributed.optim.zero_redundancy_optimizer",
    "ddp_zero_hook": "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook",
}


@pytest.mark.parametrize("name", list(TORCH_MODULES))
def test_submodules_are_modules_with_torchs_public_names(name):
    """torch's idiom ``from ... import post_localSGD_hook as post_localSGD`` then
    ``post_localSGD.PostLocalSGDState`` must survive swapping the import."""
    import importlib
    import types

    ours = getattr(classic, name)
    assert isinstance(ours, types.ModuleType)
    assert ours is importlib.import_module(f"puredist.classic.{name}")
    theirs = importlib.import_module(TORCH_MODULES[name])
    wanted = set(getattr(theirs, "__all__", ())) or {n for n in ours.__all__}
    assert wanted <= set(dir(ours)), sorted(wanted - set(dir(ours)))


def test_param_groups_given_as_iterators_select_what_torchs_function_selects():
    # a param group's "params" may be a one-pass iterator (model.parameters()): read once, as torch does
    def model():
        torch.manual_seed(0)
        layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        for i, p in enumerate(layers.parameters()):
            p.grad = None if i == 2 else torch.ones_like(p)
        return layers

    for groups in (lambda m: [{"params": m.parameters()}], lambda m: [{"params": iter(list(m.parameters()))}]):
        layers = model()
        ours = classic.get_params_to_average(groups(layers))
        theirs = torch_utils.get_params_to_average(groups(layers))
        assert [id(p) for p in ours] == [id(p) for p in theirs] and len(ours) == 5

    def endless():  # a bad element raises when it is reached, as torch's: nothing after it is read
        yield from model().parameters()
        yield 5
        while True:
            yield torch.nn.Parameter(torch.ones(1))

    for get in (torch_utils.get_params_to_average, classic.get_params_to_average):
        with pytest.raises(NotImplementedError, match="Parameter input of type <class 'int'> is not supported"):
            get(endless())



def _subclasses(base):
    """Subclasses of ``base`` (a ``ModelAverager``) as users write them: one setting
    ``step`` before ``super().__init__``, one never calling it."""

    class StepFirst(base):
        def __init__(self):
            self.step = 5
            super().__init__(process_group=object())  # (any group: nothing is averaged)

        def average_parameters(self, params):
            self.step += 1

    class NoSuper(base):
        def __init__(self):
            self.process_group, self.step = None, 0

        def average_parameters(self, params):
            self.step += 1

    return StepFirst, NoSuper


def test_model_averager_subclasses_that_set_the_step_early_or_skip_init_count_as_torchs():
    for ours, theirs in zip(_subclasses(classic.ModelAverager), _subclasses(torch_averagers.ModelAverager)):
        mine, reference = ours(), theirs()
        for averager in (mine, reference):
            averager.average_parameters([])
            averager.average_parameters([])
        assert mine.step == reference.step, type(mine).__name__
