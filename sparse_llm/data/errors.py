"""The data pipeline's one user-facing error (exit code 3 on the command line)."""


class DataError(ValueError):
    """Data the run cannot use (no usable documents, unreadable or unsupported files, an unopenable
    hub dataset), found before or while reading; the message names the setting to check."""
