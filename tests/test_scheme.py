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
        # a trailing ** may match nothing too (it once needed at least "head.")
        ("head.**", "head", True),
        ("head.**", "head.kernel", True),
        ("head.**", "header", False),
        ("head.**.**", "head", True),
        ("a.**.**.b", "a.x.b", True),
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


# -- rules that were once read wrongly without a word ------------------------------------


def test_numpy_fractions_stay_fractions():
    # channels(np.float32(1.0)) went through int(): 1 channel instead of all 8
    assert pockjax.channels(np.float32(1.0)).resolve("a.w", (4, 8)).count == 8
    assert pockjax.channels(np.float64(0.5)).resolve("a.w", (4, 8)).count == 4
    assert pockjax.channels(np.int64(3)).resolve("a.w", (4, 8)).count == 3


@pytest.mark.parametrize("make, message", [
    (lambda: pockjax.channels(indices=[1.5, 2.7]), "must be a list of whole numbers"),  # was (1, 2)
    (lambda: pockjax.channels(indices="12"), "must be a list of whole numbers"),  # was (1, 2)
    (lambda: pockjax.channels(indices=5), "must be a list of whole numbers"),
    (lambda: pockjax.channels(indices=np.zeros((2, 2), int)), "must be a list of whole numbers"),
    (lambda: pockjax.channels(2, axis=0.0), "axis=...\\) must be a whole number"),
    (lambda: pockjax.channels(0), "at least 1, got 0"),
    (lambda: pockjax.lora(4, alpha=True), "alpha must be a finite number > 0"),
    (lambda: pockjax.lora(4, alpha="8"), "alpha must be a finite number > 0"),
    (lambda: pockjax.UpdateScheme([("a.w", "full"), ("a.w", "frozen")]), "'a.w' is given twice"),
    (lambda: pockjax.UpdateScheme({"a.w": "full"}, strict="false"), "strict must be True or False"),
    (lambda: pockjax.UpdateScheme({"a.w": "channels(1.2.3)"}), "unknown rule 'channels\\(1.2.3\\)'"),
    (lambda: pockjax.UpdateScheme({"a.w": "channels(.)"}), "unknown rule"),
    (lambda: pockjax.UpdateScheme({"a.w": "lora(4, alpha=1.2.3)"}), "unknown rule"),
])
def test_malformed_rules_are_refused_when_made(make, message):
    with pytest.raises(pockjax.SchemeError, match=message):
        make()
    # the rule strings that are numbers still read
    assert str(pockjax.UpdateScheme({"a": "channels(.5)", "b": "lora(8, alpha=16.)"}).rules[1][1]) == "lora(8, alpha=16)"


def test_adapters_of_another_rank_or_scale_are_not_kept_silently():
    import jax.numpy as jnp

    params = {"wq": jnp.ones((8, 8)), "step": jnp.zeros((4, 4), jnp.int32)}
    tuned = pockjax.add_adapters(params, pockjax.UpdateScheme({"wq": pockjax.lora(2)}, default="full"))
    same = pockjax.add_adapters(tuned, pockjax.UpdateScheme({"wq": pockjax.lora(2)}, default="full"))
    assert same["wq"] is tuned["wq"]  # the adapters the rule asks for: kept
    for rule in (pockjax.lora(4), pockjax.lora(2, alpha=8)):
        with pytest.raises(pockjax.SchemeError, match="already holds LoRA adapters of rank 2 and scale 1"):
            pockjax.add_adapters(tuned, pockjax.UpdateScheme({"wq": rule}, default="full"))
    with pytest.raises(pockjax.SchemeError, match="holds int32 values: a LoRA update of integers"):
        pockjax.add_adapters(params, pockjax.UpdateScheme({"step": pockjax.lora(2)}, default="full"))


def test_a_bad_glob_and_a_fraction_above_one_are_refused():
    from pockjax.models.llama import LlamaConfig
    from pockjax.schemes import get_scheme

    with pytest.raises(pockjax.SchemeError, match=r"'layers.\[z-a\].w' is not a valid glob"):
        pockjax.UpdateScheme({"layers.[z-a].w": "full"})  # a raw re.error once
    with pytest.raises(pockjax.SchemeError, match=r"channel fraction must be in \(0, 1\], got 2.0"):
        get_scheme("channels", LlamaConfig.tiny(), fraction=2.0)  # read as 2 channels once
    assert get_scheme("channels", LlamaConfig.tiny(), fraction=np.float32(0.25)).rules[0][1].count == 0.25


def test_a_pattern_naming_a_lora_part_is_told_its_owner():
    import jax.numpy as jnp

    params = pockjax.add_adapters({"l1": {"kernel": jnp.ones((4, 4))}}, pockjax.UpdateScheme({"l1.kernel": pockjax.lora(2)}))
    scheme = pockjax.UpdateScheme([("l1.kernel", pockjax.lora(2)), ("l1.kernel.lora_a", "frozen")], default="full")
    # it once said that an earlier pattern, 'l1.kernel.lora_a' itself, ruled them
    with pytest.raises(pockjax.SchemeError, match=r"'l1.kernel.lora_a' matches \['l1.kernel.lora_a'\], parts of LoRA"
                                                  r" adapters: the LoRA rule of their tensor \('l1.kernel'\)"):
        scheme.resolve_tree(params)


def test_a_parameter_named_base_under_a_lora_rule_is_no_adapter():
    import jax.numpy as jnp

    # {"emb": {"base": W}} with emb ruled lora(2): W was frozen as if it were an adapter's base
    scheme = pockjax.UpdateScheme({"emb": pockjax.lora(2)}, default="full")
    with pytest.raises(pockjax.SchemeError, match=r"emb has the rule lora\(2, alpha=2\), but holds no adapter: emb.base is"
                                                  r" a parameter of the model"):
        scheme.resolve_tree({"emb": {"base": jnp.ones((4, 4))}, "x": jnp.ones(3)})
