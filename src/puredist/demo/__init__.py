"""The main job: ``python -m puredist demo`` (see :mod:`puredist.demo.cli`).

This package must not be imported by the library: it is the main job, with its own
dependencies (the ``demo`` extra).
"""
