"""``python -m puredist demo [options]``: the main job (see ``--help``)."""

import sys

from puredist.demo.cli import main

USAGE = "usage: python -m puredist demo [--help | options]"

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "demo":
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
