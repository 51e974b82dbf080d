"""A corpus of user-style training programs (Flax Linen / NNX / TrainState / Optax).

Each program is written the way a Flax or Optax user writes a train step, with
one addition: a ``grad_hook`` applied to the gradients right after they are
computed. pockjax runs the step with the identity hook; the reference
(``jax.jit`` / ``nnx.jit``) passes a hook that zeroes the gradient of every
frozen entry (see ``tests/test_corpus.py``).

Every factory returns a :class:`Program`:

* ``make_step(grad_hook)``: the train step,
* ``init()``: fresh state arguments (``(params, opt_state)``, ``(train_state,)``
  or ``(model, optimizer)`` for NNX),
* ``batches``: one batch (a tuple of step arguments) per step,
* ``param_paths``: the dotted paths a scheme names (pockjax's parameters),
* ``grad_prefix``: the part of a scheme path that the gradient pytree does not
  carry (``"params."`` when the step takes a Linen ``variables`` dict),
* ``param_leaf_prefix`` / ``opt_leaf_prefix``: where parameters and optimizer
  state sit in ``pockjax.leaf_paths`` of the state arguments (for NNX: of
  ``nnx.state((model, optimizer))``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import pockjax

BATCH = 4
IMG = 8
CLASSES = 10
STEPS = 3


@dataclasses.dataclass
class Program:
    name: str
    # "functional": (params, opt_state, *batch); "train_state": (state, *batch);
    # "nnx": (model, optimizer, *batch)
    kind: str
    make_step: Callable[[Callable], Callable]
    init: Callable[[], tuple]
    batches: list
    param_paths: list
    grad_prefix: str = ""
    param_leaf_prefix: str = "0."
    opt_leaf_prefix: str = "1."
    stacked: str | None = None  # path of a kernel stacked on a leading layer axis
    changing: tuple = ()  # state leaf-path prefixes whose values every step must change (BN stats, counters)

    @property
    def n_state(self) -> int:
        return {"functional": 2, "train_state": 1, "nnx": 2}[self.kind]


def _keys(seed, n):
    return list(jax.random.split(jax.random.key(seed), n))


def image_batches(seed=0, steps=STEPS, dropout=False):
    out = []
    for i, k in enumerate(_keys(seed, steps)):
        kx, ky = jax.random.split(k)
        x = jax.random.normal(kx, (BATCH, IMG, IMG, 3))
        y = jax.random.randint(ky, (BATCH,), 0, CLASSES)
        out.append((x, y, jax.random.key(100 + i)) if dropout else (x, y))
    return out


def regression_batches(din, dout, seed=0, steps=STEPS, signs=None):
    out = []
    for i, k in enumerate(_keys(seed, steps)):
        kx, ky = jax.random.split(k)
        x = jax.random.normal(kx, (BATCH, din))
        if signs is not None:  # steer a data-dependent branch
            x = jnp.abs(x) * signs[i]
        out.append((x, jax.random.normal(ky, (BATCH, dout))))
    return out


def paths_of(tree, prefix=""):
    return [prefix + p for p in pockjax.leaf_paths(tree)]


def functional_step(loss_fn, tx, grad_hook):
    """The plain-JAX step: ``value_and_grad`` of ``loss_fn(params, x, y)``, the hook, then ``tx``."""

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = grad_hook(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# -- 1. Linen CNN, BatchNorm + Dropout, `variables` dict, functional step ------------------
class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)  # a bias before BatchNorm has no gradient
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Dropout(0.25, deterministic=not train)(x)
        x = nn.Conv(8, (3, 3), strides=(2, 2))(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(CLASSES)(x)


def linen_cnn_bn_dropout() -> Program:
    model = LinenCNN()
    tx = optax.adam(1e-2)

    def make_step(grad_hook):
        def train_step(variables, opt_state, x, y, dropout_key):
            def loss_fn(params):
                logits, updates = model.apply(
                    {"params": params, "batch_stats": variables["batch_stats"]},
                    x, train=True, rngs={"dropout": dropout_key}, mutable=["batch_stats"],
                )
                return xent(logits, y), updates

            (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
            grads = grad_hook(grads)
            upd, opt_state = tx.update(grads, opt_state, variables["params"])
            params = optax.apply_updates(variables["params"], upd)
            return {"params": params, "batch_stats": updates["batch_stats"]}, opt_state, loss

        return train_step

    def init():
        variables = model.init(jax.random.key(0), jnp.zeros((1, IMG, IMG, 3)), train=False)
        variables = {"params": variables["params"], "batch_stats": variables["batch_stats"]}
        return variables, tx.init(variables["params"])

    v, _ = init()
    return Program(
        "linen_cnn_bn_dropout", "functional", make_step, init, image_batches(1, dropout=True),
        paths_of(v["params"], "params."), grad_prefix="params.",
        changing=("0.batch_stats.",),
    )


# -- 2. NNX CNN, nnx.BatchNorm + nnx.Dropout, nnx.Optimizer ---------------------------------
class NNXCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.head = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.bn(self.conv1(x))))
        return self.head(x.mean(axis=(1, 2)))


def nnx_cnn_bn_dropout() -> Program:
    tx = optax.adamw(1e-2, weight_decay=1e-2)  # one transformation: nnx.jit's cache key holds it

    def make_step(grad_hook):
        def train_step(model, optimizer, x, y):
            def loss_fn(model):
                return xent(model(x), y)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            grads = grad_hook(grads)
            optimizer.update(model, grads)
            return loss

        return train_step

    def init():
        model = NNXCNN(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        return model, optimizer

    m, _ = init()
    return Program(
        "nnx_cnn_bn_dropout", "nnx", make_step, init, image_batches(2),
        paths_of(nnx.state(m, nnx.Param)), opt_leaf_prefix="1.opt_state.",
        changing=("0.bn.mean", "0.bn.var", "0.dropout.rngs.count", "1.step"),
    )


# -- 3. Linen TrainState classifier -----------------------------------------------------
class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(16)(x))
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(CLASSES)(x)


def train_state_classifier() -> Program:
    model = LinenMLP()
    tx = optax.sgd(0.05, momentum=0.9)  # made once: a TrainState's tx is part of its tree structure

    def make_step(grad_hook):
        def train_step(state, x, y):
            def loss_fn(params):
                logits = state.apply_fn({"params": params}, x)
                return xent(logits, y), logits

            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            grads = grad_hook(grads)
            state = state.apply_gradients(grads=grads)
            accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
            return state, {"loss": loss, "accuracy": accuracy}

        return train_step

    def init():
        params = model.init(jax.random.key(3), jnp.zeros((1, IMG, IMG, 3)))["params"]
        return (train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx),)

    (s,) = init()
    return Program(
        "train_state_classifier", "train_state", make_step, init, image_batches(3),
        paths_of(s.params), param_leaf_prefix="0.params.", opt_leaf_prefix="0.opt_state.", changing=("0.step",),
    )


# -- 4. TrainState subclass with batch_stats ----------------------------------------------
class BNTrainState(train_state.TrainState):
    batch_stats: Any = None


class LinenBNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.8)(x))
        x = x.mean(axis=(1, 2))
        x = nn.Dense(16, use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.8)(x))
        return nn.Dense(CLASSES)(x)


def train_state_batch_stats() -> Program:
    model = LinenBNNet()
    tx = optax.adam(1e-2)

    def make_step(grad_hook):
        def train_step(state, x, y):
            def loss_fn(params):
                logits, updates = state.apply_fn(
                    {"params": params, "batch_stats": state.batch_stats}, x, train=True, mutable=["batch_stats"]
                )
                return xent(logits, y), updates

            (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            grads = grad_hook(grads)
            state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
            return state, loss

        return train_step

    def init():
        v = model.init(jax.random.key(4), jnp.zeros((1, IMG, IMG, 3)), train=False)
        return (BNTrainState.create(apply_fn=model.apply, params=v["params"], batch_stats=v["batch_stats"],
                                    tx=tx),)

    (s,) = init()
    return Program(
        "train_state_batch_stats", "train_state", make_step, init, image_batches(4),
        paths_of(s.params), param_leaf_prefix="0.params.", opt_leaf_prefix="0.opt_state.",
        changing=("0.step", "0.batch_stats."),
    )


# -- 5 / 6. scanned stack of layers (optionally rematerialised) ------------------------------
LAYERS, WIDTH = 8, 8


def _layer_norm(h, scale):
    h = h - h.mean(-1, keepdims=True)
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5) * scale


def scanned_stack(remat: bool) -> Program:
    tx = optax.adam(1e-2)
    din, dout = 6, 4

    def init():
        k = jax.random.split(jax.random.key(5), 4)
        params = {
            "embed": {"kernel": jax.random.normal(k[0], (din, WIDTH)) / np.sqrt(din)},
            "layers": {
                "norm": {"scale": jnp.ones((LAYERS, WIDTH))},
                "mlp": {
                    "kernel": jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH),
                    "bias": 0.1 * jax.random.normal(k[2], (LAYERS, WIDTH)),
                },
            },
            "head": {"kernel": jax.random.normal(k[3], (WIDTH, dout)) / np.sqrt(WIDTH)},
        }
        return params, tx.init(params)

    def make_step(grad_hook):
        def block(h, layer):
            z = _layer_norm(h, layer["norm"]["scale"]) @ layer["mlp"]["kernel"] + layer["mlp"]["bias"]
            return h + jax.nn.gelu(z), jnp.mean(z * z)

        body = jax.checkpoint(block) if remat else block

        def loss_fn(params, x, y):
            h = x @ params["embed"]["kernel"]
            h, sq = jax.lax.scan(body, h, params["layers"])
            pred = h @ params["head"]["kernel"]
            return jnp.mean((pred - y) ** 2) + 1e-3 * sq.sum()

        return functional_step(loss_fn, tx, grad_hook)

    p, _ = init()
    return Program(
        "scan_remat_stack" if remat else "scan_stack", "functional", make_step, init,
        regression_batches(din, dout, seed=5), paths_of(p), stacked="layers.mlp.kernel",
    )


# -- 7. lax.cond inside the loss --------------------------------------------------------------
def cond_model() -> Program:
    tx = optax.adamw(1e-2, weight_decay=0.1)
    din, dout = 5, 3

    def init():
        k = jax.random.split(jax.random.key(7), 4)
        params = {
            "enc": {"kernel": jax.random.normal(k[0], (din, 8)) / np.sqrt(din), "bias": jnp.zeros(8)},
            "pos": {"kernel": jax.random.normal(k[1], (8, 8)) / np.sqrt(8)},
            "neg": {"kernel": jax.random.normal(k[2], (8, 8)) / np.sqrt(8), "bias": 0.1 * jnp.ones(8)},
            "out": {"kernel": jax.random.normal(k[3], (8, dout)) / np.sqrt(8)},
        }
        return params, tx.init(params)

    def make_step(grad_hook):
        def loss_fn(params, x, y):
            h = jnp.tanh(x @ params["enc"]["kernel"] + params["enc"]["bias"])
            h = jax.lax.cond(
                jnp.mean(x) > 0,
                lambda h: jax.nn.relu(h @ params["pos"]["kernel"]),
                lambda h: jnp.tanh(h @ params["neg"]["kernel"] + params["neg"]["bias"]),
                h,
            )
            pred = h @ params["out"]["kernel"]
            # a predicate on a parameter-dependent value, too
            return jax.lax.cond(jnp.mean(pred) > 10.0, lambda: jnp.mean(jnp.abs(pred - y)),
                                lambda: jnp.mean((pred - y) ** 2))

        return functional_step(loss_fn, tx, grad_hook)

    p, _ = init()
    return Program("lax_cond", "functional", make_step, init,
                   regression_batches(din, dout, seed=7, signs=[1.0, -1.0, 1.0]), paths_of(p))


# -- 8. jax.custom_vjp layers --------------------------------------------------------------------
@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.05, 0.05),))


@jax.custom_vjp
def custom_dense(x, w, b):
    return x @ w + b


def _custom_dense_fwd(x, w, b):
    return x @ w + b, (x, w)


def _custom_dense_bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g, g.sum(0)


custom_dense.defvjp(_custom_dense_fwd, _custom_dense_bwd)


@jax.custom_vjp
def smooth_relu(x):
    return jax.nn.softplus(x)


smooth_relu.defvjp(lambda x: (jax.nn.softplus(x), x), lambda x, g: (g * jax.nn.sigmoid(x),))


def custom_vjp_model() -> Program:
    tx = optax.adam(1e-2)
    din, dout = 6, 3

    def init():
        k = jax.random.split(jax.random.key(8), 3)
        params = {
            "dense0": {"kernel": jax.random.normal(k[0], (din, 12)) / np.sqrt(din), "bias": jnp.zeros(12)},
            "dense1": {"kernel": jax.random.normal(k[1], (12, 8)) / np.sqrt(12), "bias": 0.1 * jnp.ones(8)},
            "dense2": {"kernel": jax.random.normal(k[2], (8, dout)) / np.sqrt(8), "bias": jnp.zeros(dout)},
        }
        return params, tx.init(params)

    def make_step(grad_hook):
        def loss_fn(params, x, y):
            h = smooth_relu(custom_dense(x, params["dense0"]["kernel"], params["dense0"]["bias"]))
            h = clip_gradient(jnp.tanh(h @ params["dense1"]["kernel"] + params["dense1"]["bias"]))
            pred = custom_dense(h, params["dense2"]["kernel"], params["dense2"]["bias"])
            return jnp.mean((pred - y) ** 2)

        return functional_step(loss_fn, tx, grad_hook)

    p, _ = init()
    return Program("custom_vjp", "functional", make_step, init, regression_batches(din, dout, seed=8), paths_of(p))


# -- 9 / 10. plain JAX MLPs with Optax wrappers ------------------------------------------------
def _mlp_params(key, sizes):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, k1, k2 = jax.random.split(key, 3)
        params[f"dense{i}"] = {"kernel": jax.random.normal(k1, (a, b)) / np.sqrt(a),
                               "bias": 0.1 * jax.random.normal(k2, (b,))}
    return params


def _mlp_apply(params, x):
    n = len(params)
    for i in range(n):
        x = x @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def optax_mlp(name: str, tx_factory, sizes=(6, 16, 8, 3), steps=STEPS) -> Program:
    tx = tx_factory()

    def init():
        params = _mlp_params(jax.random.key(9), sizes)
        return params, tx.init(params)

    def make_step(grad_hook):
        def train_step(params, opt_state, x, y):
            def loss_fn(p):
                return jnp.mean((_mlp_apply(p, x) - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            grads = grad_hook(grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return train_step

    p, _ = init()
    return Program(name, "functional", make_step, init,
                   regression_batches(sizes[0], sizes[-1], seed=9, steps=steps), paths_of(p))


def multisteps_mlp() -> Program:
    return optax_mlp("multisteps_clip_adam", lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), every_k_schedule=2))


def inject_hyperparams_mlp() -> Program:
    return optax_mlp("inject_hyperparams_adamw", lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, transition_steps=4), weight_decay=0.05))


def sgd_schedule_mlp() -> Program:
    return optax_mlp("sgd_schedule", lambda: optax.sgd(
        optax.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=2, decay_steps=10), momentum=0.9))


# -- 11. an integer step counter inside params ----------------------------------------------------
def counter_in_params() -> Program:
    tx = optax.adam(1e-2)
    sizes = (6, 8, 3)

    def init():
        params = {"net": _mlp_params(jax.random.key(11), sizes), "step": jnp.zeros((), jnp.int32)}
        return params, tx.init(params["net"])

    def make_step(grad_hook):
        def train_step(params, opt_state, x, y):
            def loss_fn(net):
                scale = 1.0 + 0.1 * params["step"].astype(jnp.float32)  # the counter feeds the loss
                return scale * jnp.mean((_mlp_apply(net, x) - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params["net"])
            grads = grad_hook(grads)
            updates, opt_state = tx.update(grads, opt_state, params["net"])
            net = optax.apply_updates(params["net"], updates)
            return {"net": net, "step": params["step"] + 1}, opt_state, loss

        return train_step

    p, _ = init()
    return Program("counter_in_params", "functional", make_step, init, regression_batches(6, 3, seed=11),
                   paths_of(p["net"], "net."), grad_prefix="net.",
                   changing=("0.step",))


FACTORIES = {
    name: f
    for name, f in [
        ("linen_cnn_bn_dropout", linen_cnn_bn_dropout),
        ("nnx_cnn_bn_dropout", nnx_cnn_bn_dropout),
        ("train_state_classifier", train_state_classifier),
        ("train_state_batch_stats", train_state_batch_stats),
        ("scan_stack", lambda: scanned_stack(remat=False)),
        ("scan_remat_stack", lambda: scanned_stack(remat=True)),
        ("lax_cond", cond_model),
        ("custom_vjp", custom_vjp_model),
        ("multisteps_clip_adam", multisteps_mlp),
        ("inject_hyperparams_adamw", inject_hyperparams_mlp),
        ("sgd_schedule", sgd_schedule_mlp),
        ("counter_in_params", counter_in_params),
    ]
}
