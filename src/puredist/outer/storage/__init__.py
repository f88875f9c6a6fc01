"""How a fragment's tensors are held: the storage protocol
(:class:`~puredist.outer.storage.base.Storage`), its implementations, and the one
choice among them (:func:`~puredist.outer.storage.choose.storage_for`)."""

from puredist.outer.storage.base import Fragment, Payload, Storage
from puredist.outer.storage.choose import storage_for, traced_storage

__all__ = ["Fragment", "Payload", "Storage", "storage_for", "traced_storage"]
