"""A benchmark's counts or sizes, each an option whose default --quick makes smaller for the
ones not given (importable from each benchmark: they run from this folder)."""

from __future__ import annotations

import argparse


def add_counts(p: argparse.ArgumentParser, texts: dict[str, str], full: dict[str, int],
               quick: dict[str, int], what: str) -> None:
    """--<name> for each of `texts`, and --quick (`what`: "counts", "sizes")."""
    for name, text in texts.items():
        p.add_argument(f"--{name}", type=int,
                       help=f"{text}; default {full[name]}, with --quick {quick[name]}")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: smaller {what} for those not given")


def fill_counts(args: argparse.Namespace, full: dict[str, int],
                quick: dict[str, int]) -> None:
    """The counts not given: --quick's, or the full ones."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
