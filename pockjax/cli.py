"""The ``pockjax`` command line.

Each subcommand lives beside the code it drives and registers itself through
a module-level ``register(subparsers)`` function; this file only lists those
modules, so adding a command never edits another command's code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module -> what it provides (imported lazily: `pockjax --help` stays fast)
COMMAND_MODULES = (
    "pockjax.train.cli",     # finetune, generate
    "pockjax.memory.cli",    # memory, plan
    "pockjax.backends.cli",  # export
    "pockjax.bench.cli",     # bench
    "pockjax.search.cli",    # search
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pockjax", description="Sparse, compile-first fine-tuning in JAX (PockEngine for JAX)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # an optional command whose module (or package) is absent; a
            # missing dependency inside it is a real error
            if not (e.name and (name == e.name or name.startswith(e.name + "."))):
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
