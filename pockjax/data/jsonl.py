"""User data: JSON Lines in the Alpaca format or the chat format.

Each non-blank line is one JSON object, either Alpaca's::

    {"instruction": "Reverse the words.", "input": "the cat sat", "output": "sat cat the"}

(``input`` is optional: empty or missing, the instruction alone is the
prompt), or a conversation in the chat format of OpenAI, mlx-lm and TRL::

    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Reverse: the cat sat"},
                  {"role": "assistant", "content": "sat cat the"}]}

which ends with an assistant message after a user message: that last reply is
the answer (held out, and compared in exact match), the earlier turns are its
context. Every assistant reply is trained on, the earlier ones too
(:func:`pockjax.data.encode_turns`); the system and user turns are not.
After an optional first system message, the turns alternate user,
assistant, user, ..., none empty. The formats may mix in one file. Text is taken
as written (an answer's leading indentation, a trailing newline): nothing is
stripped. A bad line stops loading with an error that names the file and line
number.
"""

from __future__ import annotations

import json
import os

from pockjax.data.tasks import Example
from pockjax.errors import DataError, FileMissingError
from pockjax.io.atomic import atomic_open
from pockjax.io.jsonl import iter_jsonl

__all__ = ["DataError", "alpaca_prompt", "load_alpaca_jsonl", "save_alpaca_jsonl"]


def _has_surrogates(s: str) -> bool:
    # JSON's \ud800 escapes decode to lone surrogates that no tokenizer can encode
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The user message for an Alpaca record: the instruction, then the input if any.

    Example:
      >>> alpaca_prompt("Reverse the words.", "the cat sat")
      'Reverse the words.\\n\\nthe cat sat'
      >>> alpaca_prompt("Say hi.")
      'Say hi.'
    """
    return f"{instruction}\n\n{input}" if input and input.strip() else instruction


def load_alpaca_jsonl(path: str | os.PathLike) -> list[Example]:
    """Reads a JSONL file of Alpaca or chat records (see the module) into :class:`Example` objects.

    Args:
      path: The ``.jsonl`` file.

    Returns:
      One :class:`Example` per record (``task == "jsonl"``), in file order.

    Raises:
      DataError: missing file, no records, or a malformed line (binary data,
        not UTF-8, invalid JSON, not an object, missing/non-string
        ``instruction`` or ``output``, a non-string ``input``, a key whose
        text would be dropped (a misspelt ``input``, ``history``, ``system``),
        an empty instruction or answer, a chat record that does not end with a user
        message and the assistant's reply), with ``path:line`` in the message.

    Example:
      >>> import pathlib, tempfile
      >>> p = pathlib.Path(tempfile.mkdtemp(), "d.jsonl")
      >>> _ = p.write_text('{"instruction": "Add.", "input": "2 3", "output": "5"}\\n{"oops"\\n')
      >>> load_alpaca_jsonl(p)
      Traceback (most recent call last):
      ...
      pockjax.errors.DataError: ...d.jsonl:2: invalid JSON (...)
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}"
                        + (" (it is a directory)" if os.path.isdir(path) else ""))
    examples = []
    try:
        lines = list(iter_jsonl(path, error=DataError))
    except FileMissingError as e:  # removed between the check and the read
        raise DataError(str(e)) from None
    for lineno, record in lines:
        where = f"{path}:{lineno}"
        if isinstance(record, dict) and "messages" in record:
            examples.append(_chat_example(record, where))
            continue
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object with 'instruction' and"
                            f" 'output', got {type(record).__name__}")
        for key in ("instruction", "output"):
            if key not in record:
                raise DataError(f"{where}: missing {key!r} (keys: {sorted(record)})")
            if not isinstance(record[key], str):
                raise DataError(f"{where}: {key!r} must be a string,"
                                f" got {type(record[key]).__name__}")
        dropped = _dropped_text_keys(record)
        if dropped:  # a misspelt 'input', or history / system fields: their text would be left out
            raise DataError(f"{where}: {', '.join(map(repr, dropped))} would be left out of the prompt: an Alpaca"
                            f" record's text is 'instruction', 'input' and 'output' (other keys, such as 'id' or"
                            f" 'category', are ignored). Rename or remove it; a conversation goes in a chat"
                            f" record, {{\"messages\": [...]}}")
        inp = record.get("input", "")
        if inp is None:
            inp = ""
        if not isinstance(inp, str):
            raise DataError(f"{where}: 'input' must be a string, got {type(inp).__name__}")
        for key, value in (("instruction", record["instruction"]), ("input", inp),
                           ("output", record["output"])):
            if _has_surrogates(value):
                raise DataError(f"{where}: {key!r} holds an unpaired UTF-16 surrogate escape"
                                f" (\\ud800-\\udfff), which is not text")
        if not record["instruction"].strip():
            raise DataError(f"{where}: empty 'instruction'")
        if not record["output"].strip():
            raise DataError(f"{where}: empty 'output': the answer trained on would be only the end of the turn;"
                            f" fill it in or leave the record out")
        examples.append(Example(alpaca_prompt(record["instruction"], inp), record["output"], "jsonl", source=where))
    if not examples:
        raise DataError(f"{path} holds no records")
    return examples


_ALPACA_KEYS = ("instruction", "input", "output")
#: Keys other Alpaca-style formats put text in: pockjax would drop that text.
_TEXT_KEYS = frozenset({"history", "system", "system_prompt", "context", "conversation", "conversations",
                        "question", "prompt", "query", "passage", "document", "article"})


def _dropped_text_keys(record: dict) -> list[str]:
    """The keys of an Alpaca record whose text the prompt would leave out: a misspelt
    ``instruction`` / ``input`` / ``output`` (``inptu``, ``Input``) or a text field of
    another format (``history``, ``system``, ``question``, ``prompt``). Metadata (``id``,
    ``category``, and ``text``: the whole record formatted, in the Stanford Alpaca release) passes."""
    import difflib

    return sorted(k for k in record if k not in _ALPACA_KEYS and (
        k.lower() in _TEXT_KEYS or difflib.get_close_matches(k.lower(), _ALPACA_KEYS, n=1, cutoff=0.8)))


_ROLES = ("system", "user", "assistant")


def _a(role: str) -> str:
    return f"an {role}" if role == "assistant" else f"a {role}"


def _chat_example(record: dict, where: str) -> Example:
    """One ``{"messages": [...]}`` record as an :class:`Example` (its last reply is the answer)."""
    extra = sorted(set(record) - {"messages"})
    if extra:
        raise DataError(f"{where}: a chat record holds only 'messages', not {extra}")
    msgs = record["messages"]
    if not isinstance(msgs, list) or len(msgs) < 2:
        raise DataError(f"{where}: 'messages' must be a list of at least a user and an assistant message")
    turns = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] must be an object with a 'role' and a string 'content'")
        if m.get("role") not in _ROLES:
            raise DataError(f"{where}: messages[{i}] has role {m.get('role')!r}; roles are {', '.join(_ROLES)}")
        if _has_surrogates(m["content"]):
            raise DataError(f"{where}: messages[{i}] holds an unpaired UTF-16 surrogate escape, which is not text")
        if m["role"] == "system" and i:
            raise DataError(f"{where}: messages[{i}]: a system message may only come first")
        if m["role"] == "system" and not m["content"].strip():
            raise DataError(f"{where}: messages[0] (system) is empty: it would render as a bare system turn in"
                            f" place of the template's default; fill it in, or leave it out for the default")
        if m["role"] != "system":  # user, assistant, user, ...: what every chat template renders
            want = "user" if sum(r != "system" for r, _ in turns) % 2 == 0 else "assistant"
            if m["role"] != want:
                raise DataError(f"{where}: messages[{i}] is {_a(m['role'])} message where {_a(want)} message is"
                                f" due: after an optional system message the turns alternate user, assistant,"
                                f" user, ... (merge two turns of one role into one)")
            if not m["content"].strip() and i < len(msgs) - 2:
                raise DataError(f"{where}: messages[{i}] ({m['role']}) is empty: an empty turn of the context"
                                f" renders as a bare turn marker; fill it in or leave the record out")
        turns.append((m["role"], m["content"]))
    if turns[-1][0] != "assistant" or turns[-2][0] != "user":
        raise DataError(f"{where}: a chat record ends with a user message and the assistant's reply"
                        f" (the answer trained on); this one ends with {turns[-2][0]}, {turns[-1][0]}")
    if not turns[-2][1].strip():
        raise DataError(f"{where}: the last user message is empty")
    if not turns[-1][1].strip():
        raise DataError(f"{where}: the last assistant message (the answer trained on) is empty: it would train"
                        f" only the end of the turn; fill it in or leave the record out")
    return Example(turns[-2][1], turns[-1][1], "jsonl", tuple(turns[:-2]), source=where)


def save_alpaca_jsonl(path: str | os.PathLike, examples, instruction: str | None = None) -> None:
    """Writes examples as Alpaca JSONL (the prompt becomes ``instruction``); an example with
    earlier turns as a chat record, so that :func:`load_alpaca_jsonl` reads back every example.

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
      [Example(prompt='Say hi.', answer='hi', task='jsonl', context=())]
    """
    with atomic_open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            if ex.context:  # a conversation: a chat record, its earlier turns kept
                if instruction is not None:
                    raise DataError("save_alpaca_jsonl: instruction= applies to single-turn examples; a chat"
                                    " example (with earlier turns) is written as a chat record")
                rec = {"messages": ex.messages(with_answer=True)}
            elif instruction is None:
                rec = {"instruction": ex.prompt, "input": "", "output": ex.answer}
            else:
                rec = {"instruction": instruction, "input": ex.prompt, "output": ex.answer}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
