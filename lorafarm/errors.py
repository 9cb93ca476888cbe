"""Errors shared by every lorafarm command."""


class CliError(Exception):
    """A user-facing failure: the CLI prints it as one line and exits with status 2."""
