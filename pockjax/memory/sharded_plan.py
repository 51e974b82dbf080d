"""Per-device memory of a partitioned LLaMA step, from XLA's memory analysis.

:func:`plan_llama_per_device` compiles the fine-tuning step for a device mesh
from shapes alone (``jax.ShapeDtypeStruct`` arguments annotated with their
shardings, nothing allocated) and reads ``memory_analysis()`` of the
partitioned program: the bytes one device holds for its arguments (its
slice of parameters, optimizer state and batch), its outputs and its
temporaries. A 7B model is too slow to compile whole on a small CPU, so the
step is compiled at reduced depths and each figure fitted as a line in the
number of frozen and trained blocks (every block of a LLaMA is the same but
for its rule), then evaluated at the full depth. ``check=True`` compiles one
more reduced depth and reports how far the fit misses it.

The figures are those of the platform the process compiles for (a CPU here):
arguments are exact everywhere, temporaries depend on the backend's fusion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

__all__ = ["DeviceMemory", "PerDevicePlan", "plan_llama_per_device"]


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's bytes in a compiled partitioned step (``memory_analysis()``)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def peak(self) -> int:
        """Arguments, temporaries and the outputs that do not reuse a donated argument."""
        return self.arguments + self.temporaries + self.outputs - self.aliased

    @classmethod
    def of(cls, compiled: Any) -> "DeviceMemory":
        m = compiled.memory_analysis()
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                   int(m.temp_size_in_bytes))

    def extrapolate(self, other: "DeviceMemory", at: int, other_at: int, to: int) -> "DeviceMemory":
        """The linear extrapolation in depth through ``self`` (``at`` blocks) and ``other``."""
        def line(a: int, b: int) -> int:
            return round(a + (b - a) * (to - at) / (other_at - at))

        return DeviceMemory(*(line(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)))


@dataclasses.dataclass
class PerDevicePlan:
    """What :func:`plan_llama_per_device` found.

    Attributes:
      mesh: the mesh's axis sizes (``{"fsdp": 8}``).
      layers: the depth planned (the config's).
      per_device: one device's bytes at that depth (extrapolated).
      compiled: ``{"frozen+trained": DeviceMemory}`` of each reduced depth compiled.
      check_error: with ``check=True``: relative error of the fitted peak at
        the check depth against its compile (None otherwise).
    """

    mesh: dict
    layers: int
    per_device: DeviceMemory
    compiled: dict
    check_error: float | None = None


def _placed_step(config: Any, scheme_name: str, mesh: Any, *, dtype: Any, batch: int, seq: int, blocks: int | None):
    import pockjax
    from pockjax.memory.llama_plan import abstract_llama_step
    from pockjax.sharding import shard_batch, shard_train_state

    w = abstract_llama_step(config, scheme_name, dtype=dtype, batch=batch, seq=seq, blocks=blocks)
    params, opt_state, b = w.args
    params, opt_state = shard_train_state(params, opt_state, mesh)
    b = shard_batch(b, mesh)
    step = pockjax.compile(w.step, scheme=w.scheme)
    return step.lower(params, opt_state, b).compile()


def _blockwise(scheme: str, config: Any) -> bool:
    """Whether ``scheme`` trains the last ``blocks`` blocks (its rules change with ``blocks``)."""
    from pockjax.schemes import resolve_scheme

    c = config.slice_layers(0, 4)
    return resolve_scheme(scheme, c, blocks=1).rules != resolve_scheme(scheme, c, blocks=2).rules


def _fit(points: dict, fields: list[str]) -> dict:
    """Per field, ``value = a + f * frozen + t * trained`` through three (frozen, trained) points."""
    import numpy as np

    keys = list(points)
    A = np.array([[1.0, f, t] for f, t in keys])
    return {name: np.linalg.solve(A, np.array([getattr(points[k], name) for k in keys], float)) for name in fields}


def plan_llama_per_device(config: Any, scheme: str = "full", *, mesh: str = "fsdp=8", dtype: Any = jnp.bfloat16,
                          batch: int = 8, seq: int = 512, blocks: int | None = None,
                          check: bool = False) -> PerDevicePlan:
    """One device's memory for a fine-tuning step of ``config`` partitioned over ``mesh``.

    The step is compiled at reduced depths and each field of
    ``memory_analysis()`` fitted as ``a + f * frozen blocks + t * trained
    blocks`` (schemes that train the last blocks: depths 2, 3, 3 with 1, 1, 2
    trained blocks) or ``a + b * blocks`` (schemes the same for every block:
    depths 2 and 3), then evaluated at the config's depth.

    Args:
      config: a :class:`~pockjax.models.llama.LlamaConfig` (its ``n_layers`` is the depth planned).
      scheme: a scheme name of :mod:`pockjax.schemes` (``full``, ``paper``...).
      mesh: ``"fsdp=8"``, ``"data=8"``, ``"data=2,fsdp=4"`` (see :func:`pockjax.sharding.make_mesh`).
      dtype: parameters' dtype (and AdamW's moments').
      batch, seq: the global token batch (split over the mesh's data axes).
      blocks: ``--blocks`` of block-wise schemes (default: the scheme's for the full depth).
      check: compile depth 4 (2 trained blocks for block-wise schemes) too, and
        report the fit's relative error of the peak there.

    Example (not run: compiles four reduced 7B steps, minutes on 2 cores)::

      r = plan_llama_per_device(LlamaConfig.llama2_7b(), "paper", mesh="fsdp=8", check=True)
      print(r.per_device.peak / 2**30, r.check_error)
    """
    from pockjax.schemes import paper_blocks
    from pockjax.sharding import make_mesh

    m = make_mesh(mesh)
    fields = [f.name for f in dataclasses.fields(DeviceMemory)]
    blockwise = _blockwise(scheme, config)
    # (frozen blocks, trained blocks) of each compile
    points = [(1, 1), (2, 1), (1, 2)] if blockwise else [(0, 2), (0, 3)]
    if check:
        points.append((2, 2) if blockwise else (0, 4))
    compiled = {}
    for frozen, trained in points:
        c = _placed_step(config.slice_layers(0, frozen + trained), scheme, m, dtype=dtype, batch=batch, seq=seq,
                         blocks=trained if blockwise else blocks)
        compiled[(frozen, trained)] = DeviceMemory.of(c)
        del c
    fit_points = {k: compiled[k] for k in points[:3 if blockwise else 2]}
    if blockwise:
        coef = _fit(fit_points, fields)
        k = paper_blocks(config.n_layers, blocks)

        def at(frozen: int, trained: int) -> DeviceMemory:
            return DeviceMemory(*(round(float(coef[n] @ [1.0, frozen, trained])) for n in fields))

        full = at(config.n_layers - k, k)
    else:
        (_, d0), (_, d1) = list(fit_points)

        def at(frozen: int, trained: int) -> DeviceMemory:
            return fit_points[(0, d0)].extrapolate(fit_points[(0, d1)], d0, d1, frozen + trained)

        full = at(0, config.n_layers)
    err = None
    if check:
        probe = points[-1]
        err = abs(at(*probe).peak - compiled[probe].peak) / compiled[probe].peak
    return PerDevicePlan(dict(m.shape), config.n_layers, full, {f"{f}+{t}": v for (f, t), v in compiled.items()}, err)
