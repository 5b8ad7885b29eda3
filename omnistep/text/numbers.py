"""English number words for speech: the readings ``omnistep.text.normalize`` puts in the text.

Every reading is American style, built on ``num2words``: no "and", no hyphens, no commas
(``"one hundred five"``, ``"forty two"``). Besides cardinals, ordinals and years it holds the
readings people use for digit strings that are not amounts: digit by digit (phone numbers, ZIP
codes, PINs), in pairs (``1080`` -> "ten eighty", as said of screen sizes), fractions (``3/4`` ->
"three quarters") and decades (``1990`` -> "nineteen nineties").

Imports: stdlib and ``num2words`` only.
"""

from __future__ import annotations

from num2words import num2words

__all__ = [
    "cardinal",
    "decade",
    "digits",
    "fraction",
    "number_words",
    "ordinal",
    "pairs",
    "year",
]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
MAX_CARDINAL_DIGITS = 15
"""Longer digit runs (card numbers, ids) are read digit by digit."""


def _tidy(words: str) -> str:
    """num2words output in American style: no hyphens, commas or "and"."""
    words = words.replace("-", " ").replace(",", " ")
    return " ".join(w for w in words.split() if w != "and")


def digits(text: str) -> str:
    """Each ASCII digit of ``text`` as a word, other characters dropped: ``"0199"`` -> ``"zero
    one nine nine"`` (zero is "zero", never "oh": one reading for every digit string)."""
    return " ".join(DIGIT_WORDS[int(d)] for d in text if d.isascii() and d.isdigit())


def cardinal(text: str) -> str:
    """Words of a non-negative integer written in ASCII digits (thousands commas allowed).

    >>> cardinal("1,234,567")
    'one million two hundred thirty four thousand five hundred sixty seven'
    >>> cardinal("007")
    'zero zero seven'
    """
    text = text.replace(",", "")
    if len(text) > MAX_CARDINAL_DIGITS or (len(text) > 1 and text[0] == "0"):
        return digits(text)
    return _tidy(num2words(int(text), lang="en"))


def number_words(integer: str, fraction: str | None = None, negative: bool = False) -> str:
    """Words of a number given as its parts: ``integer``, ``fraction`` digits, sign.

    >>> number_words("3", "14", negative=True)
    'minus three point one four'
    """
    words = cardinal(integer)
    if fraction:
        words += " point " + digits(fraction)
    return "minus " + words if negative else words


def ordinal(text: str) -> str:
    """``"21"`` -> ``"twenty first"``; digit by digit past 15 digits, with "th" at the end.

    >>> ordinal("100")
    'one hundredth'
    """
    text = text.replace(",", "")
    if len(text) > MAX_CARDINAL_DIGITS:
        return digits(text) + " th"
    return _tidy(num2words(int(text), lang="en", to="ordinal"))


def year(text: str) -> str:
    """A year as said: ``"1999"`` -> ``"nineteen ninety nine"``, ``"2005"`` -> ``"two thousand
    five"``, ``"1905"`` -> ``"nineteen oh five"``, ``"44"`` -> ``"forty four"``."""
    return _tidy(num2words(int(text), lang="en", to="year"))


def pairs(text: str) -> str:
    """A three- or four-digit integer read in pairs, as people say screen sizes and model
    numbers: ``"1080"`` -> ``"ten eighty"``, ``"720"`` -> ``"seven twenty"``; round hundreds and
    other lengths as cardinals (``"1000"`` -> ``"one thousand"``, ``"64"`` -> ``"sixty four"``).

    >>> pairs("1920"), pairs("2160"), pairs("1000")
    ('nineteen twenty', 'twenty one sixty', 'one thousand')
    """
    if len(text) in (3, 4) and text[0] != "0" and int(text) % 100:
        return year(text)
    return cardinal(text)


def decade(text: str) -> str:
    """``"1990"`` -> ``"nineteen nineties"``; ``"2000"`` -> ``"two thousands"``."""
    words = year(text).split()
    last = words[-1]
    words[-1] = last[:-1] + "ies" if last.endswith("y") else last + "s"
    return " ".join(words)


_DENOMINATORS = {2: ("half", "halves"), 4: ("quarter", "quarters")}


def fraction(numerator: int, denominator: int, whole: str | None = None) -> str:
    """A fraction as said: ``(3, 4)`` -> ``"three quarters"``, ``(1, 3)`` -> ``"one third"``;
    with a whole part, ``(1, 2, "2")`` -> ``"two and a half"``, ``(3, 8, "1")`` -> ``"one and
    three eighths"``. ``denominator`` must be at least 2.

    >>> fraction(5, 16), fraction(1, 4, "3")
    ('five sixteenths', 'three and a quarter')
    """
    one, many = _DENOMINATORS.get(denominator) or (ordinal(str(denominator)),) * 2
    if many == one:
        many = one + "s"
    if whole is not None and numerator == 1:
        return f"{cardinal(whole)} and a {one}"
    words = f"{cardinal(str(numerator))} {one if numerator == 1 else many}"
    return f"{cardinal(whole)} and {words}" if whole is not None else words
