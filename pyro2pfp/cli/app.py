"""``main``: run one ``pyro2pfp`` command and turn its errors into one line and an exit status."""
from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from ..errors import InternalError, PFPError
from .parser import build_parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pyro2pfp`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except InternalError as exc:  # a bug the library caught and named: as below, its cause chained
        print(f"pyro2pfp {args.command}: {' '.join(str(exc).split())}"
              + ("" if args.debug else " (rerun with --debug for the traceback)"), file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return 2
    except (PFPError, OSError) as exc:  # a user error (or a file system one): one clear line, no traceback
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"pyro2pfp {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 -- a bug in pyro2pfp or a dependency
        print(f"pyro2pfp {args.command}: internal error ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}). "
              "Please report it with the command line"
              + (":" if args.debug else "; rerun with --debug for the traceback."), file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return 2

