"""The ``pockjax`` command line.

Each subcommand lives beside the code it drives and registers itself through
a module-level ``register(subparsers)`` function; this file only lists those
modules, so adding a command never edits another command's code.

Every :class:`~pockjax.errors.PockjaxError` (bad input: a missing or corrupt
file, a malformed scheme, ...) becomes one line on stderr,
``pockjax: error: ...``, and exit status 2, like an argparse usage error. Any
other exception propagates with its traceback: it is a bug in pockjax.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pockjax.errors import PockjaxError

# module -> what it provides (imported lazily: `pockjax --help` stays fast)
COMMAND_MODULES = (
    "pockjax.train.cli",     # finetune, generate
    "pockjax.memory.cli",    # memory, plan
    "pockjax.train.export_cli",  # export
    "pockjax.search.cli",    # search
)

# Commands whose code lives in the source checkout, outside the package:
# command -> module, imported with the checkout's root on sys.path. Where the
# package is installed without its checkout, the command says so in one line.
CHECKOUT_COMMANDS = {
    "bench": "benchmarks.harness.cli",  # pockjax against PyTorch (+ PEFT) and plain JAX
}


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is one ``--help`` away), exit status 2.

    ``add_subparsers`` makes every command's parser of this class too.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    for command, name in CHECKOUT_COMMANDS.items():
        module = _checkout_module(name)
        if module is None:
            _register_absent(sub, command, name)
        else:
            module.register(sub)
    return parser


def _checkout_module(name: str):
    """``name`` imported from the source checkout this package is in, or None outside one."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, *name.split(".")) + ".py"):
        return None
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(name)


def _register_absent(sub, command: str, name: str) -> None:
    folder = "/".join(name.split(".")[:-1]) + "/"
    # no option prefix: every argument (--help included) reaches the one-line answer
    p = sub.add_parser(command, help="(runs from a source checkout of pockjax)", add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs="*")

    def absent(args) -> int:
        print(f"pockjax {command}: runs from a source checkout of pockjax ({folder} is not"
              " installed with the package); run it in a clone of the repository", file=sys.stderr)
        return 2

    p.set_defaults(func=absent)


def error_line(error: PockjaxError) -> str:
    """The one line the command line prints for a :class:`PockjaxError`.

    Multi-line messages (an install hint, a list of close matches) are joined
    with ``"; "`` so the error stays one line.

    Example:
        >>> from pockjax.errors import FileMissingError
        >>> error_line(FileMissingError("model path ./out does not exist"))
        'pockjax: error: model path ./out does not exist'
    """
    message = str(error).strip() or type(error).__name__
    message = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    return f"pockjax: error: {message}"


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 for bad input, see :func:`error_line`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PockjaxError as e:
        sys.stdout.flush()
        print(error_line(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
