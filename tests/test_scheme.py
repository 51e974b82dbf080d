"""UpdateScheme: patterns, rules, errors and describe()."""

import numpy as np
import pytest

import pockjax
from pockjax.scheme import ChannelSelect, Frozen, Full, glob_match

PARAMS = {
    "embed": {"embedding": np.zeros((10, 4))},
    "layers": {str(i): {"attn": {"wq": {"kernel": np.zeros((4, 4))}, "bias": np.zeros(4)},
                        "attn_norm": {"scale": np.zeros(4)}} for i in range(3)},
    "norm": {"scale": np.zeros(4)},
}


@pytest.mark.parametrize(
    "pattern,path,expected",
    [
        ("layers.*.attn.wq.kernel", "layers.2.attn.wq.kernel", True),
        ("layers.*.attn", "layers.2.attn.wq.kernel", False),
        ("layers.**", "layers.2.attn.wq.kernel", True),
        ("**.scale", "norm.scale", True),
        ("**.scale", "layers.0.attn_norm.scale", True),
        ("**.*norm*.scale", "norm.scale", True),
        ("layers.[01].**", "layers.2.attn.wq.kernel", False),
        ("layers.[01].**", "layers.1.attn.wq.kernel", True),
        ("layers.?.attn.bias", "layers.1.attn.bias", True),
    ],
)
def test_glob(pattern, path, expected):
    assert glob_match(pattern, path) is expected


def test_first_match_wins_and_default():
    scheme = pockjax.UpdateScheme([("layers.0.**", "frozen"), ("layers.**", "full")], default="frozen")
    rules = dict(zip(pockjax.leaf_paths(PARAMS), scheme.resolve_tree(PARAMS)))
    assert isinstance(rules["layers.0.attn.wq.kernel"], Frozen)
    assert isinstance(rules["layers.1.attn.wq.kernel"], Full)
    assert isinstance(rules["embed.embedding"], Frozen)


def test_bias_only_and_norm_only():
    bias = dict(zip(pockjax.leaf_paths(PARAMS), pockjax.UpdateScheme.bias_only().resolve_tree(PARAMS)))
    assert [p for p, r in bias.items() if isinstance(r, Full)] == [f"layers.{i}.attn.bias" for i in range(3)]
    norm = dict(zip(pockjax.leaf_paths(PARAMS), pockjax.UpdateScheme.norm_only().resolve_tree(PARAMS)))
    assert sorted(p for p, r in norm.items() if isinstance(r, Full)) == sorted(
        [f"layers.{i}.attn_norm.scale" for i in range(3)] + ["norm.scale"]
    )


def test_channels_resolution():
    assert pockjax.channels(2).resolve("w", (4, 8)) == ChannelSelect(axis=1, size=8, indices=(0, 1))
    assert pockjax.channels(0.5, axis=0).resolve("w", (4, 8)).indices == (0, 1)
    assert pockjax.channels(indices=[5, 1]).resolve("w", (4, 8)).indices == (1, 5)
    # all channels is just full
    scheme = pockjax.UpdateScheme({"embed.embedding": pockjax.channels(4)})
    assert isinstance(scheme.resolve_tree(PARAMS)[0], Full)


def test_unmatched_pattern_lists_closest_paths():
    scheme = pockjax.UpdateScheme({"layers.*.atn.wq.kernel": "full"})
    with pytest.raises(pockjax.UnmatchedPatternError) as err:
        scheme.resolve_tree(PARAMS)
    msg = str(err.value)
    assert "layers.*.atn.wq.kernel" in msg and "layers.0.attn.wq.kernel" in msg


def test_unknown_rule():
    with pytest.raises(pockjax.UnknownRuleError, match="did you mean 'frozen'|Did you mean 'frozen'"):
        pockjax.UpdateScheme({"norm.scale": "frozn"})
    with pytest.raises(pockjax.UnknownRuleError):
        pockjax.UpdateScheme({"norm.scale": 3})


def test_channel_count_larger_than_axis():
    scheme = pockjax.UpdateScheme({"norm.scale": pockjax.channels(5)})
    with pytest.raises(pockjax.ChannelRuleError, match=r"norm.scale: channel count 5 is larger than axis 0"):
        scheme.resolve_tree(PARAMS)
    with pytest.raises(pockjax.ChannelRuleError, match="outside axis"):
        pockjax.UpdateScheme({"norm.scale": pockjax.channels(indices=[7])}).resolve_tree(PARAMS)
    # once dropped without a word (trained 2 channels of the 3 listed)
    with pytest.raises(pockjax.ChannelRuleError, match=r"indices \[0, 0, 1\] name channel\(s\) \[0\] .* more than once"):
        pockjax.UpdateScheme({"norm.scale": pockjax.channels(indices=[0, 0, 1])}).resolve_tree(PARAMS)
    with pytest.raises(pockjax.ChannelRuleError, match=r"name channel\(s\) \[3\]"):  # -1 is 3 on an axis of 4
        pockjax.UpdateScheme({"norm.scale": pockjax.channels(indices=[3, -1])}).resolve_tree(PARAMS)
    with pytest.raises(pockjax.SchemeError):
        pockjax.channels(1.5)


def test_describe_totals():
    desc = pockjax.UpdateScheme({"layers.2.**": "full", "embed.embedding": pockjax.channels(1)}).describe(PARAMS)
    assert desc.total == 40 + 3 * (16 + 4 + 4) + 4
    assert desc.trainable == 10 + 24
    text = str(desc)
    assert "channels(1, axis=-1)" in text and text.splitlines()[-1].startswith("total")


def test_round_trip_dict():
    s = pockjax.UpdateScheme({"a.*": pockjax.channels(indices=[1, 3], axis=0), "b": "full"}, default="frozen", name="x")
    assert pockjax.UpdateScheme.from_dict(s.to_dict()) == s
    assert pockjax.UpdateScheme({"a": "channels(4, axis=0)"}).rules[0][1] == pockjax.channels(4, axis=0)
