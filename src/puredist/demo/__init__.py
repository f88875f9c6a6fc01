"""The main job: ``python -m puredist demo`` (see :mod:`puredist.demo.cli`)."""
