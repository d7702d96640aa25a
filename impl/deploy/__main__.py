"""``python -m impl.deploy ...``: the deploy subcommand on its own (the launch scripts call this)."""

import sys

from impl.deploy.cli import main

sys.exit(main(sys.argv[1:]))
