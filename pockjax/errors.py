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
