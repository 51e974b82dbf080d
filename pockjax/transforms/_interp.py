"""Moved to :mod:`pockjax._src.jaxpr`; re-exported here for older imports."""

from pockjax._src.jaxpr import (  # noqa: F401
    HIGHER_ORDER,
    EqnRule,
    bind_eqn,
    contains,
    eval_jaxpr_with,
    is_var,
    producers,
    retrace,
    rewrite_nested,
    subjaxprs,
    walk,
)

#: Older name for :data:`HIGHER_ORDER` (now keyed by Primitive objects).
NESTED_PARAMS = HIGHER_ORDER
