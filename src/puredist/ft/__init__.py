"""Fault tolerance over torchft (the optional extra ``puredist[ft]``): averaging and
DiLoCo whose synchronizations survive replica groups that die, restart and heal.

- :class:`ManagerCollective`: a :class:`~puredist.Collective` over a torchft
  ``Manager``'s quorum (:mod:`puredist.ft.collective`);
- :class:`FaultTolerantOuter`: an outer-optimization transform's ``update_`` that
  serves and heals its state (:mod:`puredist.ft.outer`);
- :class:`HealFailed`: a heal whose state did not load (the replica cannot rejoin);
- :func:`replica_manager`: the ``Manager`` they need (:mod:`puredist.ft.setup`).

This package must not be imported by the rest of puredist (torchft is optional).
"""

from puredist.errors import HealFailed, Healed
from puredist.ft.collective import ManagerCollective
from puredist.ft.outer import FaultTolerantOuter
from puredist.ft.setup import replica_manager

__all__ = ["FaultTolerantOuter", "HealFailed", "Healed", "ManagerCollective", "replica_manager"]
