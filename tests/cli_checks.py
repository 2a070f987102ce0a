"""What a user's mistake on the command line must look like: click's one ``Error:`` line, exit code != 0, no
traceback, saying every needle."""
from click.testing import CliRunner


def fails(args, *needles, group=None):
    """Run the command; it must exit non-zero through click (no other exception), say every needle, once."""
    if group is None:
        from zoo.cli import cli as group
    res = CliRunner().invoke(group, args)
    assert res.exit_code != 0, res.output
    assert isinstance(res.exception, SystemExit), repr(res.exception)  # click's own exit, not a crash
    assert "Traceback" not in res.output and res.output.count("Error:") == 1, res.output
    for needle in needles:
        assert needle in res.output, res.output
    return res.output
