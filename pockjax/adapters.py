"""LoRA adapters: the :func:`pockjax.lora` rule's parameters and primitives.

A tensor ``W`` ruled ``pockjax.lora(r, alpha)`` is trained as
``W + alpha / r * A @ B`` with ``W`` frozen. :func:`add_adapters` replaces it
in the params tree by a :class:`LoraTensor`, a pytree whose leaves are
``base`` (``W``), ``lora_a`` (``A``, ``(..., m, r)``) and ``lora_b`` (``B``,
``(..., r, n)``, zeros at the start), so the dotted paths are
``<path>.base``, ``<path>.lora_a`` and ``<path>.lora_b``. The model reads a
``LoraTensor`` as an array (``__jax_array__``): its value is the primitive
``pockjax_lora(W, A, B)``, whose derivative JAX's autodiff takes like any
other, so the user's own train step, unchanged, trains ``A`` and ``B``
(``jax.jit`` of it is the reference).

Written that way the step would form the dense ``A @ B`` and the dense
gradient ``X^T dY`` of every adapted matrix. :func:`pockjax.low_rank` (one
of :func:`pockjax.compile`'s default passes when a scheme has LoRA rules)
rewrites both away: ``X @ (W + s A B)`` becomes ``X @ W + s (X @ A) @ B`` and
the adapters' gradients ``s (X^T dY) B^T`` become ``s X^T (dY B^T)``.

:func:`merge` folds the adapters back into the tensors.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax import _compat as C
from pockjax import quant
from pockjax.errors import SchemeError
from pockjax.paths import keypath_to_parts
from pockjax.scheme import Lora, UpdateScheme

__all__ = ["LoraTensor", "add_adapters", "expand_flat", "has_adapters", "lora_p", "merge"]


# -- primitives ---------------------------------------------------------------------
def _delta(a, b, scale, dtype):
    """``scale * a @ b`` over the last two axes, in ``dtype``."""
    d = jnp.einsum("...mr,...rn->...mn", a, b, preferred_element_type=jnp.result_type(a, b))
    return (scale * d).astype(dtype)


def _dense(w, a, b, *, scale):
    return w + _delta(a, b, scale, w.dtype)


def _tangent(dw, da, db, a, b, *, scale):
    return dw + _delta(da, b, scale, dw.dtype) + _delta(a, db, scale, dw.dtype)


def _cotangent(ct, a, b, *, scale):
    ct = ct.astype(jnp.result_type(a, b))
    ct_a = scale * jnp.einsum("...mn,...rn->...mr", ct, b)
    ct_b = scale * jnp.einsum("...mr,...mn->...rn", a, ct)
    return ct_a.astype(a.dtype), ct_b.astype(b.dtype)


#: ``pockjax_lora(w, a, b; scale) = w + scale * a @ b`` (the adapted tensor's value).
lora_p = C.Primitive("pockjax_lora")
#: Its tangent, linear in ``(dw, da, db)``: ``dw + scale * (da @ b + a @ db)``.
lora_tangent_p = C.Primitive("pockjax_lora_tangent")
#: The adapters' cotangents from the tensor's: ``(scale * ct @ b^T, scale * a^T @ ct)``.
lora_ct_p = C.Primitive("pockjax_lora_ct")
lora_ct_p.multiple_results = True
LORA_PRIMITIVES = (lora_p, lora_tangent_p, lora_ct_p)


def _check_shapes(w, a, b, name="pockjax_lora"):
    ws, as_, bs = tuple(w.shape), tuple(a.shape), tuple(b.shape)
    if len(ws) < 2 or as_ != ws[:-1] + as_[-1:] or bs != ws[:-2] + (as_[-1], ws[-1]):
        raise ValueError(f"{name}: adapter shapes {as_} and {bs} do not fit the tensor's {ws}: expected"
                         f" {ws[:-1] + ('r',)} and {ws[:-2] + ('r', ws[-1])}")


def _lora_abstract(w, a, b, *, scale):
    _check_shapes(w, a, b)
    return C.ShapedArray(w.shape, w.dtype)


def _tangent_abstract(dw, da, db, a, b, *, scale):
    return C.ShapedArray(dw.shape, dw.dtype)


def _ct_abstract(ct, a, b, *, scale):
    return [C.ShapedArray(a.shape, a.dtype), C.ShapedArray(b.shape, b.dtype)]


for _p, _fn, _abs in ((lora_p, _dense, _lora_abstract), (lora_tangent_p, _tangent, _tangent_abstract),
                      (lora_ct_p, _cotangent, _ct_abstract)):
    _p.def_impl(lambda *args, _fn=_fn, **kw: _fn(*args, **kw))
    _p.def_abstract_eval(_abs)
    C.register_lowering(_p, C.lower_fun(_fn, multiple_results=_p.multiple_results))


def _lora_jvp(primals, tangents, *, scale):
    w, a, b = primals
    dw, da, db = (C.instantiate_zeros(t) for t in tangents)
    return lora_p.bind(w, a, b, scale=scale), lora_tangent_p.bind(dw, da, db, a, b, scale=scale)


def _tangent_transpose(ct, dw, da, db, a, b, *, scale):
    if C.is_undefined_primal(a) or C.is_undefined_primal(b):
        raise NotImplementedError("pockjax_lora_tangent is linear in its first three operands only")
    if type(ct) is C.Zero:
        return [C.Zero(dw.aval), C.Zero(da.aval), C.Zero(db.aval), None, None]
    ct_a, ct_b = lora_ct_p.bind(ct, a, b, scale=scale)
    return [ct.astype(dw.aval.dtype), ct_a, ct_b, None, None]


C.primitive_jvps[lora_p] = _lora_jvp
C.primitive_transposes[lora_tangent_p] = _tangent_transpose


# -- the params-tree node --------------------------------------------------------------
@jax.tree_util.register_pytree_with_keys_class
class LoraTensor:
    """A tensor with a LoRA adapter: reads as ``base + scale * lora_a @ lora_b``.

    A pytree with the leaves ``base``, ``lora_a`` and ``lora_b`` (``base`` may
    be a :class:`~pockjax.QTensor`: a quantized frozen tensor with a float
    adapter). Models read it as an array (``jnp.asarray``, ``x @ t``,
    ``variable[...]``).

    Example:
        >>> import jax.numpy as jnp
        >>> t = LoraTensor(jnp.ones((2, 3)), jnp.ones((2, 1)), jnp.full((1, 3), 0.5), scale=2.0)
        >>> jnp.asarray(t)
        Array([[2., 2., 2.],
               [2., 2., 2.]], dtype=float32)
        >>> t.shape, t.rank
        ((2, 3), 1)
    """

    def __init__(self, base, lora_a, lora_b, *, scale: float):
        self.base, self.lora_a, self.lora_b = base, lora_a, lora_b
        self.scale = float(scale)

    def tree_flatten_with_keys(self):
        keys = [jax.tree_util.GetAttrKey(k) for k in ("base", "lora_a", "lora_b")]
        return list(zip(keys, (self.base, self.lora_a, self.lora_b))), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale=scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def rank(self) -> int:
        return int(np.shape(self.lora_a)[-1])

    def __jax_array__(self):
        base = quant.dequantize(self.base) if quant.is_qtensor(self.base) else self.base
        return lora_p.bind(jnp.asarray(base), jnp.asarray(self.lora_a), jnp.asarray(self.lora_b), scale=self.scale)

    def __getitem__(self, index):
        value = self.__jax_array__()
        return value if index is Ellipsis else value[index]

    def __repr__(self) -> str:
        if not all(hasattr(x, "shape") for x in (self.base, self.lora_a)):  # a tree.map of other leaves
            return f"LoraTensor(base={self.base!r}, lora_a={self.lora_a!r}, lora_b={self.lora_b!r})"
        return f"LoraTensor(shape={self.shape}, rank={self.rank}, scale={self.scale:g})"


# A model's own code reads an adapted weight as the array it stands for: ``w.T``,
# ``w.reshape(...)``, ``w.astype(bf16)``, ``2 * w`` work as on ``jnp.asarray(w)`` (they once
# failed with a bare AttributeError), and the low-rank pass still sees ``base + scale * A @ B``.
def _forward_method(name):
    def method(self, *args, **kwargs):
        return getattr(self.__jax_array__(), name)(*args, **kwargs)
    method.__name__ = name
    return method


def _forward_property(name):
    return property(lambda self: getattr(self.__jax_array__(), name), doc=f"``jnp.asarray(t).{name}``")


for _name in ("reshape", "astype", "transpose", "swapaxes", "squeeze", "ravel", "flatten", "sum", "mean",
              "max", "min", "clip", "dot", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__matmul__", "__rmatmul__", "__pow__", "__neg__", "__pos__"):
    setattr(LoraTensor, _name, _forward_method(_name))
for _name in ("T", "mT"):
    setattr(LoraTensor, _name, _forward_property(_name))
del _name
LoraTensor.size = property(lambda self: math.prod(self.shape), doc="The number of elements.")
LoraTensor.__len__ = lambda self: self.shape[0]
LoraTensor.__array_ufunc__ = None  # numpy defers to the operators above (np.ones(s) * t)


def is_lora(x) -> bool:
    """Whether ``x`` is a :class:`LoraTensor` (an ``is_leaf`` for tree walks that stop at one)."""
    return isinstance(x, LoraTensor)


def _is_node(x) -> bool:
    return is_lora(x) or quant.is_qtensor(x)


def _map_with_paths(fn, tree):
    """``fn(path, x)`` on every leaf, LoRA tensor or quantized tensor of ``tree``."""
    def visit(keypath, x):
        parts = keypath_to_parts(keypath)
        return fn(".".join(parts), x)

    return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=_is_node)


def has_adapters(tree) -> bool:
    """Whether ``tree`` holds any :class:`LoraTensor`."""
    return any(is_lora(x) for x in jax.tree.leaves(tree, is_leaf=is_lora))


def expand_flat(flat: dict) -> dict:
    """A ``{path: leaf}`` map with each :class:`LoraTensor` as its three parts.

    Example:
        >>> import jax.numpy as jnp
        >>> t = LoraTensor(jnp.zeros((2, 2)), jnp.ones((2, 1)), jnp.ones((1, 2)), scale=1.0)
        >>> list(expand_flat({"w": t, "b": 1}))
        ['w.base', 'w.lora_a', 'w.lora_b', 'b']
    """
    out = {}
    for path, x in flat.items():
        if is_lora(x):
            out.update({f"{path}.base": x.base, f"{path}.lora_a": x.lora_a, f"{path}.lora_b": x.lora_b})
        else:
            out[path] = x
    return out


def add_adapters(params: Any, scheme: UpdateScheme, *, seed: int = 0) -> Any:
    """``params`` with a :class:`LoraTensor` for every tensor that ``scheme`` rules ``lora(...)``.

    ``lora_a`` is drawn as PEFT draws its ``lora_A`` (Kaiming-uniform, bound
    ``1/sqrt(m)``), ``lora_b`` is zeros, so the adapted model starts equal to
    the model. Adapters are float32 (the base's dtype if that is a wider
    float). Tensors that already hold adapters are kept as they are.

    Args:
      params: the params pytree (dicts, NNX state, QTensor leaves allowed).
      scheme: the update scheme.
      seed: the seed of the ``lora_a`` draws.

    Raises:
      SchemeError: a LoRA-ruled tensor is not a matrix, or has more than two
        axes under a rule without ``stacked=True``.

    Example:
        >>> import jax.numpy as jnp, pockjax
        >>> params = {"wq": jnp.ones((8, 8)), "norm": jnp.ones(8)}
        >>> scheme = pockjax.UpdateScheme({"wq": pockjax.lora(2)}, default="full")
        >>> tuned = pockjax.add_adapters(params, scheme)
        >>> pockjax.leaf_paths(tuned)
        ['norm', 'wq.base', 'wq.lora_a', 'wq.lora_b']
        >>> [str(r) for r in scheme.resolve_tree(tuned)]
        ['full', 'frozen', 'full', 'full']
    """
    counter = [0]

    def adapt(path, x):
        rule, _ = scheme.rule_for(path)
        if is_lora(x):  # kept, if they are the adapters the rule asks for (another rank or alpha was kept silently)
            rank = int(np.shape(x.lora_a)[-1])
            if isinstance(rule, Lora) and (rank != rule.rank or not math.isclose(float(x.scale), rule.scale)):
                raise SchemeError(f"{path} already holds LoRA adapters of rank {rank} and scale {float(x.scale):g},"
                                  f" but the scheme rules it {rule} (scale {rule.scale:g}): merge them first"
                                  f" (pockjax.adapters.merge or scheme.merge) or use the rule they were made with")
            return x
        if not isinstance(rule, Lora):
            return x
        shape = tuple(np.shape(x)) if not quant.is_qtensor(x) else tuple(x.shape)
        if len(shape) < 2:
            raise SchemeError(f"{path} has the rule {rule}, but a LoRA adapter needs a matrix (or a stack of"
                              f" matrices) and {path} has shape {shape}: rule it 'full' or 'frozen'")
        if len(shape) > 2 and not rule.stacked:  # (it got one adapter per index of its leading axes, silently)
            raise SchemeError(f"{path} has shape {shape}, more than a matrix's two axes: if its leading axes"
                              f" index a stack of matrices (layers under lax.scan), rule it"
                              f" pockjax.lora({rule.rank}, alpha={rule.alpha:g}, stacked=True) for an adapter"
                              f" per matrix; a DenseGeneral kernel (features, heads, head_dim) is one matrix:"
                              f" give the layer a 2-D kernel (nnx.Linear), or rule it 'full' or 'frozen'")
        if not quant.is_qtensor(x) and not jnp.issubdtype(np.dtype(x.dtype), jnp.floating):
            raise SchemeError(f"{path} has the rule {rule}, but holds {np.dtype(x.dtype)} values: a LoRA update"
                              f" of integers would be rounded away when merged; rule it 'frozen'")
        m, n = shape[-2:]
        if rule.rank > min(m, n):
            raise SchemeError(f"{path}: LoRA rank {rule.rank} is larger than the matrix {shape[-2:]} allows"
                              f" (at most {min(m, n)})")
        dtype = np.dtype(x.dtype)
        if quant.is_qtensor(x) or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 4:
            dtype = np.dtype(np.float32)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), counter[0])
        counter[0] += 1
        bound = 1.0 / math.sqrt(m)
        a = jax.random.uniform(key, shape[:-2] + (m, rule.rank), dtype, -bound, bound)
        b = jnp.zeros(shape[:-2] + (rule.rank, n), dtype)
        return LoraTensor(x, a, b, scale=rule.scale)

    return _map_with_paths(adapt, params)


def merge(params: Any) -> Any:
    """``params`` with every :class:`LoraTensor` folded into one array, ``base + scale * A @ B``.

    The merged array has the base's dtype (a quantized base is dequantized
    first: the merge of a quantized tensor is a float tensor).

    Example:
        >>> import jax.numpy as jnp
        >>> t = LoraTensor(jnp.zeros((2, 2)), jnp.ones((2, 1)), jnp.ones((1, 2)), scale=0.5)
        >>> merge({"w": t, "b": jnp.ones(2)})["w"]
        Array([[0.5, 0.5],
               [0.5, 0.5]], dtype=float32)
    """
    def fold(x):
        if not is_lora(x):
            return x
        base = quant.dequantize(x.base) if quant.is_qtensor(x.base) else jnp.asarray(x.base)
        return _dense(base, jnp.asarray(x.lora_a), jnp.asarray(x.lora_b), scale=x.scale)

    return jax.tree.map(fold, params, is_leaf=is_lora)
