"""Drop-in replacements for torch's model-averaging classes and hooks.

Swap the import, keep the code::

    # from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from puredist.classic import PeriodicModelAverager

The submodules mirror torch's module names (``averagers``, ``utils``,
``hierarchical_model_averager``, ``post_localSGD_optimizer``,
``post_localSGD_hook``, ``zero_redundancy_optimizer``, ``ddp_zero_hook``) for
module-level imports. ``puredist.classic.post_localSGD_hook`` is the module, as in
torch (``post_localSGD_hook.post_localSGD_hook`` is the hook)::

    from puredist.classic import post_localSGD_hook as post_localSGD
    model.register_comm_hook(post_localSGD.PostLocalSGDState(None, None, 10), post_localSGD.post_localSGD_hook)

This package must not compute anything of its own: every class and hook delegates to
puredist's functions and keeps torch's surface (names, signatures, warnings, errors).
"""

from puredist.classic.averagers import ModelAverager, PeriodicModelAverager
from puredist.classic.ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved
from puredist.classic.hierarchical_model_averager import HierarchicalModelAverager
from puredist.classic import post_localSGD_hook
from puredist.classic.post_localSGD_hook import PostLocalSGDState
from puredist.classic.post_localSGD_optimizer import PostLocalSGDOptimizer
from puredist.classic.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from puredist.classic.utils import (
    average_parameters,
    average_parameters_or_parameter_groups,
    get_params_to_average,
)

__all__ = [
    "ModelAverager",
    "PeriodicModelAverager",
    "HierarchicalModelAverager",
    "PostLocalSGDOptimizer",
    "PostLocalSGDState",
    "post_localSGD_hook",  # the module
    "average_parameters",
    "get_params_to_average",
    "average_parameters_or_parameter_groups",
    "ZeroRedundancyOptimizer",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
]
