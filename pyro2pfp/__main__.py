"""``python -m pyro2pfp``: the command line (same as the ``pyro2pfp`` command)."""
import sys

from .cli import main

sys.exit(main())
