"""The one error type meant for people: the CLI prints it as `qkv: error: ...` and exits 2."""


class QkvError(Exception):
    """Bad input: a file, a config value or an option a person can fix. Never a bug."""
