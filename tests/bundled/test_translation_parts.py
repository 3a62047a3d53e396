"""The translation example's pieces on tiny inputs: masks, greedy decoding, data, metrics."""

import datetime
import itertools

import pytest
import torch

from ddplab.errors import DdplabError
from ddplab.experiments import dates
from ddplab.experiments.parallel_text import BOS_ID, EOS_ID, PAD_ID, Vocab, collate, read_tsv
from ddplab.experiments.transformer import Seq2SeqTransformer, causal_mask, greedy_decode
from ddplab.experiments.translation import text_metrics, warmup_then_inverse_sqrt

VOCAB = 12


def _model(seed=0):
    torch.manual_seed(seed)
    return Seq2SeqTransformer(
        VOCAB, VOCAB, d_model=16, heads=2, encoder_layers=1, decoder_layers=2, feedforward=32, dropout=0.0
    ).eval()


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.long)


def test_causal_mask_is_true_strictly_above_the_diagonal():
    assert causal_mask(3).tolist() == [[False, True, True], [False, False, True], [False, False, False]]


def test_a_decoder_position_never_sees_later_target_tokens():
    model = _model()
    src = _ids([5, 6, 7, 8])
    tgt = _ids([BOS_ID, 4, 5, 6, 7])
    changed = tgt.clone()
    changed[0, 3] = 9
    a, b = model(src, tgt), model(src, changed)
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6)
    assert not torch.allclose(a[:, 3:], b[:, 3:], atol=1e-4)


def test_source_padding_changes_nothing():
    model = _model()
    tgt = _ids([BOS_ID, 4, 5])
    plain = model(_ids([5, 6, 7]), tgt)
    padded = model(_ids([5, 6, 7, PAD_ID, PAD_ID, PAD_ID]), tgt)
    assert torch.allclose(plain, padded, atol=1e-5)


def test_target_padding_changes_no_real_position():
    model = _model()
    src = _ids([5, 6, 7])
    plain = model(src, _ids([BOS_ID, 4, 5]))
    padded = model(src, _ids([BOS_ID, 4, 5, PAD_ID, PAD_ID]))
    assert torch.allclose(plain, padded[:, :3], atol=1e-5)


def _decode_one_by_one(model, sources, max_len):
    """Reference: each sentence alone, unpadded, the full forward pass re-run at every step."""
    rows = []
    for src in sources:
        out = [BOS_ID]
        while len(out) <= max_len:
            next_id = int(model(torch.tensor([src]), torch.tensor([out]))[0, -1].argmax())
            out.append(next_id)
            if next_id == EOS_ID:
                break
        tokens = out[1:]
        rows.append(tokens + [PAD_ID] * (max_len - len(tokens)))
    return rows


@pytest.mark.parametrize("eos_bias", [0.0, 2.0, 50.0])
def test_batched_greedy_decoding_equals_decoding_each_sentence_alone(eos_bias):
    model = _model(1)
    with torch.no_grad():
        # 0: long outputs; 2: some stop early; 50: all stop at once
        model.project.bias[EOS_ID] += eos_bias
    sources = [[5, 6, 7, 8, 9], [10, 4], [6, 6, 6, 11]]
    batch = collate([(torch.tensor(s), torch.tensor([BOS_ID, EOS_ID])) for s in sources])["src"]
    got = greedy_decode(model, batch, max_len=7)
    assert got.shape == (3, 7)
    assert got.tolist() == _decode_one_by_one(model, sources, 7)
    for row in got.tolist():
        # nothing but PAD after the first EOS
        if EOS_ID in row:
            assert set(row[row.index(EOS_ID) + 1 :]) <= {PAD_ID}
    if eos_bias == 50.0:
        assert got[:, 0].tolist() == [EOS_ID] * 3 and (got[:, 1:] == PAD_ID).all()


def test_generated_dates_are_deterministic_distinct_and_correct():
    pairs = dates.date_pairs(400, seed=3)
    assert pairs == dates.date_pairs(400, seed=3) and pairs != dates.date_pairs(400, seed=4)
    assert len({iso for _, iso in pairs}) == 400
    for text, iso in pairs:
        d = datetime.date.fromisoformat(iso)
        assert dates.FIRST_DAY <= d <= dates.LAST_DAY and text.strip() == text and text


def test_number_and_ordinal_words():
    assert [dates.ordinal_words(n) for n in (1, 2, 3, 12, 20, 22, 31)] == [
        "first",
        "second",
        "third",
        "twelfth",
        "twentieth",
        "twenty-second",
        "thirty-first",
    ]
    assert [dates.ordinal_suffix(n) for n in (1, 2, 3, 11, 12, 13, 21, 22, 23, 30)] == [
        "1st",
        "2nd",
        "3rd",
        "11th",
        "12th",
        "13th",
        "21st",
        "22nd",
        "23rd",
        "30th",
    ]
    import random

    assert dates.year_words(1994, random.Random(0)) == "nineteen ninety-four"
    assert dates.year_words(1905, random.Random(0)) == "nineteen oh five"


@pytest.mark.parametrize("level,text", [("char", "the 3rd of may"), ("word", "le chat noir")])
def test_vocab_round_trip_and_unknown_tokens(level, text):
    vocab = Vocab.build([text], level)
    ids = vocab.encode(text, max_len=64)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert vocab.decode(ids[1:]) == text
    assert "<unk>" in vocab.decode(vocab.encode("zzz" if level == "char" else "un chien", 64)[1:])
    # cut to fit, EOS kept
    assert len(vocab.encode(text, max_len=4)) == 4


def test_read_tsv_reads_pairs_and_names_a_bad_line(tmp_path):
    good = tmp_path / "good.tsv"
    good.write_text("hello\tbonjour\n\nthank you\tmerci\n")
    assert read_tsv(str(good)) == [("hello", "bonjour"), ("thank you", "merci")]
    bad = tmp_path / "bad.tsv"
    bad.write_text("hello\tbonjour\nno tab here\n")
    with pytest.raises(DdplabError, match=r"line 2: expected 'source<TAB>target'"):
        read_tsv(str(bad))
    with pytest.raises(DdplabError, match=r"does not exist"):
        read_tsv(str(tmp_path / "missing.tsv"))


def test_text_metrics_on_known_cases():
    perfect = text_metrics(["1994-03-23", "2001-01-01"], ["1994-03-23", "2001-01-01"], "char")
    assert perfect == pytest.approx({"cer": 0.0, "wer": 0.0, "bleu": 1.0, "exact": 1.0})
    one_char = text_metrics(["1994-03-24"], ["1994-03-23"], "char")
    assert one_char["cer"] == pytest.approx(0.1) and one_char["wer"] == 1.0 and one_char["exact"] == 0.0
    assert 0.0 < one_char["bleu"] < 1.0
    words = text_metrics(["the cat sat"], ["the cat sat down"], "word")
    assert words["wer"] == pytest.approx(0.25)


def test_learning_rate_warms_up_linearly_then_decays():
    factors = [warmup_then_inverse_sqrt(s, 10) for s in range(40)]
    assert factors[0] == pytest.approx(0.1) and factors[4] == pytest.approx(0.5) and factors[9] == pytest.approx(1.0)
    assert factors[39] == pytest.approx((10 / 40) ** 0.5)
    assert all(a < b for a, b in itertools.pairwise(factors[:10]))
    assert all(a > b for a, b in itertools.pairwise(factors[9:]))
