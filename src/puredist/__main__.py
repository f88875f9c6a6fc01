"""``python -m puredist COMMAND``: ``demo`` (the main job); ``--help`` lists the commands.

This module must not hold a command's logic: it dispatches to the command's module.
"""

import sys

from puredist import __version__
from puredist.demo.cli import main

USAGE = f"""usage: python -m puredist [--help | --version] COMMAND [options]

puredist {__version__}: communication-efficient distributed training as pure functions.

commands:
  demo    train a model on local worker processes under every algorithm and compare
          them (python -m puredist demo --help for its options)"""

if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] in (["--help"], ["-h"]):
        print(USAGE)
        sys.exit(0)
    if arguments[:1] == ["--version"]:
        print(__version__)
        sys.exit(0)
    if arguments[:1] != ["demo"]:
        named = f"error: unknown command {arguments[0]!r}\n\n" if arguments else ""
        print(named + USAGE, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(arguments[1:]))
