"""The ``stepwatch`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepwatch", description="Watch and steer PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"stepwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small digits classifier with the built-in monitors")
    demo.add_argument("--epochs", type=_positive_int, default=20, help="epochs (default 20)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    demo.add_argument(
        "--checkpoint-dir", default="checkpoints", help="where the best model is saved"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        from .demo import run_demo

        run_demo(
            epochs=args.epochs,
            seed=args.seed,
            device=args.device,
            checkpoint_dir=args.checkpoint_dir,
        )
        return 0
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
