"""Exceptions raised by pockjax, each naming what was wrong and how to fix it."""


class PockjaxError(Exception):
    """Base class of every pockjax error."""


class SchemeError(PockjaxError, ValueError):
    """A malformed update scheme."""


class UnknownRuleError(SchemeError):
    """A rule that is not 'full', 'frozen' or channels(...)."""


class UnmatchedPatternError(SchemeError):
    """A scheme pattern that matches no parameter path."""


class ChannelRuleError(SchemeError):
    """A channel rule that does not fit the tensor it applies to."""


class StepSignatureError(PockjaxError, TypeError):
    """A train step whose inputs or outputs do not have the expected structure."""


class UnsupportedPrimitiveError(PockjaxError, NotImplementedError):
    """A pass met a primitive it cannot handle."""


class BackendError(PockjaxError, RuntimeError):
    """A backend failed to compile or run a step."""


class FileFormatError(PockjaxError, ValueError):
    """A file that pockjax reads is malformed; the message names the file and the fault."""


class SchemeFileError(SchemeError, FileFormatError):
    """A scheme file that is not UTF-8 JSON."""


class FileMissingError(PockjaxError, FileNotFoundError):
    """A file or directory that was asked for does not exist."""


class ModelFileError(FileFormatError):
    """A model file or directory (GGUF, safetensors, tokenizer) is corrupt or unusable."""


class GGUFError(ModelFileError):
    """A GGUF file is truncated, corrupt, or not what was expected."""


class CheckpointError(ModelFileError):
    """A Hugging Face checkpoint directory is missing pieces or is corrupt."""


class SafetensorsError(CheckpointError):
    """A ``.safetensors`` file is truncated or its header is malformed."""


class TorchCheckpointError(CheckpointError):
    """A PyTorch checkpoint that is corrupt, truncated, or holds more than tensors."""


class TokenizerFileError(ModelFileError):
    """A tokenizer (``tokenizer.json``, ``tokenizer_config.json`` or GGUF metadata) is malformed."""


class UnsupportedModelError(ModelFileError):
    """A well-formed model file holds an architecture or tensor type pockjax cannot load."""


class UnknownModelError(PockjaxError, KeyError):
    """A model name that is neither a known pretrained model nor an existing path."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NonFiniteError(PockjaxError, ArithmeticError):
    """Training produced a NaN or an infinity (or exploding weights), or weights hold them.

    The message names the step and the first non-finite tensor; nothing
    non-finite is written.
    """


class DataError(FileFormatError):
    """A data file is missing, empty, or has a malformed line."""


class TargetError(BackendError, ValueError):
    """An unknown compile target, or a target option that does not apply to it."""


class InputError(PockjaxError, ValueError):
    """A value given to a command or function that it cannot use (say which and why)."""


class UnknownTaskError(PockjaxError, KeyError):
    """A task name that is not one of the shipped tasks."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0]) if self.args else ""


def some(items, limit: int = 4, *, quote: bool = True) -> str:
    """The first ``limit`` of ``items`` for an error message (each as its repr, or as
    written with ``quote=False``), and how many more.

    Every message that names a list of paths, tensors or shapes goes through
    this, so that a model with thousands of them gets a readable line.

    Example:
      >>> some(["a", "b"])
      "'a', 'b'"
      >>> some(range(7))
      '0, 1, 2, 3 and 3 more'
      >>> some(["args[0]['w']"], quote=False)
      "args[0]['w']"
    """
    items = list(items)
    head = ", ".join((repr if quote else str)(x) for x in items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")
