"""What every ``moe-zoo`` command shares, built-in or a plugin's: a user's mistake as one line, and click
callbacks that check an output folder or file before any work starts."""
from __future__ import annotations

import os
from contextlib import contextmanager

import click

from zoo.components.options import parse_step

THREADS = click.IntRange(1, os.cpu_count())  # torch threads: at least one, at most the machine's CPUs
SEED = click.IntRange(0, 2**32 - 1)
COUNT = click.IntRange(min=1)

# A user's mistake: KeyError (an unknown name), ValueError (a bad value, NotExportable and CheckpointError
# included), TypeError (a model of the wrong kind), OSError (a missing file or folder, an unreachable Hub).
USER_ERRORS = (KeyError, ValueError, TypeError, OSError)


def message(exc: BaseException) -> str:
    """The text of an exception; a KeyError's own message, not its repr in quotes."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc) or type(exc).__name__


@contextmanager
def one_line(prefix: str = ""):
    """``with one_line(): library call``: a user's mistake (``USER_ERRORS``) becomes click's one-line
    ``Error: ...`` (exit code 1) instead of a traceback."""
    try:
        yield
    except USER_ERRORS as exc:
        raise click.ClickException(prefix + message(exc)) from None


def step_option(step: str, param_hint: str | None = None) -> tuple[str, dict]:
    """``zoo.components.options.parse_step`` for a command-line value: a malformed step is click's usage error."""
    try:
        return parse_step(step)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=param_hint) from None


def save_folder(ctx, param, value):
    """A click callback: ``value`` must be a folder a save can write into (zoo.io.atomic's rules), checked before
    any work (not a file, not '.', not '/')."""
    from zoo.io.atomic import check_target

    if value is not None:
        try:
            check_target(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None
    return value


def new_file(ctx, param, value):
    """A click callback for an output file: its folder must exist and nothing may be at its name (the zoo never
    replaces a file it was not asked to), checked before any work."""
    from zoo.io.atomic import check_new_file

    if value is not None:
        try:
            check_new_file(value)
        except (OSError, ValueError) as exc:
            raise click.BadParameter(str(exc), ctx, param) from None
    return value


def calibration_spec(ctx, param, value):
    """--calibration DOMAIN[:TOKENS] as a ``zoo.editing.calibration.corpus`` spec."""
    from zoo.editing.calibration import corpus

    if value is None:
        return None
    domain, _, tokens = value.partition(":")
    try:
        count = int(tokens or 8192)
    except ValueError:
        count = 0
    if count < 1:
        raise click.BadParameter(f"{value!r}: TOKENS must be a whole number >= 1 (e.g. mixed:8192)", ctx, param)
    try:
        return corpus(domain, tokens=count)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
