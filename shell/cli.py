"""The ``nnxscan`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nnxscan``: ``nnxscan demo [digits|hypernet] [--out DIR]``.

    Example:
      >>> main(["demo", "--out", "/tmp"])
    """
    parser = argparse.ArgumentParser(prog="nnxscan", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small model and write a plot")
    demo.add_argument("name", nargs="?", default="digits", choices=["digits", "hypernet"])
    demo.add_argument("--out", default=".", help="folder for the PNG (default: .)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    if args.name == "digits":
        from nnxscan.shell.demos.digits import run_digits_demo

        run_digits_demo(args.out, seed=args.seed, progress=not args.no_progress)
    else:
        from nnxscan.shell.demos.hypernet import run_hypernet_demo

        run_hypernet_demo(args.out, seed=args.seed, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
