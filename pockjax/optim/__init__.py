"""Optax-compatible pieces that know about sparse schemes."""

from pockjax.optim.state import SparseOptState, init_opt_state, to_full

__all__ = ["SparseOptState", "init_opt_state", "to_full"]
