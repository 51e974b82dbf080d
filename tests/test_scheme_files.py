"""Scheme files (pockjax.schemes.load_scheme_file): every malformed file is one SchemeError
that names the file and what is wrong, never a traceback from the reader's internals."""

from __future__ import annotations

import json
import re

import pytest

import pockjax
from pockjax.errors import SchemeError, UnknownRuleError
from pockjax.schemes import load_scheme_file, save_scheme_file
from pockjax.train.schemes import llama_scheme


def write(tmp_path, data, name="scheme.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize(
    "data, what",
    [
        ([["layers.0.attn.wq.kernel", "full"]], r"a scheme is a JSON object .* got a list"),
        ("3", r"a scheme is a JSON object .* got a number \(3\)"),
        ("null", r"got null"),
        ({"rules": "layers.*"}, r"'rules' must be a list of \[pattern, rule\] pairs, got a string"),
        ({"rules": 7}, r"'rules' must be a list .* got a number"),
        ({"rules": [[3, "full"]]}, r"rules\[0\]\[0\]: a pattern must be a non-empty string, got a number \(3\)"),
        ({"rules": [[None, "full"]]}, r"rules\[0\]\[0\]: a pattern must be a non-empty string, got null"),
        ({"rules": [["", "full"]]}, r"rules\[0\]\[0\]: a pattern must be a non-empty string"),
        ({"rules": [["a", "full"], "b"]}, r"rules\[1\]: a rule entry is a \[pattern, rule\] pair, got a string"),
        ({"rules": [["a", "full", "extra"]]}, r"rules\[0\]: a rule entry is a \[pattern, rule\] pair, got a list"),
        ({"rules": [["a", "fast"]]}, r"rules\[0\]\[1\]: unknown rule 'fast'"),
        ({"rules": [["a", 5]]}, r"rules\[0\]\[1\]: a rule is 'full', 'frozen'.* got a number \(5\)"),
        ({"rules": [["a", ["full"]]]}, r"rules\[0\]\[1\]: a rule is .* got a list"),
        ({"rules": [["a", {"channel": 4}]]}, r"rules\[0\]\[1\]: cannot read rule .* expected the keys"),
        ({"rules": [["a", {"channels": "half"}]]}, r"rules\[0\]\[1\]: 'channels' must be a positive count"),
        ({"rules": [["a", {"channels": True}]]}, r"rules\[0\]\[1\]: 'channels' must be a positive count"),
        ({"rules": [["a", {"channels": -2}]]}, r"'channels' must be a positive count"),
        ({"rules": [["a", {"channels": 1.5}]]}, r"rules\[0\]\[1\]: channels\(k\): a fractional k must be in"),
        ({"rules": [["a", {"channels": 4, "axis": "last"}]]}, r"rules\[0\]\[1\]: 'axis' must be an integer"),
        ({"rules": [["a", {"indices": [0, "1"]}]]}, r"'indices' must be a non-empty list of integers"),
        ({"rules": [["a", {"indices": 3}]]}, r"'indices' must be a non-empty list of integers"),
        ({"rules": {"a": "fast"}}, r"rules\['a'\]: unknown rule 'fast'"),
        ({"rules": [["a[", "full"]]}, None),  # an unclosed class is a literal '[', not an error
        ({"rules": [], "default": 1}, r"default: a rule is .* got a number"),
        ({"rules": [], "default": "thawed"}, r"default: unknown rule 'thawed'"),
        ({"rules": [], "name": 3}, r"'name' must be a string, got a number"),
        ({"rules": [], "strict": "yes"}, r"'strict' must be true or false, got a string"),
        ({"rule": []}, r"unknown field\(s\) 'rule'"),
        ({}, r"a scheme has no 'rules'"),
    ],
)
def test_malformed_scheme_file_is_one_scheme_error(tmp_path, data, what):
    path = write(tmp_path, data)
    if what is None:
        assert load_scheme_file(path).rules[0][0] == "a["
        return
    with pytest.raises(SchemeError) as e:
        load_scheme_file(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    assert re.search(what, msg), msg
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained internals


def test_unknown_rule_keeps_its_type_and_suggests(tmp_path):
    path = write(tmp_path, {"rules": [["norm.scale", "ful"]]})
    with pytest.raises(UnknownRuleError, match="Did you mean 'full'"):
        load_scheme_file(path)


@pytest.mark.parametrize("text, what", [("{", r"s\.json:1: invalid JSON"), (b"\xff\xfe{", r"s\.json: not UTF-8 text")])
def test_not_json(tmp_path, text, what):
    path = tmp_path / "s.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SchemeError, match=what):
        load_scheme_file(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SchemeError, match="scheme file not found"):
        load_scheme_file(tmp_path / "nope.json")
    with pytest.raises(SchemeError, match="scheme file not found"):
        load_scheme_file(tmp_path)


def test_round_trip_every_rule_kind_and_the_commands_read_it(tmp_path):
    from pockjax.models.llama import LlamaConfig

    scheme = pockjax.UpdateScheme(
        [("layers.1.attn.wq.kernel", pockjax.channels(0.25)), ("layers.1.mlp.*.kernel", pockjax.channels(8, axis=0)),
         ("layers.0.attn.wk.kernel", pockjax.channels(indices=[0, 3])), ("norm.scale", "full")],
        default="frozen", name="mixed", strict=False)
    path = tmp_path / "mixed.json"
    save_scheme_file(path, scheme)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.json"]  # no temporary left
    back = load_scheme_file(path)
    assert back == scheme and back.name == "mixed" and back.strict is False
    assert llama_scheme(str(path), LlamaConfig.tiny()) == scheme  # what finetune/plan/memory read
    # an object of rules reads too
    assert load_scheme_file(write(tmp_path, {"rules": {"norm.scale": "full"}})).rules[0][0] == "norm.scale"


def test_commands_print_one_line_for_a_bad_file(tmp_path, capsys):
    from pockjax.cli import main

    path = write(tmp_path, {"rules": [[1, "full"]]})
    assert main(["plan", "--model", "tiny", "--scheme", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pockjax plan: error: {path}: rules[0][0]: a pattern must be a non-empty string, got a number (1)"]
