"""Every import of JAX internals lives here.

pockjax rewrites jaxprs, which needs a few pieces of JAX that are not (yet) in
the public ``jax.extend`` API. Keeping them in one module means a JAX upgrade
touches one file; ``pyproject.toml`` pins the JAX range these were checked on.
"""

from __future__ import annotations

import os
import warnings

import jax
from jax.extend import core as jex_core

# The JAX releases this module's internals were verified on (pyproject pins
# the same range). Outside it pockjax refuses to load: its gradient tags hook
# JAX's autodiff, and a silent change there would make sparse steps train
# everything (or nothing) without a word. POCKJAX_ALLOW_UNVERIFIED_JAX=1
# loads anyway, with a warning; the tagging self-test still runs.
VERIFIED_JAX = ((0, 10, 0), (0, 11, 0))  # [low, high)


def jax_version() -> tuple[int, ...]:
    return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def check_jax_version(version: tuple[int, ...] | None = None) -> None:
    """Raise unless ``version`` (default: the installed JAX) is in :data:`VERIFIED_JAX`."""
    from pockjax.errors import PockjaxError

    version = jax_version() if version is None else tuple(version)
    low, high = VERIFIED_JAX
    if low <= version < high:
        return
    text = ".".join(map(str, version))
    message = (
        f"pockjax was verified on JAX >={'.'.join(map(str, low))},<{'.'.join(map(str, high))}, "
        f"but JAX {text} is installed. Install a verified JAX (pip install 'jax>=0.10,<0.11'), "
        "or set POCKJAX_ALLOW_UNVERIFIED_JAX=1 to try this one."
    )
    if os.environ.get("POCKJAX_ALLOW_UNVERIFIED_JAX") == "1":
        warnings.warn(message, stacklevel=2)
        return
    raise PockjaxError(message)


check_jax_version()

# Public (jax.extend) names first.
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Primitive = jex_core.Primitive
Var = jex_core.Var
DropVar = jex_core.DropVar
Tracer = jax.core.Tracer
jaxpr_as_fun = jex_core.jaxpr_as_fun
check_jaxpr = jex_core.check_jaxpr
new_jaxpr_eqn = jex_core.new_jaxpr_eqn
from jax.extend.core import primitives as primitives  # noqa: E402  (every lax Primitive object)

scan_p = primitives.scan_p

# Primitives pockjax's tables name that ``jax.extend.core.primitives`` does not
# export (looked up by :func:`pockjax._src.jaxpr.prims`).
from jax._src.lax.lax import optimization_barrier_p  # noqa: E402
from jax._src.lax.slicing import scatter_sub_p  # noqa: E402
from jax._src.lax.parallel import reduce_scatter_p  # noqa: E402

try:  # noqa: E402
    from jax._src.shard_map import shard_map_p
except ImportError:  # pragma: no cover - a JAX without it
    shard_map_p = None

EXTRA_PRIMITIVES = tuple(p for p in (optimization_barrier_p, scatter_sub_p, reduce_scatter_p, shard_map_p) if p is not None)

# Internals: AD, batching and lowering registration, DCE rules, eval.
from jax._src import core as _core  # noqa: E402
from jax._src.interpreters import ad, batching, mlir  # noqa: E402
from jax._src.interpreters import partial_eval as pe  # noqa: E402

ShapedArray = _core.ShapedArray
eval_jaxpr = _core.eval_jaxpr
dce_rules = pe.dce_rules
dce_jaxpr = pe.dce_jaxpr
convert_constvars_jaxpr = pe.convert_constvars_jaxpr
primitive_transposes = ad.primitive_transposes
deflinear2 = ad.deflinear2
primitive_batchers = batching.primitive_batchers
register_lowering = mlir.register_lowering
lower_fun = mlir.lower_fun
is_undefined_primal = ad.is_undefined_primal
Zero = ad.Zero


# Primitives whose jaxpr params describe a small combiner (scatter's update,
# a generic reduction's body), not a computation on the primitive's operands:
# passes treat them as ordinary ops.
COMBINER_PRIMITIVE_PREFIXES = ("scatter", "reduce_window", "select_and_", "reduce", "sort", "argsort")


def is_combiner_primitive(name: str) -> bool:
    return name.startswith(COMBINER_PRIMITIVE_PREFIXES)


primitive_jvps = ad.primitive_jvps
instantiate_zeros = ad.instantiate_zeros

from jax._src import source_info_util as _siu  # noqa: E402


def source_context(eqn: JaxprEqn):
    """A context manager under which re-bound ops keep ``eqn``'s source info."""
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    return _siu.user_context(eqn.source_info.traceback, name_stack=name_stack)


def summarize_source_info(source_info) -> str:
    """``file:line (function)`` of an equation's source info."""
    return _siu.summarize(source_info)


def get_bind_params(primitive, params: dict) -> dict:
    """Params to re-bind ``primitive`` with (JAX 0.10: params only, no subfuns)."""
    out = primitive.get_bind_params(params)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        raise NotImplementedError("this JAX returns (subfuns, params) from get_bind_params; update _compat")
    return out

# --- Finding gradients -------------------------------------------------------
# jax.grad / value_and_grad / vjp all linearize through ``ad.linearize``. While
# pockjax traces a train step, it wraps that function so that every primal
# that is one of the step's parameter leaves first passes through
# ``pockjax_param_tag`` *inside* the linearized function: the parameter's
# cotangent then ends in a ``pockjax_grad_tag`` equation. Outside a trace the
# wrapper is a no-op.
import contextlib  # noqa: E402
import threading  # noqa: E402

_param_registry = threading.local()
_original_linearize = ad.linearize


def _tagging_linearize(traceable, primals_ft, *args, **kwargs):
    registry = getattr(_param_registry, "ids", None)
    if not registry:
        return _original_linearize(traceable, primals_ft, *args, **kwargs)
    flat = list(primals_ft)
    indices = [registry.get(id(p)) for p in flat]
    if all(i is None for i in indices):
        return _original_linearize(traceable, primals_ft, *args, **kwargs)
    tag = _param_registry.tag

    def tagged(*fargs):
        leaves, tree = jax.tree_util.tree_flatten(fargs)
        if len(leaves) != len(indices):  # unexpected structure: leave untouched
            return traceable(*fargs)
        leaves = [x if i is None else tag(x, i) for x, i in zip(leaves, indices)]
        return traceable(*jax.tree_util.tree_unflatten(tree, leaves))

    tagged.__name__ = getattr(traceable, "__name__", "tagged")
    tagged.__wrapped__ = traceable
    return _original_linearize(tagged, primals_ft, *args, **kwargs)


ad.linearize = _tagging_linearize


@contextlib.contextmanager
def tagging_params(tracers, tag):
    """While active, linearizations w.r.t. ``tracers[i]`` tag it as param ``i``."""
    previous = getattr(_param_registry, "ids", None), getattr(_param_registry, "tag", None)
    _param_registry.ids = {id(t): i for i, t in enumerate(tracers) if t is not None}
    _param_registry.tag = tag
    try:
        yield
    finally:
        _param_registry.ids, _param_registry.tag = previous


def is_key_dtype(dtype) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``key<fry>``)."""
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def wrap_key_data(data, dtype):
    """Typed keys of key dtype ``dtype`` from their raw key data."""
    return jax.random.wrap_key_data(data, impl=dtype._impl)


def key_data_aval(aval):
    """The aval of ``jax.random.key_data`` of keys with ``aval``."""
    out = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return ShapedArray(out.shape, out.dtype)


def cpu_backend_started() -> bool:
    """Whether JAX has created its backends (after which CPU client options are fixed)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def set_variable_values(variables, values) -> None:
    """Each of ``variables`` set to its value as ``nnx.update`` sets it (flax 0.12):
    into a mutable array reference in place, else as the raw value (no set-value
    hooks, no copy)."""
    from flax.nnx.variablelib import is_array_ref

    for variable, value in zip(variables, values):
        if is_array_ref(variable.get_raw_value()):
            variable[...] = value
        else:
            variable.set_raw_value(value, _unsafe_bypass_check=True)
