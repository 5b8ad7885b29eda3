"""A tiny byte-level BPE vocabulary in the GPT-2 / Qwen2 layout, for the tiny random checkpoints
of the Qwen families (``omnistep.models.qwen2_5_omni.tiny``, ``omnistep.models.qwen3_tts.tiny``).

The 256 byte tokens (GPT-2's byte -> printable character table, ids 0..255), then merges that
make each word of ``WORDS`` (lower case and capitalised, with and without a leading space) one
token. Lives outside the family folders because both use it (no family imports another).
Pure Python: imports nothing but the standard library.
"""

from __future__ import annotations

# Words that get whole-word BPE merges (with and without a leading space).
WORDS = (
    "system user assistant you are a helpful virtual human developed by the qwen team alibaba "
    "group capable of perceiving auditory and visual inputs as well generating text speech "
    "hello world how is it today nice weather thank thanks morning good what can i do for "
    "me tell say something about yourself please speak short sentence one two three yes no "
    "we this that with have from your will would like there their time know voice audio "
    "picture video"
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2 / Qwen2 byte -> printable character table, in vocabulary order (ids 0..255)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _bytes_order() -> list[int]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    return bs + [b for b in range(256) if b not in bs]


def _byte_level(text: str) -> str:
    table = dict(zip(_bytes_order(), _bytes_to_unicode(), strict=True))
    return "".join(table[b] for b in text.encode("utf-8"))


def _apply_bpe(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    while len(pieces) > 1:
        found = [
            (ranks[(a, b)], i)
            for i, (a, b) in enumerate(zip(pieces[:-1], pieces[1:], strict=True))
            if (a, b) in ranks
        ]
        if not found:
            break
        i = min(found)[1]
        pieces = pieces[:i] + [pieces[i] + pieces[i + 1]] + pieces[i + 2 :]
    return pieces


def bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte tokens, then merges that make each listed word (with and without a leading space) a
    single token under BPE's lowest-rank-first rule (new merges join what BPE already yields)."""
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    words: list[str] = []
    for w in WORDS.split():
        for form in (w, w.capitalize()):
            for spaced in (form, " " + form):
                if spaced not in words:
                    words.append(spaced)
    words += ["\n", "\n\n", ".\n", "Qwen", " Qwen", "Alibaba", " Alibaba"]
    for w in words:
        pieces = _apply_bpe(list(_byte_level(w)), ranks)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            if pair not in ranks:
                ranks[pair] = len(merges)
                merges.append(pair)
                vocab.setdefault(pair[0] + pair[1], len(vocab))
            pieces = _apply_bpe(pieces, ranks)
    return vocab, merges
