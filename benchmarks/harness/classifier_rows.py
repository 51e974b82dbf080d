"""The rows of ``pockjax bench --workload mobilenetv2`` and ``--workload minilm``.

Each row fine-tunes a pretrained classifier, in its own process (run by
:mod:`benchmarks.harness.worker`, as the LLaMA rows of :mod:`benchmarks.harness.rows`),
on the same batches, with Adam (betas 0.9/0.999, eps 1e-8, no weight decay) and
the mean cross-entropy over the labels:

``mobilenetv2`` (MobileNetV2, torchvision's ImageNet weights, a fresh 10-way
head; MNIST-5k resized to ``image_size`` and ImageNet-normalised):

=====================  =========  ============================================
row                    framework  what it trains and how
=====================  =========  ============================================
torch-full             torch      torchvision ``mobilenet_v2``, every parameter
torch-bias-only        torch      pockjax's ``bias-only`` tensors via ``requires_grad``
torch-last-blocks      torch      pockjax's ``last-blocks`` tensors via ``requires_grad``
tf-keras-full          tf         ``keras.applications.MobileNetV2`` with the same
                                  weights, every parameter (if TensorFlow is in
                                  ``.venv/tf-ref``: see :func:`tf_ref_dir`)
jax-full               jax        ``nnx.jit`` of :func:`~pockjax.train.classify.classify_train_step`,
                                  ``nnx.Optimizer`` over every parameter
pockjax-full           pockjax    ``pockjax.compile`` of the same step, scheme ``full``
pockjax-paper          pockjax    scheme ``paper``
pockjax-channels       pockjax    scheme ``channels`` (half the expand convs' channels)
pockjax-paper-iree     pockjax    scheme ``paper``, compiled by IREE for ``cpu``
=====================  =========  ============================================

``minilm`` (sentence-transformers' all-MiniLM-L6-v2, mean pooling, dropout and
a fresh linear head; ``tweet_polarity`` tokenised to ``seq`` tokens):
``torch-full`` (transformers ``BertModel`` + mean pooling + head), ``torch-lora``
(PEFT LoRA rank 8 on query/key/value/attention-output dense, the head trained),
``jax-full``, ``pockjax-full``, ``pockjax-paper``, ``pockjax-bias-only``.

The PyTorch and TensorFlow rows import neither JAX nor pockjax's models: what
they need from pockjax (the weights' path, the trainable tensor names) comes in
the job, worked out by :func:`prepare` in the parent process. Every row's
process imports only its own framework (and NumPy), so its peak RSS is its own.
torchvision comes from :func:`benchmarks.harness.torchvision_ref.import_torchvision`
only (the text rows, which import ``transformers``, never touch it).

Importing this module imports neither JAX nor PyTorch.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from benchmarks.harness.common import (BenchError, WarmMark, median, proc_peak_rss, timed_steps,
                                       trim_heap)
from benchmarks.harness.rows import Row

__all__ = ["WORKLOADS", "CLASSIFIER_ROWS", "ClassifierBenchConfig", "default_classifier_rows", "prepare",
           "run_classifier_row", "tf_ref_dir"]

#: The workloads of this module: (model, task, classes' unit).
WORKLOADS = {
    "mobilenetv2": {"model": "mobilenetv2", "task": "mnist5k", "unit": "images"},
    "minilm": {"model": "all-minilm-l6-v2", "task": "tweet_polarity", "unit": "tokens"},
}

CLASSIFIER_ROWS: dict[str, dict[str, Row]] = {
    "mobilenetv2": {r.name: r for r in [
        Row("torch-full", "torch", "full", "PyTorch + torchvision, full fine-tuning"),
        Row("torch-bias-only", "torch", "bias-only", "PyTorch, BatchNorm biases + head (requires_grad)"),
        Row("torch-last-blocks", "torch", "last-blocks", "PyTorch, last blocks + head (requires_grad)"),
        Row("tf-keras-full", "tf", "full", "TensorFlow/Keras, full fine-tuning", cpu_only=True),
        Row("jax-full", "jax", "full", "plain JAX (nnx.jit + optax), full fine-tuning"),
        Row("pockjax-full", "pockjax", "full", "pockjax, full fine-tuning"),
        Row("pockjax-paper", "pockjax", "paper", "pockjax, paper sparse scheme"),
        Row("pockjax-channels", "pockjax", "channels", "pockjax, paper tensors, half the channels"),
        Row("pockjax-paper-iree", "pockjax", "paper", "pockjax, paper scheme, IREE cpu", target="cpu"),
    ]},
    "minilm": {r.name: r for r in [
        Row("torch-full", "torch", "full", "PyTorch + transformers, full fine-tuning"),
        Row("torch-lora", "torch", "lora", "PyTorch + PEFT LoRA rank 8 on q/k/v/attn-out, head"),
        Row("jax-full", "jax", "full", "plain JAX (nnx.jit + optax), full fine-tuning"),
        Row("pockjax-full", "pockjax", "full", "pockjax, full fine-tuning"),
        Row("pockjax-paper", "pockjax", "paper", "pockjax, paper sparse scheme"),
        Row("pockjax-bias-only", "pockjax", "bias-only", "pockjax, biases + LayerNorm scales + head"),
    ]},
}


def tf_ref_dir() -> str:
    """``<venv>/tf-ref``: where TensorFlow (CPU) is installed for the ``tf-keras-full`` row,
    outside the venv (``pip install --target .venv/tf-ref tensorflow-cpu``), so that it
    never shares a process, or a dependency resolution, with JAX or PyTorch."""
    return os.path.join(sys.prefix, "tf-ref")


def default_classifier_rows(workload: str, device: str = "cpu") -> tuple[str, ...]:
    """The rows a run of ``workload`` takes by default: all, less the TensorFlow row when
    TensorFlow is not installed in :func:`tf_ref_dir`, and on ``gpu`` the rows that run on
    the CPU only (IREE's ``cpu`` target; ``tensorflow-cpu``).

    Example:
        >>> "pockjax-paper-iree" in default_classifier_rows("mobilenetv2", "gpu")
        False
        >>> default_classifier_rows("minilm")[:2]
        ('torch-full', 'torch-lora')
    """
    rows = CLASSIFIER_ROWS[workload]
    out = []
    for name, row in rows.items():
        if row.framework == "tf" and not os.path.isdir(os.path.join(tf_ref_dir(), "tensorflow")):
            continue
        if device != "cpu" and (row.options.get("target") == "cpu" or row.options.get("cpu_only")):
            continue  # IREE's cpu target; tensorflow-cpu
        out.append(name)
    return tuple(out)


@dataclasses.dataclass
class ClassifierBenchConfig:
    """The settings of a classifier benchmark (the flags of ``pockjax bench --workload``).

    Attributes:
      workload: ``mobilenetv2`` or ``minilm`` (:data:`WORKLOADS`).
      device: ``cpu`` or ``gpu`` (as :class:`benchmarks.harness.common.BenchConfig`).
      batch: Examples per step (default 32 images, 16 texts).
      image_size: Image height and width (mobilenetv2).
      seq: Tokens per text (minilm; every text padded or cut to it).
      warmup, steps: Untimed and timed steps of every speed-phase process.
      quality_steps: Fine-tuning steps of the quality phase (0: none); the
        held-out accuracy of the ``eval_examples`` fixed test examples follows.
      lr, sparse_lr, lora_lr: Adam learning rates of the full, the sparse
        (scheme or ``requires_grad``) and the LoRA rows (default: 1e-3 for every
        mobilenetv2 row, as ``pockjax finetune``; for minilm 1e-4 full, 1e-3
        sparse and LoRA).
      lora_rank: LoRA rank (alpha = 2 x rank).
      threads: PyTorch intra-op threads (None: every core).
      seed: Data, batch order and head initialisation.
    """

    workload: str = "mobilenetv2"
    device: str = "cpu"
    batch: int | None = None
    image_size: int = 224
    seq: int = 128
    warmup: int = 2
    steps: int = 3
    quality_steps: int = 0
    eval_examples: int = 500
    lr: float | None = None
    sparse_lr: float = 1e-3
    lora_lr: float = 1e-3
    lora_rank: int = 8
    threads: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise BenchError(f"unknown workload {self.workload!r}; workloads: llama, {', '.join(WORKLOADS)}")
        if self.batch is None:
            self.batch = 32 if self.workload == "mobilenetv2" else 16
        if self.lr is None:
            self.lr = 1e-3 if self.workload == "mobilenetv2" else 1e-4
        if min(self.batch, self.image_size, self.seq, self.steps) < 1 or self.warmup < 0 \
                or self.quality_steps < 0 or self.eval_examples < 1:
            raise BenchError("batch, image size, seq, steps and eval examples must be >= 1, warmup and"
                             " quality steps >= 0")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ClassifierBenchConfig":
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def row_lr(self, kind: str) -> float:
        return self.lr if kind == "full" else self.lora_lr if kind == "lora" else self.sparse_lr

    @property
    def items_per_step(self) -> int:
        """Images, or tokens, of one step (what the throughput counts)."""
        return self.batch * (self.seq if self.workload == "minilm" else 1)


# -- the data (in the parent process) ------------------------------------------------------------


def _batch_indices(n: int, batch: int, steps: int, seed: int) -> np.ndarray:
    """``(steps, batch)`` indices into ``n`` examples, shuffled, reshuffled every epoch."""
    if n < batch:
        raise BenchError(f"batch {batch} is larger than the {n} training examples")
    rng = np.random.default_rng(seed)
    per_epoch = n // batch
    out = []
    while len(out) < steps:
        order = rng.permutation(n)
        out += [order[i * batch:(i + 1) * batch] for i in range(per_epoch)]
    return np.stack(out[:steps]).astype(np.int32)


def _minilm_hf_dir(out: str) -> str:
    """all-MiniLM-L6-v2's ``config.json`` and ``model.safetensors``, unpacked from the zip
    pockjax reads into ``out/minilm-hf`` (for ``transformers``' ``from_pretrained``)."""
    import zipfile

    from pockjax.io.atomic import atomic_directory
    from pockjax.models.bert import pretrained_path

    path, dest = pretrained_path("all-minilm-l6-v2"), os.path.join(out, "minilm-hf")
    with atomic_directory(dest) as tmp:
        if os.path.isdir(path):
            import shutil

            for name in ("config.json", "model.safetensors"):
                shutil.copy(os.path.join(path, name), os.path.join(tmp, name))
        else:
            with zipfile.ZipFile(path) as z:
                for name in ("config.json", "model.safetensors"):
                    member = min((m for m in z.namelist() if m == name or m.endswith("/" + name)),
                                 key=lambda m: m.count("/"))
                    with z.open(member) as src, open(os.path.join(tmp, name), "wb") as dst:
                        dst.write(src.read())
    return dest


def prepare(cfg: ClassifierBenchConfig, out: str) -> dict:
    """Writes the data every row reads (``out/data-classifier.npz``) and returns what the
    jobs carry: the paths, the classes and, for the PyTorch rows, the trainable tensors.

    The npz holds the training pool (native-size images in ``[0, 1]``, or token ids and
    masks), its labels, the speed phase's batches (``speed``: indices), the quality
    phase's (``quality``) and the fixed held-out examples (``eval_*``). Images are resized
    and normalised in the rows (:func:`_vision_inputs`), the same way in each.
    """
    from pockjax.io.atomic import atomic_open
    from pockjax.schemes import get_scheme
    from pockjax.scheme import Frozen

    w = WORKLOADS[cfg.workload]
    arrays: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {"task": w["task"]}
    if cfg.workload == "mobilenetv2":
        from pockjax.data.vision import load_vision_task
        from pockjax.models.mobilenetv2 import MobileNetV2Config, pretrained_path, torch_to_pockjax

        s = load_vision_task(w["task"], seed=cfg.seed, image_size=28)  # MNIST's own size
        arrays.update(train_x=s.train_images.astype(np.float32), eval_x=s.test_images.astype(np.float32))
        tr_y, te_y, classes = s.train_labels, s.test_labels, s.class_names
        config = MobileNetV2Config(num_classes=len(classes))
        info["weights"] = pretrained_path()
        params = [(t, p) for t, p, k in torch_to_pockjax(config)
                  if k != "counter" and not p.endswith((".mean", ".var"))]
        from pockjax.io.torch_checkpoint import read_torch_checkpoint

        weights_npz = os.path.join(out, "mobilenetv2-weights.npz")  # for the TensorFlow row (no torch there)
        with atomic_open(weights_npz, "wb") as f:
            np.savez(f, **{k: np.asarray(v) for k, v in read_torch_checkpoint(info["weights"]).items()})
        info["weights_npz"] = weights_npz
    else:
        from pockjax.data.text_classification import load_text_task
        from pockjax.models.bert import pretrained_path, read_checkpoint
        from pockjax.models.bert.pretrained import _hf_name

        s = load_text_task(w["task"], seed=cfg.seed)
        config, _, tokenizer, _ = read_checkpoint(pretrained_path(w["model"]))
        config = config.replace(num_classes=len(s.class_names))
        ids, mask = tokenizer.encode_batch(list(s.train_texts), cfg.seq, pad_to_max=True)
        eids, emask = tokenizer.encode_batch(list(s.test_texts), cfg.seq, pad_to_max=True)
        arrays.update(train_ids=np.asarray(ids, np.int32), train_mask=np.asarray(mask, np.int32),
                      eval_ids=np.asarray(eids, np.int32), eval_mask=np.asarray(emask, np.int32))
        tr_y, te_y, classes = s.train_labels, s.test_labels, s.class_names
        info["hf_dir"] = _minilm_hf_dir(out)
        from pockjax.models.bert import expected_shapes

        params = [(_hf_name(p), p) for p in expected_shapes(config)]
    # the tensors each torch row's scheme trains, by torch name (the head is the row's own)
    info["trainable"] = {}
    for row in CLASSIFIER_ROWS[cfg.workload].values():
        if row.framework == "torch" and row.kind not in ("full", "lora"):
            scheme = get_scheme(row.kind, config)
            info["trainable"][row.kind] = [t for t, p in params
                                           if not isinstance(scheme.rule_for(p)[0], Frozen)]
    eval_idx = np.random.default_rng(cfg.seed + 1).permutation(len(te_y))[:cfg.eval_examples]
    for k in [k for k in arrays if k.startswith("eval_")]:
        arrays[k] = arrays[k][eval_idx]
    arrays.update(train_y=np.asarray(tr_y, np.int32), eval_y=np.asarray(te_y, np.int32)[eval_idx],
                  speed=_batch_indices(len(tr_y), cfg.batch, cfg.warmup + cfg.steps, cfg.seed),
                  quality=_batch_indices(len(tr_y), cfg.batch, max(cfg.quality_steps, 1), cfg.seed + 2))
    path = os.path.join(out, "data-classifier.npz")
    with atomic_open(path, "wb") as f:
        np.savez(f, **arrays)
    info.update(data=path, classes=list(classes), eval_examples=int(len(eval_idx)))
    return info


# -- the data (in a row's process) ------------------------------------------------------------------


_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_STD = np.array([0.229, 0.224, 0.225], np.float32)


def _vision_inputs(x: np.ndarray, size: int) -> np.ndarray:
    """Native ``[0, 1]`` NHWC images resized to ``size`` (pockjax's bilinear resize, as
    :func:`pockjax.data.vision.load_vision_task`) and ImageNet-normalised (as
    :func:`pockjax.models.mobilenetv2.normalize`): float32 NHWC."""
    from pockjax.data.vision import resize_images  # NumPy only

    if x.shape[1] != size:
        x = np.clip(resize_images(x, size), 0.0, 1.0)
    return ((x - _MEAN) / _STD).astype(np.float32)


class _Data:
    """The npz of :func:`prepare`, handing out one phase's batches as NumPy tuples
    ``(*inputs, labels)`` (NHWC images, or ids and mask)."""

    def __init__(self, job: dict):
        with np.load(job["data"]) as z:
            self.a = {k: z[k] for k in z.files}
        self.cfg = ClassifierBenchConfig.from_dict(job["config"])
        self.idx = self.a[job["phase"]]
        if job["phase"] == "quality":
            self.idx = self.idx[:self.cfg.quality_steps]

    def __len__(self) -> int:
        return len(self.idx)

    def _inputs(self, prefix: str, idx) -> tuple:
        if self.cfg.workload == "mobilenetv2":
            return (_vision_inputs(self.a[f"{prefix}_x"][idx], self.cfg.image_size),)
        return self.a[f"{prefix}_ids"][idx], self.a[f"{prefix}_mask"][idx]

    def batch(self, i: int) -> tuple:
        idx = self.idx[i % len(self.idx)]
        return (*self._inputs("train", idx), self.a["train_y"][idx])

    def eval_batches(self, size: int = 64):
        n = len(self.a["eval_y"])
        for s in range(0, n, size):
            sl = slice(s, min(n, s + size))
            yield (*self._inputs("eval", sl), self.a["eval_y"][sl])


def _train_and_measure(job: dict, data: _Data, step: Callable[[tuple], float], prepare_batch: Callable,
                       accuracy: Callable[[], float], setup_s: float, extra: dict) -> dict:
    """The common loop of every row: the speed phase's batches converted before timing
    (``prepare_batch``), ``warmup`` + ``steps`` steps through :func:`timed_steps` with the
    heap trimmed and the RSS peak reset after warm-up; the quality phase's batches
    converted as they come, then ``accuracy()`` on the held-out examples."""
    cfg = data.cfg
    speed = job["phase"] == "speed"
    process_peak = proc_peak_rss()
    ready = [prepare_batch(data.batch(i)) for i in range(len(data))] if speed else None
    trim_heap()
    warm = WarmMark()

    def run(i):
        return step(ready[i] if speed else prepare_batch(data.batch(i)))

    n_warm, n_timed = (cfg.warmup, cfg.steps) if speed else (0, len(data))
    times, losses = timed_steps(run, n_warm, n_timed, on_warm=warm if speed else None)
    out = {"row": job["row"], "phase": job["phase"], "step_times": times, "losses": losses,
           "setup_s": setup_s, "train_peak_rss": proc_peak_rss(), "rss_before_train": warm.rss_before_train(),
           "process_peak_rss": max(process_peak, proc_peak_rss()), **extra}
    if not speed:
        out["accuracy"] = float(accuracy())
        out["eval_examples"] = int(len(data.a["eval_y"]))
    return out


# -- PyTorch -------------------------------------------------------------------------------------------


def _torch_model(job: dict, cfg: ClassifierBenchConfig):
    """``(module, forward(*inputs) -> logits)`` of the workload, pretrained, fresh head."""
    import torch

    n = len(job["classes"])
    if cfg.workload == "mobilenetv2":
        from benchmarks.harness.torchvision_ref import import_torchvision

        tv = import_torchvision()
        model = tv.models.mobilenet_v2()
        model.load_state_dict(torch.load(job["weights"], map_location="cpu", weights_only=True))
        model.classifier[1] = torch.nn.Linear(model.classifier[1].in_features, n)
        return model, lambda x: model(x)
    from transformers import BertModel

    class Classifier(torch.nn.Module):  # BertModel, mean pooling over the mask, dropout, linear head
        def __init__(self):
            super().__init__()
            self.bert = BertModel.from_pretrained(job["hf_dir"], add_pooling_layer=False, dtype=torch.float32)
            self.dropout = torch.nn.Dropout(self.bert.config.hidden_dropout_prob)
            self.head = torch.nn.Linear(self.bert.config.hidden_size, n)

        def forward(self, ids, mask):
            h = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return self.head(self.dropout(pooled))

    model = Classifier()
    return model, lambda ids, mask: model(ids, mask)


def torch_row(job: dict) -> dict:
    """Fine-tunes with PyTorch: every parameter, a ``requires_grad`` subset, or PEFT LoRA."""
    import torch

    cfg = ClassifierBenchConfig.from_dict(job["config"])
    kind = job["kind"]
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.set_flush_denormal(True)  # as XLA's CPU runtime (see benchmarks.harness.rows.torch_row)
    torch.manual_seed(cfg.seed)
    dev = torch.device("cuda" if cfg.device == "gpu" else "cpu")
    if cfg.device == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    model, forward = _torch_model(job, cfg)
    head = model.classifier[1] if cfg.workload == "mobilenetv2" else model.head
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0, bias="none",
                          target_modules=["query", "key", "value", "attention.output.dense"])
        model.bert = get_peft_model(model.bert, lora)  # freezes the encoder but its adapters
    elif kind != "full":
        names = set(job["trainable"][kind])
        seen = set()
        for name, p in model.named_parameters():
            p.requires_grad_(name in names)
            seen.add(name)
        if names - seen:
            raise ValueError(f"the scheme names tensors the model lacks: {sorted(names - seen)[:3]}")
    for p in head.parameters():
        p.requires_grad_(True)
    model.to(dev).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trainable, lr=cfg.row_lr(kind), betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    data = _Data(job)
    setup_s = time.perf_counter() - t0

    def to_torch(b):
        arrs = [np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if x.ndim == 4 else x for x in b]
        return [torch.from_numpy(a).to(dev).long() if a.dtype.kind == "i" else torch.from_numpy(a).to(dev)
                for a in arrs]

    def step(b):
        *inputs, y = b
        loss = torch.nn.functional.cross_entropy(forward(*inputs), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    def accuracy():
        model.eval()
        right = 0
        with torch.no_grad():
            for b in data.eval_batches():
                *inputs, y = to_torch(b)
                right += int((forward(*inputs).argmax(-1) == y).sum())
        return right / len(data.a["eval_y"])

    extra = {"trainable_params": sum(p.numel() for p in trainable),
             "total_params": sum(p.numel() for p in model.parameters())}
    out = _train_and_measure(job, data, step, to_torch, accuracy, setup_s, extra)
    if cfg.device == "gpu":
        out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    return out


# -- TensorFlow / Keras --------------------------------------------------------------------------------


def _keras_load_torchvision(model, weights: dict) -> None:
    """Copies torchvision's MobileNetV2 tensors into ``keras.applications.MobileNetV2``
    (``include_top=False``): the convolutions and BatchNorms of both come in the same
    order (OIHW kernels to HWIO, depthwise ``(C, 1, 3, 3)`` to ``(3, 3, C, 1)``)."""
    import keras

    convs = [k[:-len(".weight")] for k in weights if k.startswith("features.") and weights[k].ndim == 4]
    bns = [k[:-len(".running_mean")] for k in weights if k.endswith(".running_mean")]
    k_convs = [layer for layer in model.layers
               if isinstance(layer, (keras.layers.Conv2D, keras.layers.DepthwiseConv2D))]
    k_bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    if len(convs) != len(k_convs) or len(bns) != len(k_bns):
        raise ValueError(f"torchvision has {len(convs)} convs / {len(bns)} BatchNorms, Keras"
                         f" {len(k_convs)} / {len(k_bns)}")
    for name, layer in zip(convs, k_convs):
        w = weights[name + ".weight"]
        w = w.transpose(2, 3, 0, 1) if isinstance(layer, keras.layers.DepthwiseConv2D) else w.transpose(2, 3, 1, 0)
        layer.set_weights([w])
    for name, layer in zip(bns, k_bns):
        layer.set_weights([weights[f"{name}.{k}"] for k in ("weight", "bias", "running_mean", "running_var")])


def tf_row(job: dict) -> dict:
    """Fine-tunes ``keras.applications.MobileNetV2`` (every parameter) with TensorFlow,
    from :func:`tf_ref_dir` (appended to ``sys.path``, so the venv's NumPy is kept)."""
    if not os.path.isdir(os.path.join(tf_ref_dir(), "tensorflow")):
        raise BenchError(f"TensorFlow is not installed in {tf_ref_dir()}; install it with"
                         f" `pip install --target {tf_ref_dir()} tensorflow-cpu`")
    sys.path.append(tf_ref_dir())
    import tensorflow as tf

    cfg = ClassifierBenchConfig.from_dict(job["config"])
    tf.random.set_seed(cfg.seed)
    t0 = time.perf_counter()
    with np.load(job["weights_npz"]) as z:
        weights = {k: z[k] for k in z.files}
    s = cfg.image_size
    base = tf.keras.applications.MobileNetV2(weights=None, input_shape=(s, s, 3), include_top=False,
                                             pooling="avg")
    _keras_load_torchvision(base, weights)
    inp = tf.keras.Input((s, s, 3))
    logits = tf.keras.layers.Dense(len(job["classes"]))(tf.keras.layers.Dropout(0.2)(base(inp)))
    model = tf.keras.Model(inp, logits)
    opt = tf.keras.optimizers.Adam(cfg.lr, beta_1=0.9, beta_2=0.999, epsilon=1e-8)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)
    def train(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    data = _Data(job)
    setup_s = time.perf_counter() - t0

    def accuracy():
        right = sum(int(np.sum(np.argmax(model(x, training=False).numpy(), -1) == y))
                    for x, y in data.eval_batches())
        return right / len(data.a["eval_y"])

    extra = {"trainable_params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
             "versions": {"tensorflow": tf.__version__}}
    return _train_and_measure(job, data, lambda b: float(train(*b)),
                              lambda b: tuple(tf.convert_to_tensor(x) for x in b), accuracy, setup_s, extra)


# -- JAX and pockjax ---------------------------------------------------------------------------------


def _jax_model(job: dict, cfg: ClassifierBenchConfig):
    from flax import nnx

    rngs = nnx.Rngs(cfg.seed, dropout=cfg.seed + 1)
    n = len(job["classes"])
    if cfg.workload == "mobilenetv2":
        from pockjax.models import mobilenetv2

        model = mobilenetv2.load_pretrained(num_classes=n, rngs=rngs)
    else:
        from pockjax.models import bert

        model, _ = bert.load_pretrained(WORKLOADS[cfg.workload]["model"], num_classes=n, rngs=rngs)
    model.train()
    return model


def jax_row(job: dict) -> dict:
    """Plain JAX: ``nnx.jit`` of :func:`classify_train_step`, ``nnx.Optimizer`` over every
    parameter (``pockjax-*``: :func:`pockjax.compile` of the same step with the row's
    scheme, and ``target`` for IREE)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax
    from pockjax.train.classify import classify_train_step, evaluate_classifier, resolve_classifier_scheme

    cfg = ClassifierBenchConfig.from_dict(job["config"])
    row = CLASSIFIER_ROWS[cfg.workload][job["row"]]
    t0 = time.perf_counter()
    model = _jax_model(job, cfg)
    tx = optax.adam(cfg.row_lr(job["kind"]), b1=0.9, b2=0.999, eps=1e-8)
    extra: dict[str, Any] = {}
    if row.framework == "jax":
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = nnx.jit(classify_train_step)
        trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    else:
        scheme = resolve_classifier_scheme(job["kind"], model.config)
        opt = nnx.Optimizer(model, tx, wrt=scheme.nnx_wrt())
        step = pockjax.compile(classify_train_step, scheme=scheme, target=row.options.get("target"))
        trainable = scheme.describe(nnx.state(model, nnx.Param)).trainable
        extra["scheme"] = scheme.name
    data = _Data(job)
    to_jax = lambda b: [jnp.asarray(x) for x in b]  # noqa: E731
    if row.framework == "pockjax":  # compile ahead, timed apart (the jit rows compile in their first step)
        tc = time.perf_counter()
        step.lower(model, opt, *to_jax(data.batch(0))).compile()
        extra["compile_s"] = time.perf_counter() - tc
    setup_s = time.perf_counter() - t0

    def accuracy():
        inputs = [np.concatenate(parts) for parts in zip(*[b[:-1] for b in data.eval_batches()])]
        return evaluate_classifier(model, inputs, data.a["eval_y"], batch_size=64)

    extra["trainable_params"] = int(trainable)
    out = _train_and_measure(job, data, lambda b: float(step(model, opt, *b)), to_jax, accuracy, setup_s, extra)
    if cfg.device == "gpu":
        out["device_peak_bytes"] = int((jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0))
    return out


_RUNNERS: dict[str, Callable[[dict], dict]] = {"torch": torch_row, "tf": tf_row, "jax": jax_row,
                                               "pockjax": jax_row}


def run_classifier_row(job: dict) -> dict:
    """Runs the row ``job["row"]`` of ``job["workload"]`` (a job of
    :mod:`benchmarks.harness.classifier_runner`)."""
    rows = CLASSIFIER_ROWS[job["workload"]]
    if job["row"] not in rows:
        raise ValueError(f"unknown {job['workload']} row {job['row']!r}; rows: {', '.join(rows)}")
    row = rows[job["row"]]
    return _RUNNERS[row.framework]({**job, "kind": row.kind})


def speed_summary(raw: list[dict], cfg: ClassifierBenchConfig) -> dict:
    """Per row: the median step time over every process, throughput, the largest
    training peak RSS (and GPU memory), trainable parameters, errors."""
    speed: dict[str, dict] = {}
    for r in raw:
        if r.get("phase") != "speed":
            continue
        s = speed.setdefault(r["row"], {"step_times": [], "train_peak_rss": 0, "errors": [], "processes": 0})
        if "error" in r:
            s["errors"].append(r["error"])
            continue
        s["processes"] += 1
        s["step_times"] += r["step_times"]
        s["train_peak_rss"] = max(s["train_peak_rss"], r["train_peak_rss"])
        for key in ("trainable_params", "total_params", "scheme"):
            if r.get(key) is not None:
                s[key] = r[key]
        if r.get("compile_s") is not None:
            s.setdefault("compile_s", []).append(r["compile_s"])
        if r.get("device_peak_bytes") is not None:
            s["device_peak_bytes"] = max(s.get("device_peak_bytes", 0), r["device_peak_bytes"])
    for s in speed.values():
        s["step_s"] = median(s["step_times"])
        s["per_s"] = cfg.items_per_step / s["step_s"] if s["step_times"] else None  # None: no step ran
        s[f"{WORKLOADS[cfg.workload]['unit']}_per_s"] = s["per_s"]  # images_per_s or tokens_per_s
    ref = speed.get("torch-full", {})
    for s in speed.values():
        s["speedup_vs_torch_full"] = (ref["step_s"] / s["step_s"]
                                      if ref.get("step_times") and s["step_times"] else None)
    return speed
