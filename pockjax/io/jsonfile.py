"""Validated reading of JSON files (configs, run records, tokenizer settings).

Example:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "config.json")
    >>> _ = open(p, "w").write("[1, 2]")
    >>> read_json_object(p)
    Traceback (most recent call last):
    ...
    pockjax.errors.FileFormatError: ...config.json: expected a JSON object, got a list
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any

from pockjax.errors import FileFormatError, FileMissingError

__all__ = ["loads_checked", "read_json", "read_json_object", "reject_constant"]

_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


def reject_constant(name: str) -> Any:
    """``parse_constant`` hook for :func:`json.loads`: NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list) -> dict:
    """A JSON object's dict; a key given twice (where ``json`` keeps the last silently) is an error."""
    out = dict(pairs)
    if len(out) != len(pairs):
        twice = [k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1]
        raise ValueError(f"key {', '.join(map(repr, twice))} given twice in one object")
    return out


def loads_checked(text: str, where: str, error: type[FileFormatError] = FileFormatError, *,
                  line_numbers: bool = True) -> Any:
    """:func:`json.loads` without NaN/Infinity; any fault raises ``error`` naming ``where``.

    Args:
        text: The JSON text.
        where: The place named in messages (a path, or ``path:line``).
        error: The :class:`~pockjax.errors.FileFormatError` subclass to raise.
        line_numbers: Append the line of a syntax error to ``where`` (off
            when ``where`` already names the one line).

    Example:
        >>> loads_checked('{"a": NaN}', "x.json")
        Traceback (most recent call last):
        ...
        pockjax.errors.FileFormatError: x.json: invalid JSON (NaN is not valid JSON)
        >>> loads_checked('{"a": 1, "a": 2}', "x.json")
        Traceback (most recent call last):
        ...
        pockjax.errors.FileFormatError: x.json: invalid JSON (key 'a' given twice in one object)
    """
    try:
        return json.loads(text, parse_constant=reject_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        at = f"{where}:{e.lineno}" if line_numbers else where
        raise error(f"{at}: invalid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:
        raise error(f"{where}: invalid JSON ({e})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None


def read_json(path: str | os.PathLike, *, error: type[FileFormatError] = FileFormatError,
              what: str = "JSON file") -> Any:
    """Parses a UTF-8 JSON file; any fault raises ``error`` naming the file.

    Args:
        path: The file.
        error: The :class:`~pockjax.errors.FileFormatError` subclass to raise.
        what: How to call the file in the "not found" message.

    Raises:
        FileMissingError: no such file.
        error: not UTF-8, not JSON, or NaN/Infinity in it.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileMissingError(f"{what} not found: {path}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start});"
                    f" is it a binary file?") from None
    return loads_checked(text, path, error)


def read_json_object(path: str | os.PathLike, *,
                     error: type[FileFormatError] = FileFormatError,
                     what: str = "JSON file") -> dict[str, Any]:
    """:func:`read_json` for a file that must hold one JSON object."""
    value = read_json(path, error=error, what=what)
    if not isinstance(value, dict):
        raise error(f"{os.fspath(path)}: expected a JSON object, got"
                    f" {_TYPE_NAMES.get(type(value), type(value).__name__)}")
    return value
