"""Loaded (as ``sitecustomize``) by the scripts the tests launch under torchrun: at
interpreter exit, after every line of the script and every other exit handler ran,
each rank says so on stderr (see ``tests/launched.py``)."""

import atexit
import os
import sys


def _say_the_script_ended() -> None:
    sys.stderr.write(f"[puredist tests: rank {os.environ['RANK']} ran to its end]\n")
    sys.stderr.flush()


if "RANK" in os.environ:  # a worker (torchrun's agent has no rank)
    atexit.register(_say_the_script_ended)  # (registered first: runs last)
