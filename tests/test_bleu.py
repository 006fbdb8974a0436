"""BLEU conventions: the lowercased Moses pipeline reproduces upstream Multi30k tok files."""

import gzip
import math
from collections import Counter

import pytest
import sacrebleu

from xformer.bleu import bleu_report, moses_lc_tok


def _lines(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


@pytest.mark.parametrize("lang", ["en", "de"])
@pytest.mark.parametrize("split", ["test_2016_flickr", "val"])  # val.de: a line ending in ."
def test_lc_tok_pipeline_matches_upstream_tokenized_files(multi30k_dir, split, lang):
    raw = _lines(multi30k_dir / "raw" / f"{split}.{lang}.gz")
    tok = _lines(multi30k_dir / "tok" / f"{split}.lc.norm.tok.{lang}.gz")
    assert [moses_lc_tok(line, lang) for line in raw] == tok


def test_bleu_report_values(multi30k_dir):
    refs = _lines(multi30k_dir / "raw" / "val.de.gz")[:200]
    perfect = bleu_report(refs, refs, "de")
    assert perfect.sacrebleu == pytest.approx(100.0)
    assert perfect.lc_tok_bleu == pytest.approx(100.0)
    assert "case:mixed" in perfect.signature and "tok:13a" in perfect.signature
    # Lowercasing the hypotheses hurts cased sacreBLEU but not the lowercased metric.
    lowered = bleu_report([r.lower() for r in refs], refs, "de")
    assert lowered.lc_tok_bleu == pytest.approx(100.0)
    assert lowered.sacrebleu < 90
    # The lc-tok metric equals unsmoothed sacreBLEU with no tokenization on tokenized text.
    hyps = refs[1:] + refs[:1]
    tok = sacrebleu.corpus_bleu(
        [moses_lc_tok(h, "de") for h in hyps],
        [[moses_lc_tok(r, "de") for r in refs]],
        tokenize="none",
        smooth_method="none",
    )
    assert bleu_report(hyps, refs, "de").lc_tok_bleu == pytest.approx(tok.score)
    # Hypotheses and references in their places: short hypotheses score lower than the
    # references would against them (precision is of the hypotheses; the brevity penalty).
    short = [" ".join(r.split()[: len(r.split()) // 2]) for r in refs]
    report = bleu_report(short, refs, "de")
    assert report.sacrebleu == pytest.approx(sacrebleu.corpus_bleu(short, [refs]).score)
    assert report.sacrebleu < sacrebleu.corpus_bleu(refs, [short]).score - 5
    # lc-tok against the upstream tokenized references (not our own tokenization of them).
    upstream = _lines(multi30k_dir / "tok" / "val.lc.norm.tok.de.gz")[:200]
    lc_tok = sacrebleu.corpus_bleu(
        [moses_lc_tok(h, "de") for h in short], [upstream], tokenize="none", smooth_method="none"
    )
    assert report.lc_tok_bleu == pytest.approx(lc_tok.score)
    assert (
        report.lc_tok_bleu
        < sacrebleu.corpus_bleu(
            upstream, [[moses_lc_tok(h, "de") for h in short]], tokenize="none"
        ).score
        - 5
    )
    with pytest.raises(ValueError, match="hypotheses"):
        bleu_report(refs[:3], refs, "de")


def multi_bleu(hypotheses: list[str], references: list[str]) -> float:
    """multi-bleu.perl's corpus BLEU with one reference, written out: clipped n-gram matches
    of orders 1-4, the brevity penalty, and log(0) taken as -9999999999 (no smoothing)."""
    correct, total, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hypotheses, references, strict=True):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            grams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            ref_grams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            total[n - 1] += sum(grams.values())
            correct[n - 1] += sum(min(c, ref_grams[g]) for g, c in grams.items())
    pairs = zip(correct, total, strict=True)
    logs = [math.log(c / t) if t and c else -9999999999 for c, t in pairs]
    brevity = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * brevity * math.exp(sum(logs) / 4)


def test_lc_tok_bleu_is_multi_bleu(multi30k_dir):
    """lc-tok BLEU equals multi-bleu.perl on the tokenized lines, also where an n-gram order has
    no match at all (sacreBLEU's default exp smoothing would score that above 0)."""
    refs = _lines(multi30k_dir / "raw" / "val.de.gz")[:150]
    tok_refs = [moses_lc_tok(r, "de") for r in refs]
    shuffled = refs[3:] + refs[:3]
    halves = [" ".join(r.split()[: len(r.split()) // 2 + 1]) for r in refs]
    no_bigrams = [" qqq ".join(r.split()) for r in refs]  # every bigram holds qqq
    for hyps in (shuffled, halves, no_bigrams):
        want = multi_bleu([moses_lc_tok(h, "de") for h in hyps], tok_refs)
        assert bleu_report(hyps, refs, "de").lc_tok_bleu == pytest.approx(want, rel=1e-9)
    assert bleu_report(no_bigrams, refs, "de").lc_tok_bleu == 0.0
    assert 0 < multi_bleu([moses_lc_tok(h, "de") for h in halves], tok_refs) < 100


def test_sacrebleu_tokenizes_for_the_target_language():
    """Chinese is scored with sacreBLEU's zh tokenizer (13a sees one word per sentence here and
    scores 0), the same score sacreBLEU gives when told the language."""
    hyps, refs = ["我喜欢猫。", "今天天气很好。"], ["我喜欢狗。", "今天天气很好。"]
    report = bleu_report(hyps, refs, "zh")
    want = sacrebleu.BLEU(tokenize="zh").corpus_score(hyps, [refs])
    assert "tok:zh" in report.signature and report.sacrebleu == pytest.approx(want.score)
    assert 0 < report.sacrebleu < 100
    assert "tok:13a" in bleu_report(["ein Hund ."], ["ein Hund ."], "de").signature


def test_a_target_language_without_its_bleu_tokenizer_is_a_config_error():
    from xformer import config as config_lib

    try:
        sacrebleu.BLEU(trg_lang="ja")
        pytest.skip("sacrebleu's Japanese tokenizer (MeCab) is installed")
    except RuntimeError:
        pass
    config = config_lib.base_config()
    config.data.source_lang, config.data.target_lang = "en", "ja"
    with pytest.raises(ValueError, match=r"data.target_lang='ja': .*pip install sacrebleu\[ja\]"):
        config_lib.validate(config)
