"""The ``nnxscan`` command line: ``nnxscan demo [NAME]`` and ``nnxscan --version``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nnxscan.shell._edges.compile_cache import DEFAULT_DIR

__all__ = ["main"]

DESCRIPTION = "Train Flax NNX models with jax.lax.scan, and run networks on generated weights."
DEMOS = {
    "digits": "an MLP on scikit-learn's digits (the default)",
    "hypernet": "one hypernetwork learns a family of sine functions",
    "hypernet-cl": "tasks in sequence: a hypernetwork remembers, fine-tuning forgets",
    "lr-find": "16 learning rates of the digits MLP side by side in one program",
    "ppo": "PPO on CartPole: one jit; --checkpoint-dir, --sweep (needs [rl])",
    "sweep": "a learning-rate x seed sweep: 16 MLPs in one compiled program",
}
DEMO_LIST = "demos:\n" + "".join(f"  {name:<12}{text}\n" for name, text in DEMOS.items())
DEMO_DESCRIPTION = (
    "Trains a small model with scanned epochs, prints how well and how fast it\n"
    "trained, and writes a plot to OUT/nnxscan_demo_NAME.png.\n"
    "Needs the demo extra: pip install 'nnxscan[demo]'\n"
    "(in a clone of the repository: pip install -e '.[demo]').\n\n" + DEMO_LIST
)


#: ``nnxscan demo``'s options besides the name: (flag, help, argparse keywords).
DEMO_OPTIONS: tuple[tuple[str, str, dict], ...] = (
    ("--out", "folder to write the PNG to, created if missing (default: .)",
     {"default": ".", "metavar": "OUT"}),
    ("--seed", "seeds the data, the initial weights and the shuffling (default: 0)",
     {"type": int, "default": 0, "metavar": "N"}),
    ("--seeds", "ppo: train N seeds (seed, seed+1, ...) vmapped in one program (default: 1)",
     {"type": int, "default": 1, "metavar": "N"}),
    ("--checkpoint-dir", "ppo: train through Trainer.fit with checkpoints in DIR; run it "
     "again after a kill to resume", {"default": None, "metavar": "DIR"}),
    ("--sweep", "ppo: a Population of every seed x value, e.g. --sweep ent_coef=0,0.01,0.05",
     {"default": None, "metavar": "NAME=V1,V2"}),
    ("--steps", "lr-find: steps each learning rate trains (default: 300)",
     {"type": int, "default": 300, "metavar": "N"}),
    ("--no-progress", "show no progress bar (and, off a terminal, no line per epoch)",
     {"action": "store_true"}),
    ("--compile-cache", "keep compiled programs here, so the next run skips compiling "
     f"(default: {DEFAULT_DIR})", {"default": DEFAULT_DIR, "metavar": "DIR"}),
    ("--no-compile-cache", "compile everything afresh and keep nothing",
     {"action": "store_true"}),
)  # fmt: skip


def _version() -> str:
    import nnxscan  # its __version__, from the installed distribution's metadata

    return nnxscan.__version__


def _parser() -> argparse.ArgumentParser:
    """The argument parser of ``nnxscan``; its help is plain text that fits 80 columns."""
    parser = argparse.ArgumentParser(
        prog="nnxscan",
        description=DESCRIPTION,
        epilog=DEMO_LIST + "\nRun 'nnxscan demo --help' for the demo's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nnxscan {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, title="commands")
    demo = commands.add_parser(
        "demo",
        help="train a small model and write a plot",
        description=DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "name", nargs="?", default="digits", choices=list(DEMOS), metavar="NAME",
        help="which demo to run: " + " or ".join(DEMOS) + " (default: digits)",
    )  # fmt: skip
    for flag, help_text, options in DEMO_OPTIONS:
        demo.add_argument(flag, help=help_text, **options)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nnxscan``: parses ``argv`` (default: the command line), runs the demo.

    Example:
      >>> main(["demo", "hypernet", "--out", "/tmp/plots"])
      0
    """
    args = _parser().parse_args(argv)
    from nnxscan.adapters._extras import MissingExtraError

    try:
        _run_demo(args)
    except MissingExtraError as error:
        # What to install is the whole story: one line, no traceback.
        print(f"nnxscan: {error}", file=sys.stderr)
        return 1
    return 0


def _run_demo(args: argparse.Namespace) -> None:
    if not args.no_compile_cache:
        from nnxscan.shell import enable_compilation_cache

        enable_compilation_cache(args.compile_cache)
    if args.name == "digits":
        from nnxscan.shell.demos.digits import run_digits_demo

        run_digits_demo(args.out, seed=args.seed, progress=not args.no_progress)
    elif args.name == "hypernet-cl":
        from nnxscan.shell.demos.hypernet_cl import run_hypernet_cl_demo

        run_hypernet_cl_demo(args.out, seed=args.seed, progress=not args.no_progress)
    elif args.name == "lr-find":
        from nnxscan.shell.demos.lr_find import run_lr_find_demo

        run_lr_find_demo(args.out, steps=args.steps, seed=args.seed, progress=not args.no_progress)
    elif args.name == "ppo":
        from nnxscan.shell.demos.ppo_demo import parse_sweep, run_ppo_demo

        options: dict = {}
        if args.checkpoint_dir is not None:
            options["checkpoint_dir"] = args.checkpoint_dir
        if args.sweep is not None:
            options["sweep"] = dict([parse_sweep(args.sweep)])
        if options:
            options["progress"] = not args.no_progress
        run_ppo_demo(args.out, seeds=args.seeds, seed=args.seed, **options)
    elif args.name == "sweep":
        from nnxscan.shell.demos.sweep import run_sweep_demo

        run_sweep_demo(args.out, seed=args.seed, progress=not args.no_progress)
    else:
        from nnxscan.shell.demos.hypernet import run_hypernet_demo

        run_hypernet_demo(args.out, seed=args.seed, progress=not args.no_progress)


if __name__ == "__main__":
    raise SystemExit(main())
