"""``python -m impl.router [flags]``: the router subcommand on its own."""

import sys

from impl.router.cli import main

sys.exit(main(["router", *sys.argv[1:]]))
