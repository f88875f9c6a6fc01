"""The public surface: every function the constructors return documents itself, and
the tree utilities a user's own transform needs are public."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import puredist


def test_every_returned_function_has_a_docstring():
    built = {
        "periodic_averager": puredist.periodic_averager(2),
        "hierarchical_averager": puredist.hierarchical_averager({2: 2, 4: 4}),
        "sgd": puredist.sgd(lr=0.1),
        "adam": puredist.adam(),
        "adamw": puredist.adamw(),
        "zero": puredist.zero(puredist.sgd(lr=0.1)),
        "outer_optimizer": puredist.outer_optimizer(puredist.sgd(lr=0.7), sync_every=2),
    }
    undocumented = [
        f"{name}().{field}" for name, functions in built.items()
        for field, function in functions._asdict().items() if not (function.__doc__ or "").strip()
    ]
    assert not undocumented, undocumented


def test_a_users_transform_flattens_trees_as_puredist_does():
    from puredist.tree import tree_flatten, tree_map, tree_unflatten

    params = {"b": torch.ones(2), "a": [torch.zeros(1), None]}
    leaves, spec = tree_flatten(params)
    assert [leaf.shape for leaf in leaves] == [(2,), (1,)]  # insertion order, None skipped
    doubled = tree_unflatten(spec, [2 * leaf for leaf in leaves])
    assert doubled["a"][1] is None and torch.equal(doubled["b"], 2 * torch.ones(2))
    assert torch.equal(tree_map(torch.neg, params)["b"], -torch.ones(2))


def test_flat_containers_of_tensors_flatten_as_optree_does():
    # lists, tuples and dicts of plain tensors skip optree's look at each leaf: the oracle is optree itself
    import optree

    from puredist.tree import tree_flatten, tree_unflatten

    p = torch.nn.Parameter(torch.ones(3))
    for tree in ([torch.ones(1), p], (p,), [], {"z": p, "a": torch.zeros(2)}, {}, [p, None], {"a": 1.0},
                 {1: p}, {True: p}, {1.0: p}):  # (keys equal across types: each keeps its own)
        leaves, spec = tree_flatten(tree)
        with optree.dict_insertion_ordered(True, namespace="puredist"):
            expected_leaves, expected_spec = optree.tree_flatten(tree, none_is_leaf=False, namespace="puredist")
        assert spec == expected_spec and len(leaves) == len(expected_leaves), tree
        assert all(a is b for a, b in zip(leaves, expected_leaves)), tree
        rebuilt = tree_unflatten(spec, leaves)
        assert type(rebuilt) is type(tree) and optree.tree_structure(rebuilt) == optree.tree_structure(tree)
        if isinstance(tree, dict):
            assert [type(k) for k in rebuilt] == [type(k) for k in tree], tree
    assert list(tree_flatten({"z": p, "a": torch.zeros(2)})[0][0].shape) == [3]  # insertion order, not sorted


_LEAF = st.sampled_from([torch.ones(1), torch.nn.Parameter(torch.zeros(2)), None, 1.5])
_KEY = st.one_of(st.text(max_size=3), st.integers(-2, 2), st.booleans(), st.floats(-2, 2, allow_nan=False))
_TREES = st.recursive(
    _LEAF,
    lambda children: st.one_of(st.lists(children, max_size=4), st.lists(children, max_size=4).map(tuple),
                               st.dictionaries(_KEY, children, max_size=4)),
    max_leaves=12,
)


@given(_TREES)
def test_any_tree_flattens_and_rebuilds_as_optree_does(tree):
    # the fast path (flat containers of tensors) and optree's own must be indistinguishable: optree is the oracle
    import optree

    from puredist.tree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(tree)
    with optree.dict_insertion_ordered(True, namespace="puredist"):
        expected_leaves, expected_spec = optree.tree_flatten(tree, none_is_leaf=False, namespace="puredist")
    assert spec == expected_spec and len(leaves) == len(expected_leaves)
    assert all(a is b for a, b in zip(leaves, expected_leaves))
    rebuilt = tree_unflatten(spec, leaves)
    with optree.dict_insertion_ordered(True, namespace="puredist"):
        assert optree.tree_structure(rebuilt, none_is_leaf=True) == optree.tree_structure(tree, none_is_leaf=True)
    if isinstance(tree, dict):
        assert [type(k) for k in rebuilt] == [type(k) for k in tree]


def test_no_public_name_is_also_a_submodule():
    """``import puredist.x`` must give the module x, never a function of that name."""
    import pkgutil

    submodules = {module.name for module in pkgutil.iter_modules(puredist.__path__)}
    assert not set(puredist.__all__) & submodules, set(puredist.__all__) & submodules


def test_importing_puredist_leaves_dtensor_unimported_and_a_dtensor_made_later_is_one():
    # torch.distributed.tensor (sympy with it) takes about a second to import: every worker process paid it
    import subprocess
    import sys

    code = (
        "import sys, torch, puredist\n"
        "from puredist._dtensors import is_dtensor\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'imported'\n"
        "assert not is_dtensor(torch.ones(1))\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "from torch.distributed.tensor import DTensor, Replicate, init_device_mesh\n"
        "d = DTensor.from_local(torch.ones(2), init_device_mesh('cpu', (1,)), [Replicate()])\n"
        "assert is_dtensor(d) and not is_dtensor(torch.ones(1))\n"
        "dist.destroy_process_group()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_collectives_modules_keep_their_import_rules_and_form_no_cycle():
    """The protocol module imports no backend, the simulated and vmapped backends nothing
    of ``torch.distributed``, and no collectives module is part of an import cycle among
    puredist's modules (``TYPE_CHECKING`` imports included): a backend imports its
    siblings by their own modules, not through the package that re-exports them."""
    import pathlib

    from import_rules import cycles, package_imports

    graph = package_imports(pathlib.Path(puredist.__file__).parent, "puredist")
    collectives = {name: imported for name, imported in graph.items() if name.startswith("puredist.collectives")}
    assert set(collectives) == {"puredist.collectives", "puredist.collectives.base",
                                "puredist.collectives.distributed", "puredist.collectives.simulated",
                                "puredist.collectives.vmap"}
    base = graph["puredist.collectives.base"]
    assert not {m for m in base if m.startswith(("puredist.collectives", "torch.distributed"))}, sorted(base)
    for one_process in ("puredist.collectives.simulated", "puredist.collectives.vmap"):
        assert not {m for m in graph[one_process] if m.startswith("torch.distributed")}, one_process
    ours = {name: {m for m in imported if m in graph} for name, imported in graph.items()}
    assert not [m for m in cycles(ours) if m.startswith("puredist.collectives")], cycles(ours)
