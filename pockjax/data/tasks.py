"""Small verifiable tasks, generated deterministically from a seed.

Each task turns a ``numpy.random.Generator`` into an :class:`Example` (a user
prompt and its one right answer) and judges a model's answer by exact match
after a light, task-specific normalisation. They ship with the package (word
lists are in this file), so fine-tuning runs need no data download.

Tasks (see :data:`TASKS`):

* ``reverse_words``: reverse the order of the words of a sentence (the
  PockEngine paper's example).
* ``sort_numbers``: sort a list of integers in ascending order.
* ``add``: add two integers.
* ``uppercase``: rewrite a phrase in upper case.

Example:
  >>> train, held_out = train_eval_split("reverse_words", n_train=3, n_eval=2, seed=0)
  >>> ex = held_out[0]
  >>> ex.prompt.startswith("Reverse the order of the words")
  True
  >>> get_task("reverse_words").is_correct(ex.answer + ".", ex)
  True
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable, Iterable, Sequence

import numpy as np

from pockjax.errors import UnknownTaskError

__all__ = [
    "Example",
    "TASKS",
    "Task",
    "evaluate",
    "evaluate_model",
    "exact_match",
    "get_task",
    "make_examples",
    "normalize_answer",
    "train_eval_split",
]


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    Attributes:
      prompt: The user message.
      answer: The exact expected assistant reply.
      task: Name of the task that made it (``"jsonl"`` for user data).

    Example:
      >>> Example("Sort: 3, 1", "1, 3", "sort_numbers").answer
      '1, 3'
    """

    prompt: str
    answer: str
    task: str = ""
    #: Earlier turns of a conversation, ``((role, content), ...)``: context; its assistant
    #: replies are trained too (:func:`pockjax.data.encode_turns`).
    context: tuple = ()
    #: Where it was read (``path:line``), named by errors about it; not part of its value.
    source: str = dataclasses.field(default="", compare=False, repr=False)

    def messages(self, system: str | None = None, with_answer: bool = False) -> list[dict]:
        """The example as chat messages.

        Args:
          system: Optional system message (``None``: the template's default).
          with_answer: Append the answer as the assistant message.

        Example:
          >>> Example("Hi?", "Hello.").messages(with_answer=True)[-1]
          {'role': 'assistant', 'content': 'Hello.'}
        """
        has_system = any(role == "system" for role, _ in self.context)
        msgs = [] if system is None or has_system else [{"role": "system", "content": system}]
        msgs += [{"role": role, "content": content} for role, content in self.context]
        msgs.append({"role": "user", "content": self.prompt})
        if with_answer:
            msgs.append({"role": "assistant", "content": self.answer})
        return msgs


def normalize_answer(text: str, *, case: bool = True, strip_period: bool = True) -> str:
    """Whitespace-collapsed, stripped text, optionally lower-cased and without a final period.

    Args:
      text: A model answer or a reference answer.
      case: Keep case (True) or lower-case (False).
      strip_period: Drop one trailing ``.`` (models like to end with one).

    Example:
      >>> normalize_answer("  mat the  on.\\n", case=False)
      'mat the on'
    """
    text = " ".join(text.split())
    text = text.strip().strip("\"'`").strip()
    if strip_period and text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    return text if case else text.lower()


def exact_match(prediction: str, answer: str, *, case: bool = True) -> bool:
    """Whether a prediction equals the answer after :func:`normalize_answer`.

    Example:
      >>> exact_match(" 7, 19, 42. ", "7, 19, 42")
      True
      >>> exact_match("7, 42, 19", "7, 19, 42")
      False
    """
    return normalize_answer(prediction, case=case) == normalize_answer(answer, case=case)


@dataclasses.dataclass(frozen=True)
class Task:
    """A named generator of examples and its exact-match judge.

    Attributes:
      name: Registry name.
      description: One line for help texts.
      generate: ``rng -> (prompt, answer)``.
      case_sensitive: Whether letter case matters when judging.

    Example:
      >>> echo = Task("echo", "repeat a word", lambda rng: ("Say: hi", "hi"))
      >>> echo.is_correct("hi.", echo.example(np.random.default_rng(0)))
      True
    """

    name: str
    description: str
    generate: Callable[[np.random.Generator], tuple[str, str]]
    case_sensitive: bool = True

    def example(self, rng: np.random.Generator) -> Example:
        """One example drawn from ``rng``.

        Example:
          >>> get_task("add").example(np.random.default_rng(0)).task
          'add'
        """
        prompt, answer = self.generate(rng)
        return Example(prompt, answer, self.name)

    def is_correct(self, prediction: str, example: Example) -> bool:
        """Exact match of ``prediction`` against ``example.answer`` (see :func:`exact_match`).

        Example:
          >>> ex = Example("Reverse ...: a b", "b a", "reverse_words")
          >>> get_task("reverse_words").is_correct("B a.", ex)
          True
        """
        return exact_match(prediction, example.answer, case=self.case_sensitive)


# -- word lists -----------------------------------------------------------------------

_DETERMINERS = ["the", "a", "my", "your", "our", "this", "that", "every", "one", "her", "his"]
_ADJECTIVES = [
    "red", "blue", "green", "small", "big", "old", "young", "happy", "quiet", "loud", "fast",
    "slow", "bright", "dark", "warm", "cold", "tall", "short", "brave", "calm", "clever",
    "gentle", "busy", "lazy", "sleepy", "hungry", "shiny", "soft", "tiny", "huge", "wise",
    "funny", "strange", "golden", "silver", "wooden", "curious", "lucky", "proud", "kind",
]
_NOUNS = [
    "cat", "dog", "bird", "fish", "horse", "mouse", "rabbit", "fox", "bear", "lion", "tiger",
    "child", "teacher", "farmer", "doctor", "artist", "sailor", "king", "queen", "baker",
    "river", "mountain", "forest", "garden", "house", "village", "city", "bridge", "road",
    "boat", "train", "car", "book", "song", "letter", "window", "door", "table", "chair",
    "lamp", "apple", "bread", "cake", "flower", "tree", "stone", "cloud", "star", "moon",
    "sun", "robot", "computer", "phone", "camera", "guitar", "piano", "ball", "kite",
]
_VERBS = [
    "sees", "finds", "likes", "paints", "follows", "watches", "carries", "builds", "opens",
    "closes", "visits", "draws", "chases", "helps", "loves", "reads", "writes", "moves",
    "holds", "pushes", "pulls", "cleans", "fixes", "sells", "buys", "meets", "calls",
    "remembers", "forgets", "answers",
]
_INTRANSITIVE = ["sleeps", "runs", "sings", "waits", "dances", "laughs", "jumps", "swims",
                 "smiles", "rests", "walks", "shines"]
_PREPOSITIONS = ["near", "under", "behind", "beside", "above", "inside", "across", "around",
                 "past", "toward"]
_ADVERBS = ["today", "again", "slowly", "quickly", "quietly", "happily", "outside", "early",
            "late", "often"]


def _pick(rng: np.random.Generator, words: Sequence[str]) -> str:
    return words[int(rng.integers(len(words)))]


def _noun_phrase(rng: np.random.Generator) -> list[str]:
    words = [_pick(rng, _DETERMINERS)]
    if rng.random() < 0.5:
        words.append(_pick(rng, _ADJECTIVES))
    words.append(_pick(rng, _NOUNS))
    return words


def _sentence(rng: np.random.Generator) -> list[str]:
    """A simple English sentence of 3 to 10 lower-case words, without punctuation."""
    words = _noun_phrase(rng)
    shape = int(rng.integers(3))
    if shape == 0:
        words += [_pick(rng, _VERBS)] + _noun_phrase(rng)
    elif shape == 1:
        words += [_pick(rng, _INTRANSITIVE), _pick(rng, _PREPOSITIONS)] + _noun_phrase(rng)
    else:
        words += [_pick(rng, _INTRANSITIVE)]
    if rng.random() < 0.3:
        words.append(_pick(rng, _ADVERBS))
    return words


# -- the tasks ------------------------------------------------------------------------


def _reverse_words(rng):
    words = _sentence(rng)
    return (f"Reverse the order of the words in this sentence: {' '.join(words)}",
            " ".join(reversed(words)))


def _sort_numbers(rng):
    n = int(rng.integers(4, 8))
    nums = [int(x) for x in rng.integers(0, 100, n)]
    return (f"Sort these numbers in ascending order: {', '.join(map(str, nums))}",
            ", ".join(map(str, sorted(nums))))


def _add(rng):
    a, b = (int(x) for x in rng.integers(10, 1000, 2))
    return f"What is {a} + {b}? Answer with the number only.", str(a + b)


def _uppercase(rng):
    words = _noun_phrase(rng) + [_pick(rng, _INTRANSITIVE)]
    phrase = " ".join(words)
    return f"Rewrite in upper case: {phrase}", phrase.upper()


TASKS: dict[str, Task] = {
    t.name: t for t in [
        Task("reverse_words", "reverse the order of the words in a sentence", _reverse_words,
             case_sensitive=False),
        Task("sort_numbers", "sort 4-7 integers (0-99) in ascending order", _sort_numbers),
        Task("add", "add two integers between 10 and 999", _add),
        Task("uppercase", "rewrite a short phrase in upper case", _uppercase),
    ]
}


def get_task(name: str | Task) -> Task:
    """The :class:`Task` called ``name`` (a :class:`Task` is returned as is).

    Raises:
      KeyError: unknown name (the message lists the known tasks).

    Example:
      >>> get_task("sort_numbers").description
      'sort 4-7 integers (0-99) in ascending order'
    """
    if isinstance(name, Task):
        return name
    key = name.replace("-", "_")
    if key not in TASKS:
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[key]


def _rng(seed: int, stream: str) -> np.random.Generator:
    # Independent, reproducible streams per (seed, split) without Python's salted hash.
    return np.random.default_rng([int(seed), zlib.crc32(stream.encode())])


def make_examples(task: str | Task, n: int, seed: int = 0, split: str = "train",
                  exclude: Iterable[str] = ()) -> list[Example]:
    """``n`` distinct examples of a task, the same for the same arguments.

    Args:
      task: A task name (see :data:`TASKS`) or :class:`Task`.
      n: Number of examples.
      seed: Seed; each ``split`` name draws from its own stream.
      split: Stream name, e.g. ``"train"`` or ``"eval"``.
      exclude: Prompts that must not appear (e.g. the held-out set's).

    Raises:
      ValueError: if the task cannot produce ``n`` distinct examples.

    Example:
      >>> a = make_examples("add", 2, seed=1)
      >>> a == make_examples("add", 2, seed=1), a == make_examples("add", 2, seed=2)
      (True, False)
    """
    t = get_task(task)
    rng = _rng(seed, f"{t.name}/{split}")
    seen = set(exclude)
    out: list[Example] = []
    tries = 0
    while len(out) < n:
        ex = t.example(rng)
        tries += 1
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
        elif tries > 20 * n + 1000:
            raise ValueError(f"task {t.name!r} cannot produce {n} distinct examples")
    return out


def train_eval_split(task: str | Task, n_train: int, n_eval: int, seed: int = 0
                     ) -> tuple[list[Example], list[Example]]:
    """Disjoint training and held-out examples (no held-out prompt is trained on).

    Example:
      >>> train, held_out = train_eval_split("sort_numbers", 50, 20, seed=0)
      >>> len(train), len(held_out), bool({e.prompt for e in train} & {e.prompt for e in held_out})
      (50, 20, False)
    """
    held_out = make_examples(task, n_eval, seed, split="eval")
    train = make_examples(task, n_train, seed, split="train",
                          exclude=[e.prompt for e in held_out])
    return train, held_out


def evaluate(predictions: Sequence[str], examples: Sequence[Example],
             task: str | Task | None = None) -> dict:
    """Exact-match accuracy of predictions.

    Args:
      predictions: Model answers, one per example.
      examples: The examples they answer.
      task: Judge with this task's rule; default: each example's own task, or
        plain case-sensitive :func:`exact_match` for user data.

    Returns:
      ``{"accuracy": float, "correct": int, "total": int, "wrong": [indices]}``.

    Example:
      >>> exs = make_examples("add", 2, seed=0)
      >>> evaluate([exs[0].answer, "0"], exs)["accuracy"]
      0.5
    """
    if len(predictions) != len(examples):
        raise ValueError(f"{len(predictions)} predictions for {len(examples)} examples")
    wrong = []
    for i, (p, ex) in enumerate(zip(predictions, examples)):
        name = task if task is not None else (ex.task if ex.task in TASKS else None)
        ok = get_task(name).is_correct(p, ex) if name is not None else exact_match(p, ex.answer)
        if not ok:
            wrong.append(i)
    total = len(examples)
    correct = total - len(wrong)
    return {"accuracy": correct / total if total else 0.0, "correct": correct, "total": total,
            "wrong": wrong}



def evaluate_model(model, tokenizer, examples: Sequence[Example], *,
                   task: str | Task | None = None, max_new_tokens: int = 48,
                   batch_size: int = 16, system: str | None = None) -> dict:
    """Greedy answers of a model to ``examples`` and their exact-match accuracy.

    Args:
      model: A :class:`pockjax.models.llama.Llama`.
      tokenizer: Its :class:`pockjax.models.llama.Tokenizer`.
      examples: The held-out examples.
      task: Judge (see :func:`evaluate`).
      max_new_tokens: Generation budget per answer.
      batch_size: Prompts per compiled generation call.
      system: Optional system message (``None``: the chat template's default).

    Returns:
      :func:`evaluate`'s dict plus ``"predictions"``.

    Example (not run: needs a model)::

      _, held_out = train_eval_split("reverse_words", 0, 64, seed=0)
      evaluate_model(model, tok, held_out)["accuracy"]
    """
    from pockjax.models.llama.generate import generate_text

    prompts = [ex.messages(system) for ex in examples]
    predictions = generate_text(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                batch_size=batch_size)
    result = evaluate(predictions, examples, task)
    result["predictions"] = predictions
    return result
