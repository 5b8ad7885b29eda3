"""The text front-end (omnistep.text): normalisation cases, split properties, recognised speech."""

import doctest
import importlib
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistep.core import ModelInstance, Request
from omnistep.engine import AsyncEngine
from omnistep.models.piper.card import FIRST_CHUNK_CHARS, build_card
from omnistep.models.piper.frontend import PiperFrontend
from omnistep.models.piper.voice import default_voice_paths
from omnistep.parity import collect
from omnistep.text import normalize, prepare, split_clauses, split_sentences, split_text

CASES = {
    "cardinals": [
        ("42", "forty two"),
        ("105", "one hundred five"),
        ("-42", "minus forty two"),
        ("It fell to −7.", "It fell to minus seven."),
        ("3.14", "three point one four"),
        ("0.5", "zero point five"),
        ("1,234,567", "one million two hundred thirty four thousand five hundred sixty seven"),
        ("-1,234.5", "minus one thousand two hundred thirty four point five"),
        ("007", "zero zero seven"),
        (
            "1234567890123456",
            "one two three four five six seven eight nine zero one two three four five six",
        ),
        ("COVID-19 and mp3", "COVID-nineteen and mp three"),
    ],
    "ordinals": [
        ("21st", "twenty first"),
        ("the 2nd and 3rd", "the second and third"),
        ("100th", "one hundredth"),
    ],
    "years": [
        ("in 1999", "in nineteen ninety nine"),
        ("since 1905", "since nineteen oh five"),
        ("by 2030", "by twenty thirty"),
        ("in 2005", "in two thousand five"),
        ("the 1990s", "the nineteen nineties"),
    ],
    "dates": [
        ("2024-03-15", "March fifteenth, twenty twenty four"),
        ("March 15, 2024", "March fifteenth, twenty twenty four"),
        ("03/15/2024", "March fifteenth, twenty twenty four"),  # US month/day
        ("04/03/2024", "April third, twenty twenty four"),  # ambiguous: US month/day
        ("15/03/2024", "March fifteenth, twenty twenty four"),  # 15 cannot be a month
        ("15 March 2024", "the fifteenth of March, twenty twenty four"),
        ("Mar. 5", "March fifth"),
        ("May 2024", "May twenty twenty four"),
    ],
    "times": [
        ("3:45 pm", "three forty five p.m."),
        ("3:45PM", "three forty five p.m."),
        ("15:30", "fifteen thirty"),
        ("8:05 a.m.", "eight oh five a.m."),
        ("12:00", "twelve o'clock"),
        ("15:00", "fifteen hundred"),
        ("at 3 pm", "at three p.m."),
    ],
    "currency": [
        ("$12.50", "twelve dollars and fifty cents"),
        ("$1", "one dollar"),
        ("$0.99", "ninety nine cents"),
        ("€3", "three euros"),
        ("£1,000", "one thousand pounds"),
        ("£2.01", "two pounds and one penny"),
        ("$1.5 million", "one point five million dollars"),
        ("$5k", "five thousand dollars"),
        ("-$5", "minus five dollars"),
    ],
    "percentages": [
        ("45%", "forty five percent"),
        ("3.5 %", "three point five percent"),
    ],
    "abbreviations": [
        ("Dr. Smith", "Doctor Smith"),
        ("Mr. and Mrs. Jones", "Mister and Missus Jones"),
        ("Ms. Lee", "Miz Lee"),
        ("St. Louis", "Saint Louis"),
        ("on Main St. today", "on Main Street today"),
        ("to Mulholland Dr., then", "to Mulholland Drive, then"),
        ("My Dr. said so", "My Doctor said so"),
        ("I live on Main St. It is quiet.", "I live on Main Saint It is quiet."),  # ambiguous
        ("apples, pears, etc. Then", "apples, pears, et cetera. Then"),
        ("fruit, e.g. apples", "fruit, for example apples"),
        ("fruit, i.e., apples", "fruit, that is, apples"),
        ("cats vs. dogs", "cats versus dogs"),
        ("No. 5", "number five"),
    ],
    "units": [
        ("5 km", "five kilometers"),
        ("10kg", "ten kilograms"),
        ("1 km", "one kilometer"),
        ("1 ft and 3 ft", "one foot and three feet"),
        ("60 km/h", "sixty kilometers per hour"),
        ("20°C", "twenty degrees Celsius"),
        ("2.5 GB", "two point five gigabytes"),
    ],
}


@pytest.mark.parametrize(
    "text, expected",
    [pytest.param(t, e, id=f"{kind}:{t}") for kind, pairs in CASES.items() for t, e in pairs],
)
def test_normalize_case(text, expected):
    assert normalize(text) == expected


def test_normalize_keeps_plain_text_and_punctuation():
    text = "Hello, world!\n\nThe (quick) fox: it's here; isn't it? Yes…"
    assert normalize(text) == text


def test_messy_paragraph():
    text = "Dr. Smith paid $12.50 on 2024-03-15 at 3:45 pm; 45% of 1,234 people agreed, e.g. me."
    assert normalize(text) == (
        "Doctor Smith paid twelve dollars and fifty cents on March fifteenth, twenty twenty four "
        "at three forty five p.m.; forty five percent of one thousand two hundred thirty four "
        "people agreed, for example me."
    )


@pytest.mark.parametrize(
    "module", ["omnistep.text", "omnistep.text.normalize", "omnistep.text.split"]
)
def test_docstring_examples(module):
    # by name: the package's ``normalize`` function hides its ``normalize`` module attribute
    results = doctest.testmod(importlib.import_module(module))
    assert results.attempted > 0 and results.failed == 0


def test_text_plane_imports_no_torch_no_phonemizer_and_no_other_plane():
    code = (
        "import sys, omnistep.text;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'piper', 'numpy')"
        " or (m.startswith('omnistep.') and not m.startswith('omnistep.text'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- splitting --------------------------------------------------------------------------------


def words(pieces: list[str]) -> list[str]:
    return [w for p in pieces for w in p.split()]


def test_sentences_do_not_end_at_abbreviations_or_decimals():
    text = (
        "Dr. Smith met Mr. Jones at St. Mary's. Pi is 3.14 today, e.g. in class, i.e. here. "
        "Cats vs. dogs! J. R. R. Tolkien wrote No. 5? It costs $3.50 etc. and more. The end"
    )
    assert split_sentences(text) == [
        "Dr. Smith met Mr. Jones at St. Mary's.",
        "Pi is 3.14 today, e.g. in class, i.e. here.",
        "Cats vs. dogs!",
        "J. R. R. Tolkien wrote No. 5?",
        "It costs $3.50 etc. and more.",
        "The end",
    ]


def test_sentences_end_at_blank_lines_and_quotes():
    text = '\n\n\nHe said "Stop." Then\nhe left\n \n\n(Really.) Yes'
    assert split_sentences(text) == ['He said "Stop."', "Then\nhe left", "(Really.)", "Yes"]


def test_long_sentence_is_cut_at_clauses_first():
    sentence = "alpha beta gamma, delta epsilon; zeta eta theta iota kappa - lambda mu"
    assert split_clauses(sentence, max_chars=30) == [
        "alpha beta gamma,",
        "delta epsilon;",
        "zeta eta theta iota kappa -",
        "lambda mu",
    ]
    assert split_clauses(sentence, max_chars=len(sentence)) == [sentence]


def test_no_punctuation_and_long_words():
    text = "word " * 500
    pieces = split_text(text, max_chars=100)
    assert words(pieces) == text.split() and all(len(p) <= 100 for p in pieces)
    long_word = "x" * 5000
    assert split_text(f"a {long_word} b", max_chars=100) == ["a", long_word, "b"]
    with pytest.raises(ValueError):
        split_clauses("a b", max_chars=0)


ADVERSARIAL_TOKENS = [
    "Dr.", "Mr.", "Mrs.", "St.", "e.g.", "i.e.", "etc.", "vs.", "No.", "3.14", "$12.50",
    "1,234,567", "2024-03-15", "15/03/2024", "3:45", "p.m.", "U.S.", "J.", "word", "The", "end.",
    "Why?", "Yes!", "a,", "b;", "c:", "—", "-", "--", "…", "...", '"Hi."', "(ok.)", "x" * 500,
    "😀", "21st", "45%", "-7", "€3",
]  # fmt: skip
SEPARATORS = [" ", "  ", "\n", "\n\n", "\n\n\n\n", "\t", " \n ", "\r\n", "\u00a0", "\u2028"]

adversarial_texts = st.lists(
    st.tuples(
        st.sampled_from(ADVERSARIAL_TOKENS) | st.text(min_size=1, max_size=12),
        st.sampled_from(SEPARATORS),
    ),
    max_size=200,
).map(lambda parts: "".join(t + s for t, s in parts)[:4096])
any_texts = adversarial_texts | st.text(max_size=4096)
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@PROPERTY
@given(text=any_texts, max_chars=st.integers(min_value=1, max_value=400))
def test_split_keeps_every_word_once_in_order(text, max_chars):
    pieces = split_text(text, max_chars)
    assert words(pieces) == text.split()
    for p in pieces:
        assert p and p == p.strip()
        assert len(p) <= max_chars or len(p.split()) == 1


@PROPERTY
@given(text=any_texts)
def test_normalize_leaves_no_digits_and_is_idempotent(text):
    normalized = normalize(text)
    assert not re.search(r"[0-9]", normalized)
    assert normalize(normalized) == normalized
    assert words(prepare(text)) == normalized.split()


# --- the piper card -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frontend() -> PiperFrontend:
    return PiperFrontend.from_config_path(default_voice_paths()[1])


def test_piper_frontend_normalizes_then_splits(frontend):
    text = "Dr. Smith paid $12.50. Then he left at 3 pm."
    assert frontend.texts(text) == [
        "Doctor Smith paid twelve dollars and fifty cents.",
        "Then he left at three p.m.",
    ]
    assert len(frontend.sentences(text)) == 2  # espeak alone cuts after "Dr." too
    raw = PiperFrontend(frontend.config, normalize_text=False)
    assert raw.texts(text) == ["Dr. Smith paid $12.50.", "Then he left at 3 pm."]
    assert len(raw.sentences(text)) == 3


def test_piper_frontend_cuts_long_sentences_at_clauses(frontend):
    clause = "the river ran past the mill and the old stone bridge"
    sentences = frontend.sentences(", ".join([clause] * 12) + ".")
    assert len(sentences) == 3  # 12 clauses of 52 characters: 5 + 5 + 2 in 300
    assert all(s.phonemes.rstrip().endswith((",", ".")) for s in sentences)


MESSY = (
    "Dr. Smith paid $12.50 for 3 coffees on 2024-03-15. "
    "The train leaves at 3:45 pm, and 45% of the 1,234 seats are taken. "
    "Meet me at 12:00 with 10 kg of apples, etc."
)


async def test_recognised_words_match_the_normalised_text(asr):
    """Synthesise messy text with the piper card, recognise it, compare word counts.

    Both sides go through ``normalize`` (Whisper writes "$12.50" and "March 15, 2024") and then
    the ASR harness's ``normalize`` (lower case, no punctuation). Measured (seeds 4-6): 53
    words on each side (54 once), WER 0.06-0.08, the misses being Whisper's "3.45 pm" for
    "three forty five p m". With ``normalize_text=False`` (espeak reading the raw text) the
    same text scored WER 0.13 on seed 4, and sentence by sentence up to 0.7 ("dollar twelve
    point five zero", "fifteen slash zero three slash ...").
    """
    model = ModelInstance.load(build_card())
    engine = AsyncEngine([model])
    try:
        result = await collect(engine, Request("piper", text=MESSY, seed=4))
    finally:
        await engine.shutdown()
    # one chunk per piece: 3 sentences, the first cut at a clause (piper's first_chunk_chars)
    pieces = PiperFrontend.from_config_path(
        default_voice_paths()[1], first_chunk_chars=FIRST_CHUNK_CHARS
    ).texts(MESSY)
    assert len(pieces) == 4 and len(result.chunks) == 4
    hypothesis = asr.transcribe(result.audio, result.sample_rate)
    reference = asr.normalize(normalize(MESSY)).split()
    recognised = asr.normalize(normalize(hypothesis)).split()
    assert abs(len(recognised) - len(reference)) <= 0.15 * len(reference), hypothesis
    for word in ("twelve", "dollars", "fifty", "cents", "forty", "five", "percent", "kilograms"):
        assert word in recognised, (word, hypothesis)
    assert asr.wer(normalize(MESSY), normalize(hypothesis)) <= 0.25, hypothesis


# ----------------------------------------------------------------- incremental tokenization
@pytest.fixture(scope="module")
def qwen_bpe(tmp_path_factory):
    """A Qwen2 byte-level BPE tokenizer loaded as Qwen3-TTS's is: vocab.json + merges.txt +
    tokenizer_config.json, no tokenizer.json."""
    from transformers import Qwen2Tokenizer

    from tests.qwen_omni_ref.assets import TINY_SIZES, _tokenizer_files

    files, _ = _tokenizer_files(TINY_SIZES)
    root = tmp_path_factory.mktemp("bpe")
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (root / name).write_text(files[name], encoding="utf-8")
    return Qwen2Tokenizer.from_pretrained(root).backend_tokenizer


STREAM_TEXTS = [
    "Hello  world, it's 2024!\n\nOK  ",
    "Please leave the package by the blue door on the left side of the house.",
    "Cafe\u0301 na\u00efve -- don't, won't; I'll   go...   ?!",
    "数字 123 和 English 混合。",
]


def _cuts(text: str, points: list[int]) -> list[str]:
    points = sorted({p % (len(text) + 1) for p in points})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.sampled_from(STREAM_TEXTS) | st.text(max_size=40),
    st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_incremental_tokenizer_equals_whole_for_any_cuts(qwen_bpe, text, points):
    from omnistep.text.incremental import IncrementalTokenizer

    inc = IncrementalTokenizer(qwen_bpe)
    got: list[int] = []
    for piece in _cuts(text, points):
        got += inc.feed(piece)
    got += inc.finish()
    assert got == qwen_bpe.encode(text, add_special_tokens=False).ids
    assert inc.finish() == []


def test_incremental_tokenizer_gives_words_before_the_text_ends(qwen_bpe):
    from omnistep.text.incremental import IncrementalTokenizer

    inc = IncrementalTokenizer(qwen_bpe)
    assert inc.feed("Please le") == qwen_bpe.encode("Please", add_special_tokens=False).ids
    assert inc.feed("ave") == []  # "leave" may still go on
    assert inc.feed(" the") == qwen_bpe.encode(" leave", add_special_tokens=False).ids
    inc.finish()
    with pytest.raises(RuntimeError):
        inc.feed("more")
