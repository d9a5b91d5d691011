"""The CLI's one error type for bad arguments, shared by its command modules."""


class UsageError(ValueError):
    """A user-facing error: printed as one line, exit status 2."""
