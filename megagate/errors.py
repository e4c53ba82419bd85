"""The project's user-facing error type.

Expected mistakes (bad configuration, bad input files) raise `MegagateError` with a one-line message that names the
offending value and what is allowed; the CLI prints it without a traceback and exits non-zero.
"""


class MegagateError(Exception):
    """A user error: bad configuration, bad input, unsupported environment."""


class ConfigError(MegagateError):
    """An invalid configuration value or combination of values."""


def require(condition: bool, message: str, error: type[MegagateError] = ConfigError) -> None:
    """Raise `error(message)` unless `condition` holds (for user input; never a bare assert)."""
    if not condition:
        raise error(message)
