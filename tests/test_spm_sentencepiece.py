"""The SentencePiece-BPE tokenizer (LLaMA-2 style GGUF vocabularies) against SentencePiece itself.

A small BPE model with byte fallback, LLaMA-2's settings (a dummy space
prefix, no normalization, whitespace kept, digits split), is trained with the
``sentencepiece`` package (a test dependency); its pieces, scores and types,
as a GGUF file holds them, make a :class:`SentencePieceBPE` that must encode
plain text to the same ids and decode them back. Text with user-defined
tokens in it is left out: there pockjax follows llama.cpp (a space prefix
after a special token), not SentencePiece.
"""

import random

import pytest
import sentencepiece

from pockjax.models.llama.spm import SentencePieceBPE

WORDS = ("the quick brown fox jumps over lazy dog reverse these words please sentence model token"
         " piece alpha beta gamma delta naïve café über 東京 数字 123 4567 hello world").split()

TEXTS = ["the quick brown fox", "  leading spaces", "trailing  ", "naïve café über", "東京 数字",
         "12345 67", "unseen Zebra Ω ☃", "a\nb\n\nc", "tab\there", "", "x", "hello world!!",
         "the  quick   brown", "Übermodel"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    (d / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "m"), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, character_coverage=1.0, num_threads=1,
        minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(d / "m.model"))
    n = sp.get_piece_size()
    # llama.cpp's token types, as convert_hf_to_gguf writes them for a SentencePiece model
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    ours = SentencePieceBPE([sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)], types,
                            add_space_prefix=True, unk_id=sp.unk_id())
    return sp, ours


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_sentencepiece(models, text):
    sp, ours = models
    ids = ours.encode(text).ids
    assert ids == sp.encode(text), text
    assert ours.decode(ids) == sp.decode(ids) == text


def test_merges_happen(models):
    """The comparison is not trivial: frequent words are single pieces, unseen characters bytes."""
    sp, ours = models
    assert len(ours.encode("the quick brown fox").ids) < len("the quick brown fox") / 2
    assert all(sp.is_byte(i) for i in ours.encode("☃").ids[1:])  # after the "▁" piece


@pytest.mark.parametrize("tokens, scores, message", [
    (["a", "b", "ab", "ab"], [0, 0, 1, 1], "distinct strings"),
    (["a", "b"], [0], "2 finite numbers"),
    (["a", "b", "ab"], [0, 0, float("nan")], "3 finite numbers"),  # would scramble tokenizer.json's merges
])
def test_vocabulary_built_directly_is_checked(tokens, scores, message):
    from pockjax.models.llama.spm import SentencePieceBPE

    with pytest.raises(ValueError, match=message):
        SentencePieceBPE(tokens, scores)
