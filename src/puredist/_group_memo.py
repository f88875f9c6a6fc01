"""Process groups puredist made, remembered without keeping them alive.

torch holds every group it makes until ``destroy_process_group``. A group that a
module-level dict still held after that was torn down at interpreter exit instead,
where Gloo's threads now and then abort the process ("terminate called without an
active exception"). So puredist remembers the groups it made (subgroups, groups of
several mesh dimensions, Gloo twins) by weak reference, each with the world it was
made in: an entry of a world since destroyed, or whose group is gone, reads as absent.
"""

from __future__ import annotations

import weakref
from typing import Hashable

import torch.distributed as dist


class GroupMemo:
    """``key -> group`` for the current world, held weakly. A group may be ``None``:
    this rank is in none of the groups made for ``key`` (then only the world is held)."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[weakref.ref, "weakref.ref | None"]] = {}

    def _entry(self, key: Hashable) -> "tuple[weakref.ref, weakref.ref | None] | None":
        entry = self._entries.get(key)
        if entry is not None and (entry[0]() is not dist.group.WORLD or (entry[1] is not None and entry[1]() is None)):
            del self._entries[key]  # made in a destroyed world, or destroyed itself
            return None
        return entry

    def __contains__(self, key: Hashable) -> bool:
        return self._entry(key) is not None

    def get(self, key: Hashable) -> "dist.ProcessGroup | None":
        """The group remembered for ``key``; ``None`` where there is none, or it is ``None``."""
        entry = self._entry(key)
        return None if entry is None or entry[1] is None else entry[1]()

    def __setitem__(self, key: Hashable, group: "dist.ProcessGroup | None") -> None:
        self._entries[key] = (weakref.ref(dist.group.WORLD), None if group is None else weakref.ref(group))
