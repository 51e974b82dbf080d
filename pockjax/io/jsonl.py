"""A validated reader of JSON Lines files: one JSON value per non-blank line.

A binary file, a line that is not UTF-8 or not JSON raises the given
:class:`~pockjax.errors.FileFormatError` subclass with ``path:line`` in the
message.

Example:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "d.jsonl")
    >>> _ = open(p, "wb").write(b'{"a": 1}\\n\\n[2]\\n')
    >>> list(iter_jsonl(p))
    [(1, {'a': 1}), (3, [2])]
    >>> _ = open(p, "wb").write(b'{"a": 1}\\n\\x89PNG\\x00\\x00\\n')
    >>> list(iter_jsonl(p))
    Traceback (most recent call last):
    ...
    pockjax.errors.FileFormatError: ...d.jsonl:2: binary data (a NUL byte at column 5); expected JSON Lines text
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from pockjax.errors import FileFormatError, FileMissingError
from pockjax.io.jsonfile import loads_checked

__all__ = ["iter_jsonl"]


def iter_jsonl(path: str | os.PathLike, *, error: type[FileFormatError] = FileFormatError
               ) -> Iterator[tuple[int, Any]]:
    """Yields ``(line number, value)`` for each non-blank line of a JSON Lines file.

    Args:
        path: The file.
        error: The :class:`~pockjax.errors.FileFormatError` subclass to raise.

    Raises:
        FileMissingError: no such file (or a directory).
        error: binary data, a line that is not UTF-8, invalid JSON or
            NaN/Infinity, with ``path:line``.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileMissingError(f"data file not found: {path}"
                               + (" (it is a directory)" if os.path.isdir(path) else ""))
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if lineno == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):  # (Windows PowerShell 5's '>' writes it)
                raise error(f"{where}: the file is UTF-16 text (it starts with a UTF-16 byte-order mark);"
                            f" JSON Lines is UTF-8: save it as UTF-8")
            nul = raw.find(b"\x00")
            if nul >= 0:
                raise error(f"{where}: binary data (a NUL byte at column {nul + 1});"
                            f" expected JSON Lines text")
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column"
                            f" {e.start + 1}); is it a binary file?") from None
            if not line.strip():
                continue
            yield lineno, loads_checked(line, where, error, line_numbers=False)
