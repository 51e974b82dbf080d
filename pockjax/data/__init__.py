"""Training data: built-in verifiable tasks, Alpaca JSONL files, and batching.

Example:
  >>> from pockjax.data import train_eval_split, Batcher
  >>> train, held_out = train_eval_split("reverse_words", n_train=8, n_eval=4, seed=0)
  >>> len(train), len(held_out)
  (8, 4)
"""

from pockjax.data.batching import (
    Batcher,
    SequenceLengthError,
    collate,
    encode_example,
    encode_turns,
    end_of_turn_id,
    refuse_control_text,
)
from pockjax.data.jsonl import DataError, alpaca_prompt, load_alpaca_jsonl, save_alpaca_jsonl
from pockjax.data.tasks import (
    TASKS,
    Example,
    Task,
    evaluate,
    evaluate_model,
    exact_match,
    get_task,
    make_examples,
    normalize_answer,
    train_eval_split,
)

__all__ = [
    "Batcher",
    "DataError",
    "Example",
    "SequenceLengthError",
    "TASKS",
    "Task",
    "alpaca_prompt",
    "collate",
    "encode_example",
    "encode_turns",
    "refuse_control_text",
    "end_of_turn_id",
    "evaluate",
    "evaluate_model",
    "exact_match",
    "get_task",
    "load_alpaca_jsonl",
    "make_examples",
    "normalize_answer",
    "save_alpaca_jsonl",
    "train_eval_split",
]
