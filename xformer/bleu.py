"""BLEU as reported for translation: sacreBLEU and the lowercased, tokenized Multi30k convention.

Multi30k papers score lowercased, punctuation-normalised, Moses-tokenized text (upstream
scripts/task1-tokenize.sh) with multi-bleu. `moses_lc_tok` reproduces that preprocessing exactly
on the upstream test and validation sets, so hypotheses and references can be taken from raw text.
"""

import dataclasses
import functools

import sacrebleu


@dataclasses.dataclass(frozen=True)
class BleuReport:
    sacrebleu: float  # cased, detokenized, sacreBLEU's default tokenizer of the target language
    signature: str
    lc_tok_bleu: float  # lowercased + Moses-tokenized, as in Multi30k papers

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.cache
def _moses(lang: str) -> tuple:
    """(MosesPunctNormalizer, MosesTokenizer) of `lang`; sacremoses is imported here, at the
    first BLEU (compiling its patterns takes half a second of every script's start)."""
    import sacremoses

    return sacremoses.MosesPunctNormalizer(lang=lang), sacremoses.MosesTokenizer(lang=lang)


def moses_lc_tok(line: str, lang: str) -> str:
    """lowercase -> normalize-punctuation.perl -> tokenizer.perl, as upstream Multi30k does.
    The normaliser sees the line's newline, as the Perl script does: its rule that moves a
    quote before a period needs a character after the quote (`."` at the end of a line)."""
    normalizer, tokenizer = _moses(lang)
    text = normalizer.normalize(line.lower() + "\n").strip()
    return tokenizer.tokenize(text, escape=True, return_str=True)


def sacrebleu_metric(lang: str) -> sacrebleu.BLEU:
    """sacreBLEU's BLEU with its default tokenizer for target language `lang`: 13a, or zh /
    ja-mecab / ko-mecab for Chinese, Japanese and Korean. Raises ValueError when that tokenizer's
    extra packages are missing (call it before training or translating)."""
    try:
        return sacrebleu.BLEU(trg_lang=lang)
    except RuntimeError as e:  # e.g. MeCab for Japanese: "pip install sacrebleu[ja]"
        raise ValueError(f"BLEU for target language {lang!r}: {' '.join(str(e).split())}") from None


def bleu_report(hypotheses: list[str], references: list[str], lang: str) -> BleuReport:
    """Corpus BLEU of detokenized hypotheses against raw references (one per line)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses vs {len(references)} references")
    metric = sacrebleu_metric(lang)
    cased = metric.corpus_score(hypotheses, [references])
    # multi-bleu.perl has no smoothing: an n-gram order without matches makes BLEU 0.
    tok = sacrebleu.BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(
        [moses_lc_tok(h, lang) for h in hypotheses],
        [[moses_lc_tok(r, lang) for r in references]],
    )
    return BleuReport(cased.score, str(metric.get_signature()), tok.score)
