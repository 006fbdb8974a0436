"""Hostile input to eval.py: the line contract of data/text.py, token-budget batches, and the
Translator's one-output-per-input-line contract on random hostile files (seeded fuzzing),
with an echoing decoder (order, truncation, length-cap counts exact) and a tiny random model
(real shapes, bounded batches). Language-model files: words outside the vocabulary are
counted as <unk>; symbols a character model has no <unk> for are named, with their place."""

import collections
import gzip
import random

import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from xformer import config as config_lib
from xformer import decoding, model_config, sharding, translate
from xformer.data.pipeline import budget_batches, rows_within_budget, source_bucket_length
from xformer.data.text import LINE_BREAKS, normalize_line, one_line, read_input_lines
from xformer.data.tokenizer import EOS_ID, PAD_ID, train_tokenizer
from xformer.data.vocab import CharVocab, WordVocab
from xformer.experiment import model_rngs
from xformer.models import EncoderDecoder
from xformer.tasks.language_modeling import encode_text_file
from xformer.translate import Translator

WORDS = "a man woman dog cat rides runs the red blue bike street park child plays ball".split()
# Characters that break lines for str.splitlines, but not for the line contract.
BREAKERS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
CONTROLS = ["\x00", "\x01", "\x07", "\t", "\x1b", "\x7f", "\x9b"]
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u200e", "\u200f", "\u202e", "\u2066", "\ufeff", "\xad"]
ASTRAL = ["🚲", "😀", "𝔘", "𠜎", "👨\u200d👩\u200d👧", "\U0010fffd"]


# --------------------------------------------------------------------------- the line contract


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("plain text", "plain text"),
        ("  spaced \t out  ", "spaced out"),
        ("nul\x00inside", "nul inside"),
        ("bell\x07 and esc\x1b[31m", "bell and esc [31m"),
        ("lone\rcr", "lone cr"),
        ("vt\x0bff\x0cfs\x1cnel\x85ls\u2028ps\u2029end", "vt ff fs nel ls ps end"),
        ("zero\u200bwidth\u200djoin\ufeffbom", "zerowidthjoinbom"),
        ("\u202eevil\u202c \u2066iso\u2069 \u200emark\u200f", "evil iso mark"),
        ("soft\xadhyphen", "softhyphen"),
        ("emoji 🚲 astral 𝔘 𠜎", "emoji 🚲 astral 𝔘 𠜎"),
        ("nbsp\xa0and\u3000ideographic", "nbsp and ideographic"),
        ("\u200b\u200f\x00 \t\u2028", ""),
        ("", ""),
    ],
)
def test_normalize_line(raw, expected):
    assert normalize_line(raw) == expected
    assert normalize_line(expected) == expected  # idempotent


def test_one_line_removes_every_line_break():
    text = "a" + "b".join(BREAKERS) + "\n" + "c"
    out = one_line(text)
    assert len(out.splitlines()) == 1 and "\n" not in out and "\r" not in out
    assert out.replace(" ", "") == text.translate({ord(c): None for c in [*BREAKERS, "\n"]})


@pytest.mark.parametrize(
    "data,expected",
    [
        (b"", []),
        (b"\xef\xbb\xbf", []),
        (b"\n", [""]),
        (b"no trailing newline", ["no trailing newline"]),
        (b"\xef\xbb\xbfbom first\nsecond\n", ["bom first", "second"]),
        (b"crlf\r\nlines\r\n", ["crlf", "lines"]),
        (b"lone\rcr\rinside\n", ["lone cr inside"]),
        (b"mixed\r\nends\nlast\r", ["mixed", "ends", "last"]),
        ("vt\x0bls\u2028nel\x85\n".encode(), ["vt ls nel"]),
        (b"\n\n\n", ["", "", ""]),
        (b"nul\x00byte\n \t \n", ["nul byte", ""]),
    ],
)
def test_read_input_lines(tmp_path, data, expected):
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    assert read_input_lines(path) == expected
    assert len(read_input_lines(path, normalize=False)) == len(expected)
    path.write_bytes(gzip.compress(data))
    assert read_input_lines(path) == expected


def test_references_and_prompts_keep_their_text(tmp_path):
    """normalize=False: the same lines (BOM and line endings dropped), each line's text as
    written, as sacreBLEU scores a reference file (eval.py --reference) and a prompt reads."""
    path = tmp_path / "ref.de"
    path.write_bytes("\ufeffFahr\u00adrad  fährt\r\n\tlone\rcr\n\u200b\nlast".encode())
    assert read_input_lines(path, normalize=False) == [
        "Fahr\u00adrad  fährt",
        "\tlone\rcr",
        "\u200b",
        "last",
    ]
    assert read_input_lines(path) == ["Fahrrad fährt", "lone cr", "", "last"]


def test_ten_thousand_empty_lines(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"\n" * 10_000)
    assert read_input_lines(path) == [""] * 10_000


def test_invalid_utf8_names_file_line_and_column(tmp_path):
    path = tmp_path / "bad.en"
    path.write_bytes(b"\xef\xbb\xbfok\r\nstill ok\nbroken \xc3\x28 here\n")
    with pytest.raises(ValueError, match=r"bad\.en: line 3 is not valid UTF-8 .*column 8"):
        read_input_lines(path)


# --------------------------------------------------------------------------- token budgets


@pytest.mark.parametrize("draw", range(5))
def test_budget_batches_cover_every_index_once_within_the_budget(draw):
    seed = random.randrange(1 << 30)  # fresh each run; printed with a failure
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    lengths = list(rng.integers(1, 600, size=int(rng.integers(1, 400))))
    lengths[0] = 599  # a very long line
    row_multiple = int(rng.choice([1, 2, 4]))
    max_rows, max_tokens = 16 * row_multiple, int(rng.choice([256, 1000, 8192]))
    batches = budget_batches(lengths, max_rows, max_tokens, row_multiple)
    seen = np.concatenate([b.indices for b in batches])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    assert [lengths[i] for i in seen] == sorted(lengths, reverse=True)  # longest first
    shapes = {(b.rows, b.length) for b in batches}
    assert len(shapes) == len({b.length for b in batches}) <= 8 + 8  # one shape per bucket
    for b in batches:
        assert len(b.indices) <= b.rows <= max_rows and b.rows % row_multiple == 0
        assert b.length == source_bucket_length(max(lengths[i] for i in b.indices))
        assert b.rows * b.length <= max(max_tokens, row_multiple * b.length)
        assert b.rows == rows_within_budget(b.length, max_rows, max_tokens, row_multiple)
    long_batch = next(b for b in batches if 0 in b.indices)
    assert long_batch.length == 640 and long_batch.rows == max(
        row_multiple, min(max_rows, max_tokens // 640) // row_multiple * row_multiple
    )


def test_budget_batches_respect_a_position_table():
    batches = budget_batches([100, 3, 37], max_rows=4, max_tokens=64, max_length=100)
    assert [b.length for b in batches] == [100, 48, 16]  # 112 capped at the table
    with pytest.raises(ValueError, match="exceeds max_length=100"):
        budget_batches([101], max_rows=4, max_tokens=64, max_length=100)


# --------------------------------------------------------------------------- the Translator


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    rng = random.Random(0)
    sentences = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(2000)]
    path = tmp_path_factory.mktemp("spm") / "tiny.model"
    return train_tokenizer(sentences, str(path), vocab_size=64)


def make_translator(tokenizer, *, positional="sinusoidal", max_len=256, **eval_overrides):
    c = config_lib.base_config()
    overrides = {
        "model.d_model": 16,
        "model.num_heads": 2,
        "model.d_ff": 32,
        "model.num_encoder_layers": 1,
        "model.num_decoder_layers": 1,
        "model.positional": positional,
        "model.max_len": max_len,
    }
    config_lib.override(c, overrides)
    cfg = model_config.from_config(
        c.model, src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size
    )
    model = EncoderDecoder(cfg, rngs=model_rngs(0))
    model.eval()
    graphdef, params, rng_state = nnx.split(model, nnx.Param, ...)
    mesh = sharding.make_mesh({"data": -1})
    settings = {
        "beam_size": 1,
        "length_penalty": 0.6,
        "max_decode_extra": 4,
        "batch_size": 8,
        "max_input_tokens": 40,
        "max_tokens_per_batch": 64,
        **eval_overrides,
    }
    translator = Translator(
        graphdef,
        cfg,
        tokenizer,
        tokenizer,
        batch_sharding=NamedSharding(mesh, sharding.batch_spec(mesh)),
        **settings,
    )
    return translator, params, rng_state


def hostile_line(rng: random.Random) -> tuple[str, bool]:
    """(a line without "\\n", whether the contract makes it empty)."""
    kind = rng.choice(
        ["words", "words", "empty", "blank", "controls", "invisible", "astral", "breakers", "long"]
    )
    words = rng.choices(WORDS, k=rng.randint(1, 15))
    if kind == "empty":
        return "", True
    if kind == "blank":  # whitespace, controls and format characters only
        return "".join(rng.choices([" ", "\t", *CONTROLS, *INVISIBLE, *BREAKERS], k=6)), True
    if kind == "long":
        if rng.random() < 0.5:  # one very long token
            return "".join(rng.choices("abdeikmnorstw", k=20_000)), False
        return " ".join(rng.choices(WORDS, k=rng.choice([300, 5_000]))), False
    extra = {"controls": CONTROLS, "invisible": INVISIBLE, "astral": ASTRAL, "breakers": BREAKERS}
    for _ in range(rng.randint(1, 4)):
        if kind in extra:
            words.insert(rng.randrange(len(words) + 1), rng.choice(extra[kind]))
    return rng.choice([" ", "", "\t"]).join(words), False


def hostile_file(rng: random.Random, path) -> list[bool]:
    """Writes a random hostile file; returns, per line, whether it must give an empty output."""
    lines = [hostile_line(rng) for _ in range(rng.randint(0, 40))]
    ending = rng.choice(["\n", "\r\n"])
    text = "".join(line + ending for line, _ in lines)
    if lines and rng.random() < 0.3:
        text = text[: -len(ending)]  # no trailing newline
        if not lines[-1][0]:  # an unterminated empty last line is no line at all
            lines.pop()
    if rng.random() < 0.3:
        text = "\ufeff" + text
    path.write_bytes(text.encode("utf-8"))
    return [empty for _, empty in lines]


def echo_decode(params, rng_state, src, max_len):
    """A decoder that outputs its source; rows whose first token is even lose their EOS (as if
    they stopped at the length cap)."""
    src = np.asarray(src)
    out = np.full((src.shape[0], max_len), PAD_ID, np.int32)
    n = min(max_len, src.shape[1])
    out[:, :n] = src[:, :n]
    no_eos = (src[:, :1] % 2 == 0) & (out == EOS_ID)
    return np.where(no_eos, PAD_ID, out)


@pytest.mark.parametrize("draw", range(6))
def test_fuzz_echo_every_line_once_in_order(tmp_path, tokenizer, draw):
    seed = random.randrange(1 << 30)  # a fresh file each run; printed with a failure
    print(f"seed {seed}")
    rng = random.Random(seed)
    translator, params, rng_state = make_translator(tokenizer)
    translator._decode = echo_decode
    path = tmp_path / "in.txt"
    empty = hostile_file(rng, path)
    lines = read_input_lines(path)
    assert len(lines) == len(empty)
    result = translator.translate(params, rng_state, lines)
    assert len(result.lines) == len(lines)
    limit = translator.input_limit
    sp = tokenizer.sp
    expected, cut, capped = [], 0, 0
    for line, is_empty in zip(lines, empty, strict=True):
        assert (line == "") == is_empty
        if is_empty:
            expected.append("")
            continue
        ids = sp.encode(line)
        cut += len(ids) + 1 > limit
        ids = ids[: limit - 1] if len(ids) + 1 > limit else ids
        capped += ids[0] % 2 == 0
        expected.append(sp.decode(ids))
    assert result.lines == expected
    assert (result.empty, result.truncated, result.hit_length_cap) == (sum(empty), cut, capped)
    assert not any(LINE_BREAKS.search(out) for out in result.lines)


@pytest.mark.parametrize("positional,max_len", [("sinusoidal", 256), ("learned", 24)])
def test_fuzz_tiny_model_one_output_per_line_in_bounded_batches(
    tmp_path, tokenizer, positional, max_len
):
    translator, params, rng_state = make_translator(
        tokenizer, positional=positional, max_len=max_len
    )
    shapes = collections.Counter()
    decode = translator._decode

    def recording_decode(params, rng_state, src, max_len):
        shapes[(*src.shape, max_len)] += 1
        return decode(params, rng_state, src, max_len)

    translator._decode = recording_decode
    rng = random.Random(positional)
    for _ in range(3):
        path = tmp_path / "in.txt"
        empty = hostile_file(rng, path)
        lines = read_input_lines(path)
        result = translator.translate(params, rng_state, lines, log_every_s=1e-9)
        assert len(result.lines) == len(lines) == len(empty)
        assert all(out == "" for out, e in zip(result.lines, empty, strict=True) if e)
        assert result.input_limit == min(40, max_len)
    for rows, length, decode_len in shapes:
        assert rows * length <= 64 or rows == 1
        assert length <= min(40, max_len) + 15 and decode_len <= length + 4
        if positional == "learned":
            assert length <= max_len and decode_len <= max_len
    assert len(shapes) <= 3


def test_empty_input_decodes_nothing(tokenizer):
    translator, params, rng_state = make_translator(tokenizer)
    translator._decode = None  # any decoding would fail
    result = translator.translate(params, rng_state, ["", " \t", "\u200b"] * 50)
    assert result.lines == [""] * 150 and result.empty == 150


# --------------------------------------------------------------------------- language models


def test_word_model_counts_words_outside_the_vocabulary(tmp_path):
    vocab = WordVocab.build(["the cat sat", "on the mat <unk>"])
    words = ["the", "cat", "zebra", "mat", "quokka", "<unk>", "on", "zebra"]
    rng = random.Random(1)
    lines = [" ".join(rng.choices(words, k=rng.randint(0, 9))) for _ in range(50)] + ["a zebra"]
    path = tmp_path / "in.txt"
    path.write_text("\ufeff" + "\r\n".join(lines), encoding="utf-8")
    encoded = encode_text_file(vocab, str(path))
    direct = sum(w in ("zebra", "quokka", "a") for line in lines for w in line.split())
    assert encoded.oov_tokens == direct > 0
    assert len(encoded.stream) == sum(len(line.split()) + 1 for line in lines)
    assert (encoded.stream == vocab.unk_id).sum() == direct + sum(
        line.split().count("<unk>") for line in lines
    )


def test_character_model_names_characters_outside_its_alphabet(tmp_path):
    # A ptb_char-style model: whitespace-separated symbols, no <unk>.
    vocab = WordVocab.build(["a b c _ d e", "e d c"])
    path = tmp_path / "chars.txt"
    path.write_text("a b c\nd é _ e é\nø\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        encode_text_file(vocab, str(path))
    message = str(info.value)
    assert "3 symbols are outside" in message and "no <unk>" in message
    assert "'é' x2 (first at line 2, token 2)" in message and "'ø' x1 (first at line 3" in message
    # A text8-style model: UTF-8 characters.
    chars = CharVocab.build("abc de")
    path.write_text("abc\nde ü", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        encode_text_file(chars, str(path))
    message = str(info.value)
    assert "'\\n' x1 (first at line 1, column 4)" in message
    assert "'ü' x1 (first at line 2, column 4)" in message
    path.write_text("abc de", encoding="utf-8")
    np.testing.assert_array_equal(encode_text_file(chars, str(path)).stream, chars.encode("abc de"))


@pytest.mark.parametrize("beam_size", [1, 3])
def test_each_line_stops_at_its_own_cap_whatever_its_batch(tokenizer, beam_size, monkeypatch):
    """With EOS banned every output runs to its cap, the line's own length + max_decode_extra:
    the same alone and beside a longer line (the batch's padded length set it before)."""

    def ban_eos_too(step_fn, token_ids):
        return decoding.ban_tokens(step_fn, (*token_ids, EOS_ID))

    monkeypatch.setattr(translate, "ban_tokens", ban_eos_too)
    translator, params, rng_state = make_translator(
        tokenizer,
        beam_size=beam_size,
        max_decode_extra=3,
        max_input_tokens=100,
        max_tokens_per_batch=1024,
    )
    rng = random.Random()
    short, long = (" ".join(rng.choices(WORDS, k=k)) for k in (2, 15))
    alone = translator.translate(params, rng_state, [short])
    together = translator.translate(params, rng_state, [long, short])
    assert together.lines[1] == alone.lines[0]
    assert alone.hit_length_cap == 1 and together.hit_length_cap == 2
