"""Read the schedule XLA chose out of a compiled executable's HLO text.

XLA reorders a program freely (its scheduler minimises memory by its own model),
and expands ``optimization_barrier`` into control dependencies before scheduling, so
the barrier itself is gone from the final HLO. What is left to check is the order:
the entry computation of ``compiled.as_text()`` is printed in schedule order
(``is_scheduled=true``). :func:`update_positions` finds, for every output of the
program, the position of the instruction that writes it, and the positions of the
backward-pass instructions (their ``op_name`` metadata carries JAX's name stack,
``transpose(jvp(...))``), so a test can check that parameter updates run during the
backward pass rather than after it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from pockjax._src.jaxpr import Phase, name_stack_phase

__all__ = ["HloSchedule", "entry_schedule", "update_positions"]

_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class HloSchedule:
    """The entry computation's instructions in schedule order.

    Attributes:
      names: instruction names in schedule order.
      op_names: the ``op_name`` metadata of each (``""`` if none).
      root_operands: names of the ROOT tuple's operands (one per program output).
    """

    names: tuple[str, ...]
    op_names: tuple[str, ...]
    root_operands: tuple[str, ...]

    def position(self, name: str) -> int:
        return self.names.index(name)


def entry_schedule(hlo_text: str) -> HloSchedule:
    """Parse the ENTRY computation of an HLO module printed by ``compiled.as_text()``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> c = jax.jit(lambda x: (jnp.sin(x), x * 2)).lower(jnp.ones(4)).compile()
      >>> s = entry_schedule(c.as_text())
      >>> len(s.root_operands)
      2
    """
    lines = hlo_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY")), None)
    if start is None:
        raise ValueError("no ENTRY computation in the HLO text")
    names, op_names, root = [], [], ()
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        is_root, name, rest = m.group(1), m.group(2), m.group(3)
        names.append(name)
        om = re.search(r'op_name="([^"]*)"', rest)
        op_names.append(om.group(1) if om else "")
        if is_root:
            tm = re.search(r"\btuple\((.*)\)", rest)
            if tm:
                body = re.sub(r"/\*.*?\*/", "", tm.group(1))
                root = tuple(t.strip().lstrip("%") for t in body.split(",") if t.strip())
            else:
                root = (name,)
    return HloSchedule(tuple(names), tuple(op_names), root)


def update_positions(compiled: Any, out_roles: Sequence[str], *, outputs: Sequence[int] | None = None) -> dict:
    """Where XLA scheduled each parameter update relative to the backward pass.

    Args:
      compiled: a ``jax.stages.Compiled`` (``CompiledStep.executable.compiled``).
      out_roles: the role of each output of the compiled program (``"param"``,
        ``"opt_state"``, ...), in order.
      outputs: optional indices into ``out_roles`` of the outputs the executable
        returns (``CompiledStep.computed_outputs``); default all.

    Returns:
      A dict: ``n_instructions``; ``last_backward`` (schedule position of the last
      instruction whose op_name has ``transpose(``); ``param_positions`` (position
      of the instruction writing each parameter output, -1 when it is an input
      forwarded unchanged); ``before_backward_end`` (how many parameter outputs are
      written before ``last_backward``); ``n_params``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def step(w, x):
      ...     g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
      ...     return w - 0.1 * g
      >>> c = jax.jit(step).lower(jnp.ones((4, 4)), jnp.ones((2, 4))).compile()
      >>> update_positions(c, ["param"])["n_params"]
      1
    """
    s = entry_schedule(compiled.as_text())
    idx = list(outputs) if outputs is not None else list(range(len(out_roles)))
    roles = [out_roles[i] for i in idx]
    pos = {n: k for k, n in enumerate(s.names)}
    backward = [k for k, op in enumerate(s.op_names) if name_stack_phase(op) is Phase.BACKWARD]
    last_backward = max(backward) if backward else -1
    param_positions = []
    for role, name in zip(roles, s.root_operands):
        if role != "param":
            continue
        p = pos.get(name, -1)
        if p >= 0 and s.names[p].startswith("args_") or name.startswith("args_"):
            p = -1
        param_positions.append(p)
    written = [p for p in param_positions if p >= 0]
    return {
        "n_instructions": len(s.names),
        "last_backward": last_backward,
        "param_positions": param_positions,
        "before_backward_end": sum(1 for p in written if p < last_backward),
        "n_params": len(written),
    }
