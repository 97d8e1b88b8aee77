"""This project's rewards and data inside other trainers (trl.py, verl.py). Their packages (TRL,
verl, transformers, peft, datasets) are the user's, never this project's requirements: each is
imported lazily through `require`, and an entry point wrapped in `exits_if_missing` ends a missing
one with one line and exit 2."""

from __future__ import annotations

import functools
import importlib
import sys


class MissingPackage(ImportError):
    """A package this folder imports lazily did not import; the message is one line."""


def require(package: str):
    """The module `package`, imported; MissingPackage naming it, its install and the reason if it
    does not import."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise MissingPackage(
            f"this needs the {package} package (pip install {package}): {e}"
        ) from None


def exits_if_missing(main):
    """`main(argv)` with a MissingPackage ended as one line on stderr and exit 2."""

    @functools.wraps(main)
    def run(argv=None):
        try:
            return main(argv)
        except MissingPackage as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    return run
