"""File formats: one validated reader per format, and durable atomic writes.

- :mod:`pockjax.io.atomic`: every output goes to a temporary sibling, is
  fsynced and renamed; stale temporaries of killed runs are removed.
- :mod:`pockjax.io.gguf`, :mod:`pockjax.io.safetensors`,
  :mod:`pockjax.io.tokenizer_json`, :mod:`pockjax.io.jsonl`,
  :mod:`pockjax.io.jsonfile`: readers that check every field before use and
  raise a :class:`~pockjax.errors.FileFormatError` subclass naming the file
  and the fault. No reader executes anything from a file (no pickle).
- :mod:`pockjax.io.tfevents`: TensorBoard event files of scalars (``pockjax
  finetune``'s ``tb/``), written and read without TensorFlow.
"""

from pockjax.io.atomic import (
    atomic_directory,
    atomic_open,
    remove_stale_temporaries,
    write_bytes,
    write_json,
    write_text,
)
from pockjax.io.gguf import GGUFFile, GGUFTensor, open_gguf
from pockjax.io.jsonfile import read_json, read_json_object
from pockjax.io.jsonl import iter_jsonl
from pockjax.io.safetensors import read_safetensors, write_safetensors

__all__ = [
    "GGUFFile",
    "GGUFTensor",
    "atomic_directory",
    "atomic_open",
    "iter_jsonl",
    "open_gguf",
    "read_json",
    "read_json_object",
    "read_safetensors",
    "remove_stale_temporaries",
    "write_bytes",
    "write_json",
    "write_safetensors",
    "write_text",
]
