"""The data pipeline's one user-facing error (exit code 3 on the command line)."""

import pyarrow as pa

# What reading a data file raises when it is not what it claims past the start that
# `file_check` reads (undecodable, unparseable, truncated) or cannot be read at all: reported as
# a DataError where the files are opened and where rows are read.
READ_ERRORS = (UnicodeError, EOFError, OSError, pa.ArrowException)


class DataError(ValueError):
    """Data the run cannot use (no usable documents, unreadable or unsupported files, an unopenable
    hub dataset), found before or while reading; the message names the setting to check."""
