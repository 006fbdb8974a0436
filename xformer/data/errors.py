"""Errors in the user's data: missing, incomplete, invalid or out of reach.

Their messages say what is wrong, where, and how to fix it, so the entry scripts print them as
one line; any other exception keeps its traceback. Each also derives from the built-in error
it replaces, so ``except ValueError`` / ``FileNotFoundError`` / ``RuntimeError`` still catch it.
"""


class DataError(Exception):
    """Base of the errors below; the entry scripts catch this."""


class DataValueError(DataError, ValueError):
    """Content that cannot be used: invalid UTF-8, parallel files of different lengths, a
    download that differs from upstream, a stale cache, an unknown split."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """Files that should be there are not: an incomplete local copy, a workdir's tokenizer."""


class DataDownloadError(DataError, RuntimeError):
    """No local copy, and the official download failed or its host is unreachable."""
