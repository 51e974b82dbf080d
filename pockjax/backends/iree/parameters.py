"""State kept in module globals, initialised by name from an IREE parameter archive.

:func:`wrap_state_as_parameters` turns an exported step
``main(*state, *batch) -> (*new_state, *aux)`` into a module whose state lives
in ``util.global`` variables read from ``#flow.parameter.named`` entries, so
that ``pockjax.runtime.load`` runs it from a parameter archive (``.irpa``).
The module is edited with the MLIR Python bindings shipped in
``iree-base-compiler`` (``iree.compiler.ir`` and the ``func`` and ``util``
dialects), not as text.
"""

from __future__ import annotations

import io
from typing import Sequence

from pockjax.runtime.metadata import TensorSpec

__all__ = ["wrap_state_as_parameters"]


def _public_main(module):
    from iree.compiler.dialects import func

    found = [
        op for op in module.body.operations
        if isinstance(op, func.FuncOp) and op.name.value == "main"
        and (op.visibility is None or op.visibility.value == "public")
    ]
    if len(found) != 1:
        raise ValueError("expected exactly one public @main in the exported module")
    return found[0]


def wrap_state_as_parameters(
    mlir_text: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], scope: str = "model",
    *, bytecode: bool = False,
) -> str | bytes:
    """Rewrites an exported step so its state lives in module globals read from named parameters.

    The exported ``main(*state, *batch) -> (*new_state, *aux)`` becomes the
    private ``@pockjax_step``; a new public ``main(*batch) -> (*aux)`` loads
    each state global, calls it, stores the new state and returns the aux
    outputs. Each state input ``name`` is a ``util.global`` initialised from
    ``#flow.parameter.named<scope::name>``, so IREE's io_parameters module
    fills it from a parameter archive (``.irpa``) when the module is loaded;
    state that no output replaces (frozen weights) is an immutable global.
    ``get_state() -> (*state)`` and ``set_state(*mutable_state)`` read and write
    it.

    Returns the module as MLIR text, or with ``bytecode=True`` as MLIR bytecode
    (what :func:`~pockjax.backends.iree.compile_flat` hands to ``iree-compile``).
    IREE 3.13 prints a parameter name inside ``#flow.parameter.named`` without
    escaping it, so a state name holding ``"`` or ``\\`` has no text form (a
    ``ValueError``); its bytecode is exact.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from pockjax.runtime import TensorSpec
      >>> def step(w, x):
      ...     return w - x, jnp.sum(w * x)
      >>> avals = [jax.ShapeDtypeStruct((3,), jnp.float32)] * 2
      >>> text = jax.export.export(jax.jit(step))(*avals).mlir_module()
      >>> ins = [TensorSpec("w", (3,), "float32", "state"), TensorSpec("x", (3,), "float32", "input")]
      >>> outs = [TensorSpec("w", (3,), "float32", "state", 0), TensorSpec("loss", (), "float32", "aux")]
      >>> wrapped = wrap_state_as_parameters(text, ins, outs)
      >>> print([ln.strip() for ln in wrapped.splitlines() if "util.global private" in ln][0])
      util.global private mutable @pockjax_state_0 = #flow.parameter.named<"model"::"w"> : tensor<3xf32>
      >>> "func.func public @main(%arg0: tensor<3xf32>) -> tensor<f32>" in wrapped
      True
    """
    from iree.compiler import ir
    from iree.compiler.dialects import func, util

    state_idx = [i for i, s in enumerate(inputs) if s.role == "state"]
    batch_idx = [i for i, s in enumerate(inputs) if s.role != "state"]
    stored = {o.state_index: k for k, o in enumerate(outputs) if o.role == "state"}
    mutable = [i for i in state_idx if i in stored]
    aux_idx = [k for k, o in enumerate(outputs) if o.role != "state"]
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(mlir_text)
        step = _public_main(module)
        step_type = ir.FunctionType(step.type)
        ty_in, ty_out = list(step_type.inputs), list(step_type.results)
        if len(ty_in) != len(inputs) or len(ty_out) != len(outputs):
            raise ValueError(
                f"the exported @main takes {len(ty_in)} and returns {len(ty_out)} values; "
                f"the signature has {len(inputs)} inputs and {len(outputs)} outputs"
            )
        step.attributes["sym_name"] = ir.StringAttr.get("pockjax_step")
        step.attributes["sym_visibility"] = ir.StringAttr.get("private")
        name = {i: f"pockjax_state_{i}" for i in state_idx}

        with ir.InsertionPoint(module.body):
            for i in state_idx:
                # (no Python builder for flow's parameter attribute: it is parsed, from quoted names)
                initial = ir.Attribute.parse(
                    f"#flow.parameter.named<{ir.StringAttr.get(scope)}::{ir.StringAttr.get(inputs[i].name)}>"
                    f" : {ty_in[i]}"
                )
                util.GlobalOp(name[i], ir.TypeAttr.get(ty_in[i]), sym_visibility="private",
                              is_mutable=(i in stored) or None, initial_value=initial)

            def load(i):
                return util.GlobalLoadOp(ty_in[i], name[i]).result

            # main(*batch) -> (*aux)
            main = func.FuncOp("main", ([ty_in[i] for i in batch_idx], [ty_out[k] for k in aux_idx]),
                               visibility="public")
            with ir.InsertionPoint(main.add_entry_block()):
                batch = dict(zip(batch_idx, main.arguments))
                state = {i: load(i) for i in state_idx}
                call = func.CallOp(ty_out, "pockjax_step", [state[i] if i in state else batch[i]
                                                            for i in range(len(inputs))])
                for i in mutable:
                    util.GlobalStoreOp(call.results[stored[i]], name[i])
                func.ReturnOp([call.results[k] for k in aux_idx])

            # get_state() -> (*state)
            get_state = func.FuncOp("get_state", ([], [ty_in[i] for i in state_idx]), visibility="public")
            with ir.InsertionPoint(get_state.add_entry_block()):
                func.ReturnOp([load(i) for i in state_idx])

            # set_state(*mutable_state)
            set_state = func.FuncOp("set_state", ([ty_in[i] for i in mutable], []), visibility="public")
            with ir.InsertionPoint(set_state.add_entry_block()):
                for i, value in zip(mutable, set_state.arguments):
                    util.GlobalStoreOp(value, name[i])
                func.ReturnOp([])
        module.operation.verify()
        if bytecode:
            buffer = io.BytesIO()
            module.operation.write_bytecode(buffer)
            return buffer.getvalue()
        unprintable = [inputs[i].name for i in state_idx if any(c in inputs[i].name for c in '"\\')]
        if unprintable:
            raise ValueError(
                f"state names {unprintable} cannot be printed as MLIR text by this IREE; "
                "use wrap_state_as_parameters(..., bytecode=True)"
            )
        return str(module)
