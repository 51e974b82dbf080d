"""The IREE backend of :func:`pockjax.compile`: a rewritten train step compiled ahead of time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import jax
import numpy as np

from pockjax import _compat as C
from pockjax.backends.iree.lowering import compile_flat
from pockjax.errors import BackendError
from pockjax.graph import MODEL_STATE, OPT_STATE, PARAM

if TYPE_CHECKING:
    from pockjax.graph import TrainGraph

__all__ = ["IreeStepExecutable"]


class IreeStepExecutable:
    """An IREE backend: the transformed step exported to StableHLO, compiled AOT.

    Parameters, optimizer state and model state stay on the IREE device
    between calls: outputs come back as device buffers that the next call
    takes without a transfer; only the batch goes in and the aux outputs
    (the loss) come back to the host.
    """

    name = "iree"

    def __init__(self, graph: "TrainGraph", computed_outputs: Sequence[int], target: str, options: dict | None):
        closed = graph.closed_jaxpr
        fun_all = C.jaxpr_as_fun(closed)
        computed = list(computed_outputs)
        # Typed PRNG keys cross the module boundary as their key data (uint32):
        # StableHLO and the runtime know no key types.
        self.key_inputs = {i: a.dtype for i, a in enumerate(graph.in_avals) if C.is_key_dtype(a.dtype)}
        out_avals = graph.out_avals
        self.key_outputs = {k: out_avals[o].dtype for k, o in enumerate(computed) if C.is_key_dtype(out_avals[o].dtype)}
        in_avals = [C.key_data_aval(a) if i in self.key_inputs else a for i, a in enumerate(graph.in_avals)]

        def fun(*args):
            args = [C.wrap_key_data(x, self.key_inputs[i]) if i in self.key_inputs else x for i, x in enumerate(args)]
            outs = fun_all(*args)
            return [jax.random.key_data(outs[o]) if k in self.key_outputs else outs[o] for k, o in enumerate(computed)]

        state_roles = (PARAM, OPT_STATE, MODEL_STATE)
        state_mask = [role in state_roles for role in graph.in_roles]
        state_outputs = {
            k: graph.out_to_in[o] for k, o in enumerate(computed) if graph.out_to_in[o] is not None
        }
        self.target = target
        self.exe = compile_flat(
            fun,
            in_avals,
            target,
            options,
            state_mask=state_mask,
            state_outputs=state_outputs,
            input_names=list(graph.in_paths),
            output_names=[graph.out_paths[o] for o in computed],
            extra={"in_roles": list(graph.in_roles), "passes": list(graph.pass_names)},
            emulate=(target == "arm64"),
        )

    @property
    def runs_here(self) -> bool:
        """Whether this machine runs the module (else it is only exported)."""
        return callable(self.exe)

    def adopt_host_copies(self, values):
        """State outputs as ``jax.Array`` s the next call takes without an upload (:meth:`IreeExecutable.adopt_host_copies`)."""
        return self.exe.adopt_host_copies(values)

    def __call__(self, *flat_args):
        if not self.runs_here:
            raise BackendError(
                f"target {self.target!r} compiled, but this machine cannot run it (it has no such device, or the"
                " module is for another CPU or a static library); export it with step.export(path,"
                " *example_args) and run it where it belongs (pockjax.runtime.load(path) on the device)"
            )
        if self.key_inputs:
            flat_args = [
                jax.random.key_data(x) if i in self.key_inputs and C.is_key_dtype(getattr(x, "dtype", None)) else x
                for i, x in enumerate(flat_args)
            ]
        outs = self.exe(*flat_args)
        if self.key_outputs:
            outs = [
                C.wrap_key_data(np.asarray(x), self.key_outputs[k]) if k in self.key_outputs else x
                for k, x in enumerate(outs)
            ]
        return outs
