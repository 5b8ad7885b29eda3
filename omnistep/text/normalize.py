"""English text normalisation for speech: numbers, dates, times, money and abbreviations to words.

``normalize`` rewrites the spans a speech model cannot read reliably and leaves every other
character of the text as it is (words, punctuation, newlines), so sentence splitting still works
on its output. Number words come from ``num2words`` (American style: no "and", no hyphens, no
commas: ``"one hundred five"``, ``"forty two"``).

What it covers, in the order the passes run:

- abbreviations: titles (``Dr.`` -> Doctor, ``Mr.`` -> Mister, ``Mrs.`` -> Missus, ``Ms.`` ->
  Miz, ``Prof.`` -> Professor, ``St.`` -> Saint, ``Mt.`` -> Mount); ``St.`` after a capitalised
  word and not before one -> Street (``Dr.`` -> Drive only before punctuation or the end:
  ``"Mulholland Dr."``); ``e.g.`` -> for example, ``i.e.`` -> that is, ``vs.`` -> versus,
  ``etc.`` -> et cetera, ``Jr.``/``Sr.``, ``No. 5`` -> number five. An abbreviation that can end
  a sentence (``etc.``, ``Jr.``, Street) keeps its period before a word that is not lower-case,
  so ``"... etc. Then"`` still ends a sentence there. ``"Main St. Then"`` is read "Main Saint
  Then": a capitalised word after ``St.`` makes it a title.
- dates: ISO ``2024-03-15``; ``03/15/2024`` read as **US month/day/year** (``15/03/2024``, where
  the first number cannot be a month, is read day/month); ``March 15, 2024``, ``Mar. 15``,
  ``15 March 2024`` -> ``"March fifteenth, twenty twenty four"`` / ``"the fifteenth of March"``.
- times: ``3:45 pm`` -> ``"three forty five p m"``, ``15:30`` -> ``"fifteen thirty"``, ``8:05`` ->
  ``"eight oh five"``, ``12:00`` -> ``"twelve o'clock"``, ``3 pm`` -> ``"three p m"``.
- currency: ``$``, ``€``, ``£``, ``¥`` before an amount, with an optional scale (``$1.5 million``,
  ``$5k``): ``$12.50`` -> ``"twelve dollars and fifty cents"``, ``€3`` -> ``"three euros"``.
- percentages (``45%``), ordinals (``21st``), measurements after a number (``5 km``, ``10kg``,
  ``1 ft`` -> ``"one foot"``), decades (``1990s``), years after a preposition or a month
  (``in 1999`` -> ``"in nineteen ninety nine"``).
- every other number: cardinals with sign, thousands separators and decimals (``-1,234.5`` ->
  ``"minus one thousand two hundred thirty four point five"``); numbers with a leading zero or
  more than 15 digits are read digit by digit; digits stuck to letters are read too (``mp3`` ->
  ``"mp three"``). No ASCII digit is left in the output.

Measured against espeak-ng (which the piper card's phonemizer runs): espeak already reads
cardinals, decimals, thousands separators, negatives, percentages and most ordinals, but reads
``$12.50`` as "dollar twelve point five zero", ``2024-03-15`` as "two thousand twenty four dash
zero three dash fifteen", ``12:00`` as "twelve zero zero", ``km`` and ``vs.`` letter by letter,
``100th`` as "one hundred th", and ends a sentence at ``Dr.``/``Mr.``. Everything is normalised
here all the same: one normaliser for every card (ChatTTS has none of its own), and the output of
a card then does not depend on what its phonemizer happens to know.

Imports: stdlib and ``num2words`` only.

Examples:
    >>> normalize("Dr. Smith paid $12.50 on 2024-03-15.")
    'Doctor Smith paid twelve dollars and fifty cents on March fifteenth, twenty twenty four.'
    >>> normalize("At 3:45 pm, 45% of 1,234 ran 5 km.")
    'At three forty five p m, forty five percent of one thousand two hundred thirty four ran five \
kilometers.'
"""

from __future__ import annotations

import re
from collections.abc import Callable

from num2words import num2words

__all__ = ["cardinal", "normalize", "number_words", "ordinal", "year"]

_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_MAX_CARDINAL_DIGITS = 15
"""Longer digit runs (card numbers, ids) are read digit by digit."""

MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
_MONTH_OF = {m: i + 1 for i, m in enumerate(MONTHS)}
_MONTH_OF.update({m[:3]: i + 1 for i, m in enumerate(MONTHS) if m != "May"})
_MONTH_OF["Sept"] = 9
_MONTH_RE = "|".join(sorted(_MONTH_OF, key=len, reverse=True))


def _tidy(words: str) -> str:
    """num2words output in American style: no hyphens, commas or "and"."""
    words = words.replace("-", " ").replace(",", " ")
    return " ".join(w for w in words.split() if w != "and")


def _digits(digits: str) -> str:
    return " ".join(_DIGITS[int(d)] for d in digits)


def cardinal(digits: str) -> str:
    """Words of a non-negative integer written in ASCII digits (thousands commas allowed).

    >>> cardinal("1,234,567")
    'one million two hundred thirty four thousand five hundred sixty seven'
    >>> cardinal("007")
    'zero zero seven'
    """
    digits = digits.replace(",", "")
    if len(digits) > _MAX_CARDINAL_DIGITS or (len(digits) > 1 and digits[0] == "0"):
        return _digits(digits)
    return _tidy(num2words(int(digits), lang="en"))


def number_words(integer: str, fraction: str | None = None, negative: bool = False) -> str:
    """Words of a number given as its parts: ``integer``, ``fraction`` digits, sign.

    >>> number_words("3", "14", negative=True)
    'minus three point one four'
    """
    words = cardinal(integer)
    if fraction:
        words += " point " + _digits(fraction)
    return "minus " + words if negative else words


def ordinal(digits: str) -> str:
    """``"21"`` -> ``"twenty first"``; digit by digit past 15 digits, with "th" at the end.

    >>> ordinal("100")
    'one hundredth'
    """
    digits = digits.replace(",", "")
    if len(digits) > _MAX_CARDINAL_DIGITS:
        return _digits(digits) + " th"
    return _tidy(num2words(int(digits), lang="en", to="ordinal"))


def year(digits: str) -> str:
    """A year as said: ``"1999"`` -> ``"nineteen ninety nine"``, ``"2005"`` -> ``"two thousand
    five"``, ``"1905"`` -> ``"nineteen oh five"``."""
    return _tidy(num2words(int(digits), lang="en", to="year"))


def _decade(digits: str) -> str:
    """``"1990"`` -> ``"nineteen nineties"``; ``"2000"`` -> ``"two thousands"``."""
    words = year(digits).split()
    last = words[-1]
    words[-1] = last[:-1] + "ies" if last.endswith("y") else last + "s"
    return " ".join(words)


# --- patterns --------------------------------------------------------------------------------

_INT = r"[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+"
_NUM = rf"(?P<int>{_INT})(?:\.(?P<frac>[0-9]+))?"
_START = r"(?<![\w])(?P<sign>[-\u2212](?=[0-9]))?(?<![\w])"
"""A number starts after a non-word character; a ``-`` right before it is a minus sign unless it
follows a word character (``COVID-19``, ``10-20`` keep their hyphen)."""
_END = r"(?![\w])"

_UNITS: dict[str, tuple[str, str]] = {
    "km/h": ("kilometer per hour", "kilometers per hour"),
    "kph": ("kilometer per hour", "kilometers per hour"),
    "mph": ("mile per hour", "miles per hour"),
    "km": ("kilometer", "kilometers"),
    "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"),
    "m": ("meter", "meters"),
    "mi": ("mile", "miles"),
    "ft": ("foot", "feet"),
    "kg": ("kilogram", "kilograms"),
    "mg": ("milligram", "milligrams"),
    "g": ("gram", "grams"),
    "lbs": ("pound", "pounds"),
    "lb": ("pound", "pounds"),
    "oz": ("ounce", "ounces"),
    "ml": ("milliliter", "milliliters"),
    "mL": ("milliliter", "milliliters"),
    "l": ("liter", "liters"),
    "L": ("liter", "liters"),
    "hrs": ("hour", "hours"),
    "hr": ("hour", "hours"),
    "h": ("hour", "hours"),
    "min": ("minute", "minutes"),
    "sec": ("second", "seconds"),
    "ms": ("millisecond", "milliseconds"),
    "s": ("second", "seconds"),
    "TB": ("terabyte", "terabytes"),
    "GB": ("gigabyte", "gigabytes"),
    "MB": ("megabyte", "megabytes"),
    "KB": ("kilobyte", "kilobytes"),
    "kB": ("kilobyte", "kilobytes"),
    "GHz": ("gigahertz", "gigahertz"),
    "MHz": ("megahertz", "megahertz"),
    "kHz": ("kilohertz", "kilohertz"),
    "Hz": ("hertz", "hertz"),
    "kW": ("kilowatt", "kilowatts"),
    "W": ("watt", "watts"),
    "V": ("volt", "volts"),
    "°C": ("degree Celsius", "degrees Celsius"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "°": ("degree", "degrees"),
}
_UNIT_RE = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))

_CURRENCIES = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", "", ""),
}
_SCALES = {"k": "thousand", "K": "thousand", "m": "million", "M": "million", "mn": "million"}
_SCALES.update({"b": "billion", "B": "billion", "bn": "billion"})

_TITLES = {
    "Mr": "Mister",
    "Mrs": "Missus",
    "Ms": "Miz",
    "Dr": "Doctor",
    "Prof": "Professor",
    "St": "Saint",
    "Mt": "Mount",
}
_STREETS = {"St": "Street", "Dr": "Drive"}
_ABBREVIATIONS = {"etc": "et cetera", "Etc": "Et cetera", "Jr": "Junior", "Sr": "Senior"}

_AM_PM = r"(?P<ap>[AaPp])(?:\.\s?|\s)?[Mm](?![A-Za-z])"
"""``am``, ``PM``, ``p.m``, ``p m``; a final period is left in place (it may end a sentence)."""

_YEAR_CONTEXT = (
    r"(?i:in|since|by|from|until|till|during|before|after|of|year|circa|around|early|late|mid"
    r"|spring|summer|autumn|fall|winter)"
)


_AFTER_DOT = re.compile(r"\s*(?P<c>.)?", re.DOTALL)


def _keep_dot(m: re.Match[str]) -> str:
    """The matched abbreviation's period where it may also end a sentence: at the end of the
    text or before whitespace and a word that is not lower-case. Dropped before a lower-case
    word or other punctuation (``"Main St. is"``, ``"St., "``)."""
    if not m["dot"]:
        return ""
    end = m.end()
    if end == len(m.string):
        return "."
    nxt = _AFTER_DOT.match(m.string, end)["c"]
    return "." if m.string[end].isspace() and (nxt is None or not nxt.islower()) else ""


def _abbreviation(m: re.Match[str]) -> str:
    return _ABBREVIATIONS[m["abbr"]] + _keep_dot(m)


def _street(m: re.Match[str]) -> str:
    return f"{m['name']} {_STREETS[m['abbr']]}{_keep_dot(m)}"


def _title(m: re.Match[str]) -> str:
    words = _TITLES[m["abbr"]]
    if (
        m["word"] is not None
    ):  # "Dr. Smith", "Mr. and Mrs. Jones": the period is the abbreviation's only
        return words
    if m["dot"]:  # "... asked the Dr." : the period may end the sentence
        return words + _keep_dot(m)
    return words if m["cap"] is not None else m[0]  # "Dr Smith" without a period, not a bare "St"


def _valid_day(day: int) -> bool:
    return 1 <= day <= 31


def _month_day_year(month: int, day: int, year_digits: str | None) -> str:
    words = f"{MONTHS[month - 1]} {ordinal(str(day))}"
    return f"{words}, {year(year_digits)}" if year_digits else words


def _iso_date(m: re.Match[str]) -> str:
    month, day = int(m["month"]), int(m["day"])
    if not (1 <= month <= 12 and _valid_day(day)):
        return m[0]
    return _month_day_year(month, day, m["year"])


def _slash_date(m: re.Match[str]) -> str:
    a, b = int(m["a"]), int(m["b"])
    if 1 <= a <= 12 and _valid_day(b):  # US: month/day/year
        month, day = a, b
    elif 1 <= b <= 12 and 13 <= a <= 31:  # the first number cannot be a month: day/month/year
        month, day = b, a
    else:
        return m[0]
    return _month_day_year(month, day, m["year"])


def _month_name_date(m: re.Match[str]) -> str:
    day = int(m["day"])
    if not _valid_day(day) or (m["dot"] and len(m["month"]) > 4):  # "in March. 15 came"
        return m[0]
    return _month_day_year(_MONTH_OF[m["month"]], day, m["year"])


def _day_month_date(m: re.Match[str]) -> str:
    day = int(m["day"])
    if not _valid_day(day):
        return m[0]
    month = MONTHS[_MONTH_OF[m["month"]] - 1]
    words = f"the {ordinal(str(day))} of {month}"
    return f"{words}, {year(m['year'])}" if m["year"] else words


def _ap(m: re.Match[str]) -> str:
    return " a m" if m["ap"] in "Aa" else " p m"


def _clock(m: re.Match[str]) -> str:
    hour, minute = int(m["hour"]), int(m["minute"])
    ap = _ap(m) if m["ap"] else ""
    hour_words = cardinal(str(hour))
    if minute == 0:
        if ap:
            return hour_words + ap
        return f"{hour_words} o'clock" if 1 <= hour <= 12 else f"{hour_words} hundred"
    minute_words = f"oh {_DIGITS[minute]}" if minute < 10 else cardinal(str(minute))
    return f"{hour_words} {minute_words}{ap}"


def _hour_ap(m: re.Match[str]) -> str:
    return cardinal(str(int(m["hour"]))) + _ap(m)


def _money(m: re.Match[str]) -> str:
    one, many, minor_one, minor_many = _CURRENCIES[m["cur"]]
    sign = "minus " if m["sign"] else ""
    integer, fraction = m["int"], m["frac"]
    scale = m["scale"] or _SCALES.get(m["suffix"] or "", "")
    if scale:
        return f"{sign}{number_words(integer, fraction)} {scale} {many}"
    if fraction and (len(fraction) != 2 or not minor_many):
        return f"{sign}{number_words(integer, fraction)} {many}"
    major = int(integer.replace(",", ""))
    minor = int(fraction) if fraction else 0
    parts = []
    if major or not minor:
        parts.append(f"{cardinal(integer)} {one if major == 1 else many}")
    if minor:
        parts.append(f"{cardinal(str(minor))} {minor_one if minor == 1 else minor_many}")
    return sign + " and ".join(parts)


def _number(m: re.Match[str]) -> str:
    return number_words(m["int"], m["frac"], negative=bool(m["sign"]))


def _percent(m: re.Match[str]) -> str:
    return _number(m) + " percent"


def _ordinal(m: re.Match[str]) -> str:
    return ordinal(m["int"])


def _measure(m: re.Match[str]) -> str:
    one, many = _UNITS[m["unit"]]
    exactly_one = m["int"] == "1" and not m["frac"] and not m["sign"]
    return f"{_number(m)} {one if exactly_one else many}"


def _year(m: re.Match[str]) -> str:
    return f"{m['pre']}{m['space']}{year(m['year'])}"


def _leftover_digits(m: re.Match[str]) -> str:
    text, start, end = m.string, m.start(), m.end()
    words = cardinal(m[0])
    if start > 0 and text[start - 1].isalnum():
        words = " " + words
    if end < len(text) and text[end].isalnum():
        words += " "
    return words


_Pass = tuple[re.Pattern[str], Callable[[re.Match[str]], str] | str]

_PASSES: tuple[_Pass, ...] = (
    # abbreviations (before numbers: "No. 5")
    (
        re.compile(r"\b(?P<name>[A-Z][a-z]+)\s+(?P<abbr>St)\b(?P<dot>\.)?+(?!\s+[A-Z]|\w)"),
        _street,
    ),
    (  # "Mulholland Dr." but "My Dr. said": Drive only before punctuation or the end
        re.compile(r"\b(?P<name>[A-Z][a-z]+)\s+(?P<abbr>Dr)\b(?P<dot>\.)?+(?!\s+[A-Za-z]|\w)"),
        _street,
    ),
    (
        re.compile(
            r"\b(?P<abbr>" + "|".join(_TITLES) + r")\b"
            r"(?:(?P<dot>\.)(?P<word>(?=\s+[A-Za-z]))?|(?P<cap>(?=\s+[A-Z])))?"
        ),
        _title,
    ),
    (re.compile(r"\b[Ee]\.\s?[Gg]\.(?!\w)"), "for example"),
    (re.compile(r"\b[Ii]\.\s?[Ee]\.(?!\w)"), "that is"),
    (re.compile(r"\b(?:vs|Vs|VS)\b\.?"), "versus"),
    (re.compile(r"\b(?P<abbr>etc|Etc|Jr|Sr)\b(?P<dot>\.)?+"), _abbreviation),
    (re.compile(r"\b(?:No|no|Nos|nos)\.\s*(?=[0-9])"), "number "),
    # dates
    (
        re.compile(
            r"(?<![\w-])(?P<year>1[0-9]{3}|20[0-9]{2})-(?P<month>[0-9]{1,2})-(?P<day>[0-9]{1,2})"
            r"(?![\w-])"
        ),
        _iso_date,
    ),
    (
        re.compile(r"(?<![\w/])(?P<a>[0-9]{1,2})/(?P<b>[0-9]{1,2})/(?P<year>[0-9]{4})(?![\w/])"),
        _slash_date,
    ),
    (
        re.compile(
            rf"\b(?P<month>{_MONTH_RE})(?P<dot>\.)?\s+(?P<day>[0-9]{{1,2}})(?:st|nd|rd|th)?(?![\w:])"
            r"(?:,?\s+(?P<year>[0-9]{4})(?![\w]))?"
        ),
        _month_name_date,
    ),
    (
        re.compile(
            rf"(?<![\w.,])(?P<day>[0-9]{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<month>{_MONTH_RE})"
            r"\b(?:\.?,?\s+(?P<year>[0-9]{4})(?![\w]))?"
        ),
        _day_month_date,
    ),
    # times
    (
        re.compile(
            r"(?<![\w:.])(?P<hour>[01]?[0-9]|2[0-3]):(?P<minute>[0-5][0-9])"
            rf"(?:\s?{_AM_PM}|(?![\w:]|\.[0-9]))"
        ),
        _clock,
    ),
    (re.compile(rf"(?<![\w:.])(?P<hour>1[0-2]|0?[1-9])\s?{_AM_PM}"), _hour_ap),
    # money, decades, percentages, ordinals, measurements
    (
        re.compile(
            r"(?<![\w])(?P<sign>[-\u2212])?(?P<cur>[$€£¥])\s?"
            + _NUM
            + r"(?:\s+(?P<scale>thousand|million|billion|trillion)\b"
            r"|(?P<suffix>mn|bn|[kKmMbB])(?![\w]))?"
        ),
        _money,
    ),
    (
        re.compile(r"(?<![\w])(?P<y>1[0-9]{2}0|20[0-9]0)s\b"),
        lambda m: _decade(m["y"]),
    ),
    (re.compile(_START + _NUM + r"\s?%"), _percent),
    (re.compile(r"(?<![\w])(?P<int>" + _INT + r")(?i:st|nd|rd|th)" + _END), _ordinal),
    (re.compile(_START + _NUM + rf"\s?(?P<unit>{_UNIT_RE})(?![\w/])"), _measure),
    # years
    (
        re.compile(
            rf"\b(?P<pre>{_YEAR_CONTEXT}|{_MONTH_RE})(?P<space>\s+)"
            r"(?P<year>1[0-9]{3}|20[0-9]{2})(?![\w]|[.,][0-9])"
        ),
        _year,
    ),
    # every other number, then digits stuck to letters
    (re.compile(_START + _NUM + _END), _number),
    (re.compile(r"[0-9]+"), _leftover_digits),
)


def normalize(text: str) -> str:
    """Spell out the numbers, dates, times, money and abbreviations of English ``text``.

    Text outside the rewritten spans is kept character for character (case, punctuation,
    newlines); the result holds no ASCII digit.

    >>> normalize("Mr. Jones came on 15/03/2024 at 8:05 a.m. with €3.")
    'Mister Jones came on March fifteenth, twenty twenty four at eight oh five a m. with three \
euros.'
    >>> normalize("The 21st, in 1999, ran 10kg vs. 1 km; -3.5 and 007.")
    'The twenty first, in nineteen ninety nine, ran ten kilograms versus one kilometer; minus \
three point five and zero zero seven.'
    """
    for pattern, replacement in _PASSES:
        text = pattern.sub(replacement, text)
    return text
