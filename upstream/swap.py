"""Imported first by the generated copies of torch's tests: makes torch's names for
the seeds resolve to ``puredist.classic`` (the import swap a user makes), and lets
tests that only ask for a GPU to get a device run on CPU.

Runs in the test process and in every spawned rank (each re-imports the test
module, whose first line imports this one).
"""

from __future__ import annotations

import importlib
import sys

import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401 - parents of the swapped modules
import torch.distributed.algorithms.model_averaging  # noqa: F401
import torch.distributed.optim
import torch.testing._internal.common_distributed as common_distributed

import puredist.classic

SWAPPED_MODULES = {
    "torch.distributed.algorithms.model_averaging.averagers": "puredist.classic.averagers",
    "torch.distributed.algorithms.model_averaging.utils": "puredist.classic.utils",
    "torch.distributed.algorithms.model_averaging.hierarchical_model_averager": (
        "puredist.classic.hierarchical_model_averager"
    ),
    "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook": "puredist.classic.post_localSGD_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook": "puredist.classic.ddp_zero_hook",
    "torch.distributed.optim.post_localSGD_optimizer": "puredist.classic.post_localSGD_optimizer",
}
"""torch module -> the puredist module that replaces it wholesale."""

SWAPPED_NAMES = {
    "ZeroRedundancyOptimizer": puredist.classic.ZeroRedundancyOptimizer,
    "PostLocalSGDOptimizer": puredist.classic.PostLocalSGDOptimizer,
}
"""Classes re-exported by ``torch.distributed.optim`` (whose private helpers, such as
``zero_redundancy_optimizer._broadcast_object``, the tests keep using from torch)."""


def _lift_gpu_only_skips() -> None:
    """``skip_if_no_gpu`` and ``requires_accelerator_dist_backend`` guard tests that
    run as well on CPU/Gloo (the device comes from the test's ``device`` property,
    "cpu" here); tests that need several GPUs (``skip_if_lt_x_gpu``) stay skipped."""
    common_distributed.skip_if_no_gpu = lambda test: test
    common_distributed.requires_accelerator_dist_backend = lambda backends=None: (lambda test: test)


def install() -> None:
    for torch_name, puredist_name in SWAPPED_MODULES.items():
        replacement = importlib.import_module(puredist_name)
        parent, _, leaf = torch_name.rpartition(".")
        importlib.import_module(torch_name)  # torch's own, so that nothing re-imports it later
        setattr(sys.modules[parent], leaf, replacement)
        sys.modules[torch_name] = replacement
    for name, replacement in SWAPPED_NAMES.items():
        setattr(torch.distributed.optim, name, replacement)
    _lift_gpu_only_skips()


install()
