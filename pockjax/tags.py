"""Identity primitives that mark parameters and their gradients in a jaxpr.

When pockjax traces a train step it passes every parameter leaf ``i`` through
``param_tag[index=i]``. The tag is the identity in the forward pass; its
tangent goes through the linear ``tangent_tag``, whose transpose is
``grad_tag[index=i]``. So after ``jax.grad``/``jax.vjp`` has run, the complete
gradient of parameter ``i`` is exactly the output of one ``grad_tag[index=i]``
equation, wherever autodiff put it. Passes find gradients by that tag;
:func:`pockjax.transforms.strip_tags` removes the tags before compilation.
"""

from __future__ import annotations

from pockjax import _compat as C

param_tag_p = C.Primitive("pockjax_param_tag")
tangent_tag_p = C.Primitive("pockjax_tangent_tag")
grad_tag_p = C.Primitive("pockjax_grad_tag")
TAG_PRIMITIVES = (param_tag_p, tangent_tag_p, grad_tag_p)


def _identity_impl(x, *, index):
    del index
    return x


def _identity_abstract_eval(aval, *, index):
    del index
    return aval


def _identity_batcher(prim):
    def rule(args, dims, *, index):
        return prim.bind(args[0], index=index), dims[0]

    return rule


for _p in TAG_PRIMITIVES:
    _p.def_impl(_identity_impl)
    _p.def_abstract_eval(_identity_abstract_eval)
    C.primitive_batchers[_p] = _identity_batcher(_p)
    C.register_lowering(_p, C.lower_fun(lambda x, index: x, multiple_results=False))


def _param_tag_jvp(primals, tangents, *, index):
    (x,), (t,) = primals, tangents
    out = param_tag_p.bind(x, index=index)
    if type(t) is C.Zero:
        return out, t
    return out, tangent_tag_p.bind(t, index=index)


C.primitive_jvps[param_tag_p] = _param_tag_jvp
C.deflinear2(tangent_tag_p, lambda ct, x, *, index: [grad_tag_p.bind(C.instantiate_zeros(ct), index=index)])
C.deflinear2(grad_tag_p, lambda ct, x, *, index: [tangent_tag_p.bind(C.instantiate_zeros(ct), index=index)])


def tag_param(x, index: int):
    """Mark ``x`` as parameter leaf ``index`` (identity)."""
    return param_tag_p.bind(x, index=index)
