"""User data: JSON Lines in the Alpaca format (``instruction``, ``input``, ``output``).

Each non-blank line is one JSON object::

    {"instruction": "Reverse the words.", "input": "the cat sat", "output": "sat cat the"}

``input`` is optional (empty or missing: the instruction alone is the prompt).
A bad line stops loading with an error that names the file and line number.
"""

from __future__ import annotations

from pockjax.errors import PockjaxError
import json
import os

from pockjax.data.tasks import Example

__all__ = ["DataError", "alpaca_prompt", "load_alpaca_jsonl", "save_alpaca_jsonl"]


class DataError(PockjaxError, ValueError):
    """A data file is missing, empty, or has a malformed line."""


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The user message for an Alpaca record: the instruction, then the input if any.

    Example:
      >>> alpaca_prompt("Reverse the words.", "the cat sat")
      'Reverse the words.\\n\\nthe cat sat'
      >>> alpaca_prompt("Say hi.")
      'Say hi.'
    """
    instruction, input = instruction.strip(), (input or "").strip()
    return f"{instruction}\n\n{input}" if input else instruction


def load_alpaca_jsonl(path: str | os.PathLike) -> list[Example]:
    """Reads an Alpaca-format JSONL file into :class:`Example` objects.

    Args:
      path: The ``.jsonl`` file.

    Returns:
      One :class:`Example` per record (``task == "jsonl"``), in file order.

    Raises:
      DataError: missing file, no records, or a malformed line (invalid JSON,
        not an object, missing/non-string ``instruction`` or ``output``, or a
        non-string ``input``), with ``path:line`` in the message.

    Example:
      >>> import tempfile, os
      >>> p = os.path.join(tempfile.mkdtemp(), "d.jsonl")
      >>> _ = open(p, "w").write('{"instruction": "Add.", "input": "2 3", "output": "5"}\\n{"oops"\\n')
      >>> load_alpaca_jsonl(p)
      Traceback (most recent call last):
      ...
      pockjax.data.jsonl.DataError: ...d.jsonl:2: invalid JSON (...)
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}")
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object with 'instruction' and"
                                f" 'output', got {type(record).__name__}")
            for key in ("instruction", "output"):
                if key not in record:
                    raise DataError(f"{where}: missing {key!r} (keys: {sorted(record)})")
                if not isinstance(record[key], str):
                    raise DataError(f"{where}: {key!r} must be a string,"
                                    f" got {type(record[key]).__name__}")
            inp = record.get("input", "")
            if inp is None:
                inp = ""
            if not isinstance(inp, str):
                raise DataError(f"{where}: 'input' must be a string, got {type(inp).__name__}")
            if not record["instruction"].strip():
                raise DataError(f"{where}: empty 'instruction'")
            examples.append(Example(alpaca_prompt(record["instruction"], inp),
                                    record["output"].strip(), "jsonl"))
    if not examples:
        raise DataError(f"{path} holds no records")
    return examples


def save_alpaca_jsonl(path: str | os.PathLike, examples, instruction: str | None = None) -> None:
    """Writes examples as Alpaca JSONL (the prompt becomes ``instruction``).

    Args:
      path: Output file (written atomically).
      examples: :class:`Example` objects.
      instruction: If given, used as every record's ``instruction`` with the
        prompt as ``input``.

    Example:
      >>> import tempfile, os
      >>> p = os.path.join(tempfile.mkdtemp(), "d.jsonl")
      >>> save_alpaca_jsonl(p, [Example("Say hi.", "hi")])
      >>> load_alpaca_jsonl(p)
      [Example(prompt='Say hi.', answer='hi', task='jsonl')]
    """
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for ex in examples:
            if instruction is None:
                rec = {"instruction": ex.prompt, "input": "", "output": ex.answer}
            else:
                rec = {"instruction": instruction, "input": ex.prompt, "output": ex.answer}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
