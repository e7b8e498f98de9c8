"""Benchmarks: `make bench` (python -m launcher.bench) on this machine's CPU, and
`python -m launcher.bench.gpu` for one GPU. See each module's docstring."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from launcher.cli import fail


def parser(prog: str, doc: str, overrides_help: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring as help, config overrides, --json."""
    p = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument("--json", help="also write the figures to this file")
    return p


def refusing_bad_config(run: Callable, *args):
    """run(*args); a config the planner or Hydra refuses ends the command with its message and
    exit status 2, as launcher.train does, instead of a traceback."""
    from hydra.errors import HydraException

    try:
        return run(*args)
    except (ValueError, HydraException) as e:
        fail(str(e))
