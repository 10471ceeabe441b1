"""``python -m pyro2pfp.cli``: the command line (same as ``pyro2pfp`` and ``python -m pyro2pfp``)."""
import sys

from .app import main

sys.exit(main())
