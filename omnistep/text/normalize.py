"""English text normalisation for speech: numbers, dates, times, money and abbreviations to words.

``normalize`` rewrites the spans a speech model cannot read reliably and leaves every other
character of the text as it is (words, punctuation, newlines), so sentence splitting still works
on its output. Number words come from ``omnistep.text.numbers`` over ``num2words`` (American
style: no "and", no hyphens, no commas: ``"one hundred five"``, ``"forty two"``). Numbers are read
as people say them, which depends on what the digits are: an amount, a year, a phone number, a
range, a version.

What it covers, in the order the passes run:

- abbreviations: titles (``Dr.`` -> Doctor, ``Mr.`` -> Mister, ``Mrs.`` -> Missus, ``Ms.`` ->
  Miz, ``Prof.`` -> Professor, ``St.`` -> Saint, ``Mt.`` -> Mount); ``St.`` after a capitalised
  word or an ordinal (``5th St.``) and not before a capitalised word -> Street (``Dr.`` -> Drive
  only before punctuation or the end: ``"Mulholland Dr."``); ``e.g.`` -> for example, ``i.e.``
  -> that is, ``vs.`` -> versus, ``etc.`` -> et cetera, ``Jr.``/``Sr.``; before a number ``No.
  5``, ``#5`` and ``number #5`` -> number five (``Nos.`` -> numbers), ``ext. 12`` -> extension
  twelve. An abbreviation that can end a sentence (``etc.``, ``Jr.``, Street) keeps its period
  before a word that is not lower-case, so ``"... etc. Then"`` still ends a sentence there.
  ``"Main St. Then"`` is read "Main Saint Then": a capitalised word after ``St.`` makes it a
  title. A digit next to an abbreviation counts as a word boundary (``"5Dr. Lee"``), as it does
  once the digit is read, so normalising twice changes nothing more.
- phone numbers, read digit by digit in their groups with a comma (a pause) between groups, zero
  as "zero": US forms ``555-867-5309``, ``(555) 867-5309``, ``555.867.5309``, ``555 867 5309``,
  ``+1 555 ...``, ``1-800-...`` -> ``"five five five, eight six seven, five three zero nine"``; an
  area code N00 is said as a number (``1-800-555-0199`` -> ``"one eight hundred, five five five,
  zero one nine nine"``); ``+44 20 7946 0958`` (and ``+44 (0)20 ...``) -> ``"plus four four, two
  zero, seven nine four six, zero nine five eight"`` (8 to 15 digits, E.164); national numbers
  with their leading zero (``020 7946 0958``, 10 or 11 digits); the local ``867-5309`` unless it
  looks like a range of round numbers (``500-1000``) with no cue word (call, phone, tel, dial,
  fax, number, ...) before it. The same digit-by-digit reading for ZIP codes (after ``ZIP``/``zip
  code`` or a state code: ``CA 90210``; ``90210-1234`` anywhere), PINs (``PIN 1234``) and
  three-digit dialling codes after call/dial/text (``dial 911`` -> ``"dial nine one one"``).
  Not phone numbers: ``10-20``, ``1999-2000``, ``2024-03-15``, a bare ``90210``.
- dates: ISO ``2024-03-15``; ``03/15/2024`` read as **US month/day/year** (``15/03/2024``, where
  the first number cannot be a month, is read day/month); ``15.03.2024`` day.month.year;
  ``March 15, 2024``, ``Mar. 15``, ``March 10-15``, ``15 March 2024``, ``10th-12th of May`` ->
  ``"March fifteenth, twenty twenty four"`` / ``"the fifteenth of March"``. A "the" already
  before the date is kept and not said twice (``on the 4th of May`` -> ``"on the fourth of
  May"``, ``the 2024-03-15`` -> ``"the fifteenth of March, twenty twenty four"``), nor is one
  added after and/or/to (``the 1st and 2nd of June``).
- versions and addresses: ``v2.0.1`` / ``version 3.10`` -> ``"version two point zero point one"``
  / ``"version three point ten"`` (each part a whole number); three or more dotted parts
  (``3.2.1``) the same without "version"; four parts up to 255 are an IPv4 address read with
  "dot". ``Python 3.12`` stays a decimal ("three point one two").
- ranges: a hyphen or en dash between two numbers is read "to" (``10-20`` -> ``"ten to
  twenty"``, also scores: ``3-2`` -> ``"three to two"``), each side an amount, time, percentage,
  ordinal or decade (``$5-10``, ``9am-5pm``, ``5-10%``, ``1st-3rd``, ``1990s-2000s``); a range of
  years reads as years (``1939-1945``, ``1990-95`` -> ``"nineteen ninety to ninety five"``,
  ``2024-03`` -> ``"March twenty twenty four"``). A chain (``1-2-3``) is no range.
- fractions: ``3/4`` -> ``"three quarters"``, ``2 1/2`` -> ``"two and a half"``, ``½``, ``2½``;
  a proper fraction with a denominator up to 10 (or 12, 16, 32, 64, 100). After on/by/until/...
  ``3/4`` is a date ("on March fourth"); other pairs read as two numbers (``24/7`` -> ``"twenty
  four seven"``, ``50/50``, ``9/11``).
- times: ``3:45 pm`` -> ``"three forty five p.m."``, ``15:30`` -> ``"fifteen thirty"``, ``8:05``
  -> ``"eight oh five"``, ``12:00`` -> ``"twelve o'clock"``, ``3 pm`` -> ``"three p.m."``,
  ``23:59:59`` -> ``"twenty three fifty nine and fifty nine seconds"``, ``24:00`` -> ``"twenty
  four hundred"``. A colon pair that is no time is a duration when the second number has two
  digits (``45:30`` -> ``"forty five thirty"``) and a ratio otherwise (``16:9``, ``3:1``,
  ``100:1`` -> ``"sixteen to nine"``).
- heights ``5'10"`` -> ``"five foot ten"``; dimensions ``1920x1080`` -> ``"nineteen twenty by ten
  eighty"`` (three- and four-digit sizes in pairs, as said), ``2x4`` -> ``"two by four"``, "times"
  before ``=``; multipliers ``3x``, ``10X``, ``2.5x``, ``3×`` -> ``"three times"`` and ``x2`` ->
  ``"times two"``, but not hexadecimal (``0x1F``), ``x86``/``x64``, or algebra (``2x + 3``);
  video resolutions ``1080p`` -> ``"ten eighty p"``.
- currency: ``$``, ``€``, ``£``, ``¥`` before an amount, with an optional scale (``$1.5 million``,
  ``$5k``): ``$12.50`` -> ``"twelve dollars and fifty cents"``, ``€3`` -> ``"three euros"``; a
  currency word written after it is said once (``$5 dollars`` -> ``"five dollars"``); ``50¢``.
- decades (``1990s``; ``'90s``, and ``90s`` after the/his/early/mid/... -> ``"nineties"``;
  ``30s`` alone stays thirty seconds), two-digit years after a year word (``class of '99``),
  eras (``500 BC``, ``AD 1066``), percentages (``45%``, a ``percent`` after it said once),
  ordinals (``21st``), measurements after a number (``5 km``, ``10kg``, ``1 ft`` -> ``"one
  foot"``; singular as an adjective: ``a 10 km run``, ``10-km run`` -> ``"ten kilometer run"``),
  years after a preposition, a month, ``Q3``/``H1``/``FY`` (``in 1999`` -> ``"in nineteen
  ninety nine"``; ``from 1990 to 2000`` reads both).
- every other number: cardinals with sign, thousands separators and decimals (``-1,234.5`` ->
  ``"minus one thousand two hundred thirty four point five"``, ``.5`` -> ``"point five"``);
  numbers with a leading zero or more than 15 digits are read digit by digit; digits stuck to
  letters are read too (``mp3`` -> ``"mp three"``). No ASCII digit is left in the output.

Left as they are (a reading needs more than the digits): a bare four-digit number is an amount
(``2024 was`` -> "two thousand twenty four"); model and room numbers are amounts (``Boeing 747``
-> "seven hundred forty seven", ``room 101``); ``Genesis 1:1`` is a ratio ("one to one");
``10x engineers`` -> "ten times engineers"; European number formats (``1.000.000``, ``2,5``);
scientific notation (``1e6``); arithmetic signs (``+``, ``=``, ``^``) stay for the phonemizer.

Measured against espeak-ng (which the piper card's phonemizer runs): espeak already reads
cardinals, decimals, thousands separators, negatives, percentages and most ordinals, but reads
``$12.50`` as "dollar twelve point five zero", ``2024-03-15`` as "two thousand twenty four dash
zero three dash fifteen", ``12:00`` as "twelve zero zero", ``km`` and ``vs.`` letter by letter,
``100th`` as "one hundred th", ``555-867-5309`` as "five hundred fifty five dash eight hundred
...", ``10-20`` as "ten dash twenty", ``3/4`` as "three slash four", ``16:9`` as "sixteen colon
nine", ``3x``/``1920x1080`` with "ex", and ends a sentence at ``Dr.``/``Mr.``. Against hibari's
G2P (a port of misaki, the hibari and kokoro cards' phonemizer, whose own normaliser runs after
this one): on raw text it reads ``555-867-5309`` as "five hundred fifty five eight sixty seven
fifty three oh nine", ``(555) 867-5309`` and ``+44 20 7946 0958`` as amounts, ``3x`` and ``2x4``
with "ex", ``v2.0.1`` as "vee two zero one", ``5'10"`` as "five ten", ``9am`` as "nine um"; it
reads ``10-20``, ``3/4``, ``'90s`` and dates as this module does. Both phonemizers read "a m" (the
old output for ``am``) as the article "uh" and "em", and hibari reads "AM" before "to" as the
word "am"; "a.m." is read as the two letters by both. Everything is normalised here all the same:
one normaliser for every card (ChatTTS has none of its own), and the output of a card then does
not depend on what its phonemizer happens to know.

Imports: stdlib and ``num2words`` (through ``omnistep.text.numbers``) only.

Examples:
    >>> normalize("Dr. Smith paid $12.50 on 2024-03-15.")
    'Doctor Smith paid twelve dollars and fifty cents on March fifteenth, twenty twenty four.'
    >>> normalize("At 3:45 pm, 45% of 1,234 ran 5 km.")
    'At three forty five p.m., forty five percent of one thousand two hundred thirty four ran five \
kilometers.'
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from fractions import Fraction

from omnistep.text.numbers import (
    DIGIT_WORDS,
    cardinal,
    decade,
    digits,
    fraction,
    number_words,
    ordinal,
    pairs,
    year,
)

__all__ = ["cardinal", "normalize", "number_words", "ordinal", "year"]

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

_AM_PM = r"(?P<ap>[AaPp])(?:\.\s?|\s)?[Mm]\.?(?![A-Za-z])"
"""``am``, ``PM``, ``p.m.``, ``p m``; read "a.m."/"p.m.", whose final period also ends a
sentence where the source's did."""

_YEAR_CONTEXT = (
    r"(?i:in|since|by|from|until|till|during|before|after|of|year|circa|around|early|late|mid"
    r"|between"
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


_PHONE_CUE_BEFORE = re.compile(
    r"(?<![^\W\d_])(?i:call|calling|phone|tel|telephone|dial|fax|text|mobile|cell|ring|contact"
    r"|reach|number|hotline)(?![^\W\d_])[^0-9]{0,12}$"
)
"""Words that make a ``NXX-XXXX`` that looks like a range (``200-1000``) a phone number."""

_US_STATE_RE = (
    r"A[KLRZ]|C[AOT]|D[CE]|FL|GA|HI|I[ADLN]|K[SY]|LA|M[ADEINOST]|N[CDEHJMVY]|O[HKR]|P[AR]|RI"
    r"|S[CD]|T[NX]|UT|V[AT]|W[AIVY]"
)
"""The US state postal codes: a five-digit number after one is a ZIP code ("CA 90210")."""

_RESOLUTIONS = {"240", "360", "480", "576", "720", "1080", "1440", "2160", "4320"}
_ARCHITECTURES = {"32", "64", "86"}
"""``x86``, ``x64``: read as written ("x eighty six"), not as a multiplier."""

_NO_DIGIT_AFTER = r"(?![\w]|[-.,][0-9])"
"""The end of a digit group: no word character, and no separator that goes on with digits."""


_BEFORE_WINDOW = 40
"""Characters looked at before a match for a cue word ("call", "the", "ZIP")."""


def _before(m: re.Match[str], cue: re.Pattern[str]) -> bool:
    """Whether ``cue`` (a pattern anchored with ``$``) ends right where ``m`` starts. Cue words
    are looked up here instead of inside the passes' patterns: a pattern that starts with an
    optional word is tried at every character of the text and made plain text 4x slower."""
    return cue.search(m.string, max(0, m.start() - _BEFORE_WINDOW), m.start()) is not None


_THE_BEFORE = re.compile(r"(?<![^\W\d_])[Tt][Hh][Ee]\s+$")
_NO_THE_AFTER = re.compile(r"(?<![^\W\d_])(?i:the|and|or|to|through|till|until)\s+$")
"""A day-month date after one of these words gets no "the" of its own: "the 4th of May" -> "the
fourth of May", "the 1st and 2nd of June" -> "the first and second of June"."""
_DATE_WORD_BEFORE = re.compile(
    r"(?<![^\W\d_])(?i:on|by|until|till|from|since|before|after|through|due|dated)\s+$"
)
_ARTICLE_BEFORE = re.compile(r"(?<![^\W\d_])[Aa]n?\s+$")
_DECADE_CUE_BEFORE = re.compile(
    r"(?<![^\W\d_])(?i:the|his|her|their|my|your|our|its|early|mid|late)(?:\s+|-)$"
)
_NUMBER_WORD_BEFORE = re.compile(r"(?<![^\W\d_])(?i:number)\s*$")
_ZIP_CUE_BEFORE = re.compile(
    r"(?:(?<![^\W\d_])(?:ZIP|Zip|zip)(?:\s*\+\s*4)?(?:\s+[Cc]ode)?:?\s*"
    rf"|(?<![^\W\d_])(?:{_US_STATE_RE})\s+)$"
)
_PIN_CUE_BEFORE = re.compile(r"(?<![^\W\d_])PIN:?\s*$")
_DIAL_CUE_BEFORE = re.compile(
    r"(?<![^\W\d_])(?i:call|calling|dial|dialing|dialled|dialed|ring|text)\s+$"
)


def _valid_day(day: int) -> bool:
    return 1 <= day <= 31


def _month_day_year(month: int, day: int, year_digits: str | None) -> str:
    words = f"{MONTHS[month - 1]} {ordinal(str(day))}"
    return f"{words}, {year(year_digits)}" if year_digits else words


def _the_date(m: re.Match[str], month: int, day: int, year_digits: str | None) -> str:
    """A numeric date; after "the" it reads "fifteenth of March" so "the" is not doubled ("on
    the 2024-03-15" -> "on the fifteenth of March, twenty twenty four")."""
    if not _before(m, _THE_BEFORE):
        return _month_day_year(month, day, year_digits)
    words = f"{ordinal(str(day))} of {MONTHS[month - 1]}"
    return f"{words}, {year(year_digits)}" if year_digits else words


def _iso_date(m: re.Match[str]) -> str:
    month, day = int(m["month"]), int(m["day"])
    if not (1 <= month <= 12 and _valid_day(day)):
        return m[0]
    return _the_date(m, month, day, m["year"])


def _slash_date(m: re.Match[str]) -> str:
    a, b = int(m["a"]), int(m["b"])
    if 1 <= a <= 12 and _valid_day(b):  # US: month/day/year
        month, day = a, b
    elif 1 <= b <= 12 and 13 <= a <= 31:  # the first number cannot be a month: day/month/year
        month, day = b, a
    else:
        return m[0]
    return _the_date(m, month, day, m["year"])


def _dotted_date(m: re.Match[str]) -> str:
    day, month = int(m["day"]), int(m["month"])
    if not (1 <= month <= 12 and _valid_day(day)):
        return m[0]
    return _the_date(m, month, day, m["year"])


def _month_name_date(m: re.Match[str]) -> str:
    day = int(m["day"])
    if not _valid_day(day) or (m["dot"] and len(m["month"]) > 4):  # "in March. 15 came"
        return m[0]
    words = _month_day_year(_MONTH_OF[m["month"]], day, None)
    if m["day2"]:
        if not int(m["day"]) < int(m["day2"]) <= 31:
            return m[0]
        words += " to " + ordinal(m["day2"])
    return f"{words}, {year(m['year'])}" if m["year"] else words


def _day_month_date(m: re.Match[str]) -> str:
    day = int(m["day"])
    if not _valid_day(day) or (m["day1"] and not 1 <= int(m["day1"]) < day):
        return m[0]
    month = MONTHS[_MONTH_OF[m["month"]] - 1]
    the = "" if _before(m, _NO_THE_AFTER) else "the "
    first = f"{ordinal(m['day1'])} to " if m["day1"] else ""
    words = f"{the}{first}{ordinal(str(day))} of {month}"
    return f"{words}, {year(m['year'])}" if m["year"] else words


# --- phone numbers, ZIP codes, PINs: digit by digit, in groups -----------------------------


def _phone_groups(groups: list[str]) -> str:
    """Phone groups digit by digit, a comma between groups (a pause): ``["555", "867", "5309"]``
    -> ``"five five five, eight six seven, five three zero nine"``."""
    return ", ".join(digits(g) for g in groups)


def _us_phone(m: re.Match[str]) -> str:
    area = m["area_p"] or m["area"]
    spaced = m["area"] and m["s1"] == " " and not m["cc"]
    if m["area"] and m["s1"] != m["s2"] or spaced and "1" in (area[0], m["exchange"][0]):
        return m[0]  # "555-867 5309", or three spaced numbers that are no US phone number
    # toll-free and other N00 area codes are said as a number: "one eight hundred"
    area_words = cardinal(area) if area.endswith("00") and area[0] != "0" else digits(area)
    rest = _phone_groups([m["exchange"], m["line"]])
    if not m["cc"]:
        return f"{area_words}, {rest}"
    if m["plus"]:
        return f"plus one, {area_words}, {rest}"
    return f"one {area_words}, {rest}"


def _international_phone(m: re.Match[str]) -> str:
    groups = re.findall(r"\(0\)|[0-9]+", m["body"])
    groups = [g for g in groups if g != "(0)"]  # the trunk prefix "+44 (0)20" is not dialled
    if not 8 <= sum(len(g) for g in groups) <= 15:  # E.164: at most 15 digits
        return m[0]
    return "plus " + _phone_groups(groups)


def _national_phone(m: re.Match[str]) -> str:
    groups = re.findall(r"[0-9]+", m["body"])
    if not 10 <= sum(len(g) for g in groups) <= 11:
        return m[0]
    return _phone_groups(groups)


def _local_phone(m: re.Match[str]) -> str:
    exchange, line = m["exchange"], m["line"]
    looks_like_range = int(exchange) % 10 == 0 and int(line) % 10 == 0 and int(line) > int(exchange)
    if looks_like_range and not _before(m, _PHONE_CUE_BEFORE):
        return m[0]  # "500-1000 words" is a range
    return _phone_groups([exchange, line])


def _zip_code(m: re.Match[str]) -> str:
    """``90210-1234`` anywhere, ``90210`` after ``ZIP`` or a state code: digit by digit."""
    if m["plus4"]:
        return _phone_groups([m["code"], m["plus4"]])
    return _phone_groups([m["code"]]) if _before(m, _ZIP_CUE_BEFORE) else m[0]


def _cued_code(cue: re.Pattern[str]) -> Callable[[re.Match[str]], str]:
    """A PIN or dialling code: digit by digit after its ``cue``, else left to later passes."""
    return lambda m: digits(m[0]) if _before(m, cue) else m[0]


# --- versions, ranges, fractions, ratios, dimensions, multipliers ---------------------------


def _version(m: re.Match[str]) -> str:
    parts = m["parts"].split(".")
    if m["v"] or m["word"]:
        prefix = "version " if m["v"] else m["word"]
        return prefix + " point ".join(cardinal(p) for p in parts)
    if len(parts) < 3:
        return m[0]  # a decimal: read later
    if len(parts) == 4 and all(int(p) <= 255 for p in parts):
        return " dot ".join(cardinal(p) for p in parts)  # an IPv4 address
    return " point ".join(cardinal(p) for p in parts)  # "3.2.1": a section or version


def _year_range(a: str, b: str) -> str | None:
    """``1939-1945`` -> "nineteen thirty nine to nineteen forty five"; ``1990-95`` -> "nineteen
    ninety to ninety five"; ``2024-03`` -> "March twenty twenty four" (a year and month). None
    when the pair is no range of years."""
    first = int(a)
    if len(a) != 4 or not 1000 <= first <= 2099:
        return None
    if len(b) == 4 and first < int(b) <= 2099:
        return f"{year(a)} to {year(b)}"
    if len(b) != 2:
        return None
    full = first // 100 * 100 + int(b)
    if full > first:
        start, end = year(a).split(), year(str(full)).split()
        same_century = len(start) > 1 and start[0] == end[0] and start[1] != "thousand"
        return f"{year(a)} to {' '.join(end[1:]) if same_century else year(str(full))}"
    if b[0] == "0" and 1 <= int(b) <= 12:
        return f"{MONTHS[int(b) - 1]} {year(a)}"
    return None


def _range(m: re.Match[str]) -> str:
    """``10-20`` -> ``10 to 20``: the numbers on each side are read by the later passes (money,
    percentages, times); a range of years is read here."""
    a, b = m["a"], m["b"]
    if a.isdigit() and b.isdigit():
        years = _year_range(a, b)
        if years:
            return years
    if a[0] in _CURRENCIES and b[0] not in _CURRENCIES:
        b = a[0] + b  # "$5-10": "five dollars to ten dollars"
    return f"{a} to {b}"


def _slash_pair(m: re.Match[str]) -> str:
    """``3/4`` -> "three quarters", ``2 1/2`` -> "two and a half", ``on 3/4`` -> "on March
    fourth", ``24/7`` and ``50/50`` -> the two numbers ("twenty four seven", "fifty fifty")."""
    n, d = int(m["n"]), int(m["d"])
    whole = m["whole"]
    if whole is None and 1 <= n <= 12 and _valid_day(d) and _before(m, _DATE_WORD_BEFORE):
        return _month_day_year(n, d, None)
    if 0 < n < d and (d <= 10 or d in (12, 16, 32, 64, 100)):
        return fraction(n, d, whole)
    return (f"{whole} " if whole else "") + f"{m['n']} {m['d']}"


def _vulgar_fraction(m: re.Match[str]) -> str:
    value = Fraction(unicodedata.numeric(m["v"])).limit_denominator(100)
    return fraction(value.numerator, value.denominator, m["whole"])


def _colon_pair(m: re.Match[str]) -> str:
    """What the clock pass leaves: ``45:30`` (a duration) -> "forty five thirty"; ``16:9``,
    ``3:1``, ``100:1`` (ratios, odds) -> "sixteen to nine"."""
    a, b = m["a"], m["b"]
    if len(b) == 2 and int(b) <= 59:
        return f"{cardinal(a)} {_minute_words(int(b))}"
    return f"{cardinal(a)} to {cardinal(b)}"


def _dimension_number(number: str) -> str:
    integer, _, frac = number.partition(".")
    return number_words(integer, frac) if frac else pairs(integer)


def _dimensions(m: re.Match[str]) -> str:
    """``1920x1080`` -> "nineteen twenty by ten eighty", ``2x4`` -> "two by four"; "times"
    before ``=`` (``3 x 4 = 12``). A unit after the last number is left to the unit pass."""
    a, b, c = m["a"], m["b"], m["c"]
    if a == "0" and not m["s"] and m["op"] in "xX":
        return m[0]  # hexadecimal 0x1F
    word = " times " if _EQUALS_AFTER.match(m.string, m.end()) else " by "
    numbers = [n for n in (a, b, c) if n]
    last = numbers[-1]
    if _UNIT_AFTER.match(m.string, m.end()) is None:
        last = _dimension_number(last)
    return word.join([*(_dimension_number(n) for n in numbers[:-1]), last])


def _times_after(m: re.Match[str]) -> str:
    integer, _, frac = m["num"].partition(".")
    return number_words(integer, frac) + " times"


def _times_before(m: re.Match[str]) -> str:
    if m["x"] == "x" and m["num"] in _ARCHITECTURES:
        return m[0]
    integer, _, frac = m["num"].partition(".")
    return "times " + number_words(integer, frac)


# --- times -----------------------------------------------------------------------------------


def _ap(m: re.Match[str]) -> str:
    """``am``/``PM`` -> " a.m."/" p.m.": both phonemizers (espeak, hibari's misaki port) read
    "a.m." as the two letters; "a m" was read as the article "uh" and "em", and hibari reads
    "AM" before "to" as the word "am" ("nine AM to five")."""
    return " a.m." if m["ap"] in "Aa" else " p.m."


def _minute_words(minute: int) -> str:
    if minute == 0:
        return "hundred"
    return f"oh {DIGIT_WORDS[minute]}" if minute < 10 else cardinal(str(minute))


def _clock(m: re.Match[str]) -> str:
    hour, minute = int(m["hour"]), int(m["minute"])
    ap = _ap(m) if m["ap"] else ""
    words = cardinal(str(hour))
    if minute == 0 and (ap or m["oclock"]):
        words += ap
    elif minute == 0 and 1 <= hour <= 12:
        words += " o'clock"
    else:
        words += f" {_minute_words(minute)}{ap}"
    if m["second"] and int(m["second"]):
        second = int(m["second"])
        words += f" and {cardinal(str(second))} {'second' if second == 1 else 'seconds'}"
    return words + (m["oclock"] or "")


def _hour_ap(m: re.Match[str]) -> str:
    return cardinal(str(int(m["hour"]))) + _ap(m)


def _feet_inches(m: re.Match[str]) -> str:
    return f"{cardinal(m['ft'])} foot {cardinal(m['inch'] or m['inch_'])}"


# --- money, percentages, ordinals, measurements, years ---------------------------------------


def _money(m: re.Match[str]) -> str:
    one, many, minor_one, minor_many = _CURRENCIES[m["cur"]]
    sign = "minus " if m["sign"] else ""
    integer, fraction_digits = m["int"], m["frac"]
    scale = m["scale"] or _SCALES.get(m["suffix"] or "", "")
    # "$5 dollars", "$1.5 million dollars": the currency word is said once
    dup = m["dup"] or ""
    if dup and dup.strip().rstrip("s") in (one, many.rstrip("s")):
        dup = ""
    if scale:
        return f"{sign}{number_words(integer, fraction_digits)} {scale} {many}{dup}"
    if fraction_digits and (len(fraction_digits) != 2 or not minor_many):
        return f"{sign}{number_words(integer, fraction_digits)} {many}{dup}"
    major = int(integer.replace(",", ""))
    minor = int(fraction_digits) if fraction_digits else 0
    parts = []
    if major or not minor:
        parts.append(f"{cardinal(integer)} {one if major == 1 else many}")
    if minor:
        parts.append(f"{cardinal(str(minor))} {minor_one if minor == 1 else minor_many}")
    return sign + " and ".join(parts) + dup


def _cents(m: re.Match[str]) -> str:
    exactly_one = m["int"] == "1" and not m["frac"] and not m["sign"]
    return f"{_number(m)} {'cent' if exactly_one else 'cents'}"


def _number(m: re.Match[str]) -> str:
    return number_words(m["int"], m["frac"], negative=bool(m["sign"]))


def _percent(m: re.Match[str]) -> str:
    return _number(m) + " percent"  # a "percent" written after "%" is dropped: said once


def _ordinal(m: re.Match[str]) -> str:
    return ordinal(m["int"])


def _short_decade(d: str) -> str:
    """``"90"`` -> "nineties", ``"00"`` -> "two thousands", ``"10"`` -> "twenty tens"."""
    if d == "00":
        return "two thousands"
    if d == "10":
        return "twenty tens"
    return decade("19" + d).split()[-1]


def _two_digit_year(y: str) -> str:
    """``"99"`` -> "ninety nine", ``"05"`` -> "oh five", ``"00"`` -> "two thousand"."""
    if y == "00":
        return "two thousand"
    return f"oh {DIGIT_WORDS[int(y)]}" if y[0] == "0" else cardinal(y)


def _measure(m: re.Match[str]) -> str:
    """A number and a unit; singular before a noun, as an adjective: ``a 10 km run`` and
    ``10-km run`` -> "ten kilometer run"."""
    one, many = _UNITS[m["unit"]]
    exactly_one = m["int"] == "1" and not m["frac"] and not m["sign"]
    adjective = m["sep"] == "-" or (m["noun"] and _before(m, _ARTICLE_BEFORE))
    return f"{_number(m)} {one if exactly_one or adjective else many}"


def _year(m: re.Match[str]) -> str:
    """A year after a year word (``in 1999``, ``May 2024``, ``Q3 2024``, ``FY2024``), and a
    second one joined to it (``from 1990 to 2000``)."""
    if not _before(m, _YEAR_WORD_BEFORE):
        return m[0]
    space = " " if m.start() and m.string[m.start() - 1].isalpha() else ""  # "FY2024"
    words = space + year(m["year"])
    return words + (f"{m['mid']}{year(m['year2'])}" if m["year2"] else "")


def _short_decade_after_cue(m: re.Match[str]) -> str:
    return _short_decade(m["d"]) if _before(m, _DECADE_CUE_BEFORE) else m[0]


def _two_digit_year_after_cue(m: re.Match[str]) -> str:
    return _two_digit_year(m["y"]) if _before(m, _APOSTROPHE_YEAR_BEFORE) else m[0]


def _leftover_digits(m: re.Match[str]) -> str:
    text, start, end = m.string, m.start(), m.end()
    words = cardinal(m[0])
    if start > 0 and text[start - 1].isalnum():
        words = " " + words
    if end < len(text) and text[end].isalnum():
        words += " "
    return words


_UNIT_AFTER = re.compile(rf"\s?(?:{_UNIT_RE})(?![\w/])")
_EQUALS_AFTER = re.compile(r"\s*=")

_RANGE_NUMBER = (
    r"[$€£¥]?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?::[0-5][0-9])?"
    r"(?:\s?%|\s?[AaPp]\.?[Mm]\.?(?![A-Za-z])|(?i:st|nd|rd|th)(?![A-Za-z])|(?<=0)s(?![A-Za-z]))?"
)
"""One side of a range: an amount, a time, a percentage, an ordinal or a decade."""

_YEAR_WORD_BEFORE = re.compile(
    rf"(?<![^\W\d_])(?:{_YEAR_CONTEXT}|{_MONTH_RE}|Q[1-4]|H[12])\s+$|(?<![^\W\d_])[FC]Y\s*$"
)
_APOSTROPHE_YEAR_BEFORE = re.compile(rf"(?<![^\W\d_])(?:{_YEAR_CONTEXT}|[Tt]he|[Cc]lass)\s+$")

_NO_LETTER_BEFORE = r"(?<![^\W\d_])"
"""An abbreviation starts after anything but a letter: a digit counts as a boundary, as it does
once the digit is read ("5Dr. Lee" -> "five Doctor Lee" in one pass, so normalising twice gives
the same text)."""

_Pass = tuple[re.Pattern[str], Callable[[re.Match[str]], str] | str]

_WORD_PASSES: tuple[_Pass, ...] = (
    # abbreviations (before numbers: "No. 5")
    (
        re.compile(
            _NO_LETTER_BEFORE + r"(?P<name>[A-Z][a-z]+|(?<![0-9])[0-9]+(?:st|nd|rd|th))"
            r"\s+(?P<abbr>St)(?![^\W\d_])(?P<dot>\.)?+"
            r"(?!\s+[A-Z]|[^\W\d_])"
        ),
        _street,
    ),
    (  # "Mulholland Dr." but "My Dr. said": Drive only before punctuation or the end
        re.compile(
            _NO_LETTER_BEFORE + r"(?P<name>[A-Z][a-z]+)\s+(?P<abbr>Dr)(?![^\W\d_])(?P<dot>\.)?+"
            r"(?!\s+[A-Za-z]|[^\W\d_])"
        ),
        _street,
    ),
    (
        re.compile(
            _NO_LETTER_BEFORE + r"(?P<abbr>" + "|".join(_TITLES) + r")(?![^\W\d_])"
            r"(?:(?P<dot>\.)(?P<word>(?=\s+[A-Za-z]))?|(?P<cap>(?=\s+[A-Z])))?"
        ),
        _title,
    ),
    (re.compile(_NO_LETTER_BEFORE + r"[Ee]\.\s?[Gg]\.(?!\w)"), "for example"),
    (re.compile(_NO_LETTER_BEFORE + r"[Ii]\.\s?[Ee]\.(?!\w)"), "that is"),
    (re.compile(_NO_LETTER_BEFORE + r"(?:vs|Vs|VS)(?![^\W\d_])\.?"), "versus"),
    (
        re.compile(_NO_LETTER_BEFORE + r"(?P<abbr>etc|Etc|Jr|Sr)(?![^\W\d_])(?P<dot>\.)?+"),
        _abbreviation,
    ),
    (re.compile(_NO_LETTER_BEFORE + r"(?:Nos|nos)\.\s*(?=[0-9])"), "numbers "),
    (re.compile(_NO_LETTER_BEFORE + r"(?:No|no)\.\s*#?\s*(?=[0-9])"), "number "),
    # "#1", "number #2", "No. #3" -> "number one": "number" said once
    (
        re.compile(r"(?<![\w&#])#\s?(?=[0-9])"),
        lambda m: "" if _before(m, _NUMBER_WORD_BEFORE) else "number ",
    ),
    (re.compile(_NO_LETTER_BEFORE + r"[Ee]xt\.?\s*(?=[0-9])"), "extension "),
)
"""The passes that also rewrite text without a number: abbreviations."""

_NUMBER_PASSES: tuple[_Pass, ...] = (
    # phone numbers, ZIP codes, PINs (before dates and ranges: "555-867-5309" is no range)
    (
        re.compile(
            r"(?<![\w.+-])(?:(?P<plus>\+)?(?P<cc>1)[-. ]?)?"
            r"(?:\((?P<area_p>[0-9]{3})\)\s?|(?P<area>[0-9]{3})(?P<s1>[-. ]))"
            r"(?P<exchange>[0-9]{3})(?P<s2>[-. ])(?P<line>[0-9]{4})" + _NO_DIGIT_AFTER
        ),
        _us_phone,
    ),
    (
        re.compile(
            r"(?<![\w+])\+(?P<body>[0-9]{1,3}(?:\s?\(0\))?"
            r"(?:(?:[-. ]|(?<=\)))\(?[0-9]{1,6}\)?){1,6}"
            r"|[0-9]{8,15})" + _NO_DIGIT_AFTER
        ),
        _international_phone,
    ),
    (  # a national number with its leading zero: "020 7946 0958", "07700 900123"
        re.compile(r"(?<![\w.+-])(?P<body>0[0-9]{1,4}(?:[-. ][0-9]{2,6}){1,4})" + _NO_DIGIT_AFTER),
        _national_phone,
    ),
    (
        re.compile(r"(?<![\w.,-])(?P<code>[0-9]{5})(?:-(?P<plus4>[0-9]{4}))?" + _NO_DIGIT_AFTER),
        _zip_code,
    ),
    (re.compile(r"(?<![\w.,-])[0-9]{4,8}" + _NO_DIGIT_AFTER), _cued_code(_PIN_CUE_BEFORE)),
    (
        re.compile(r"(?<![\w.,-])(?:[2-9]11|999|112)" + _NO_DIGIT_AFTER),
        _cued_code(_DIAL_CUE_BEFORE),
    ),
    (
        re.compile(r"(?<![\w.+-])(?P<exchange>[2-9][0-9]{2})-(?P<line>[0-9]{4})" + _NO_DIGIT_AFTER),
        _local_phone,
    ),
    # dates
    (
        re.compile(
            r"(?<![\w-])(?P<year>1[0-9]{3}|20[0-9]{2})-(?P<month>[0-9]{1,2})"
            r"-(?P<day>[0-9]{1,2})(?![\w-])"
        ),
        _iso_date,
    ),
    (
        re.compile(r"(?<![\w/])(?P<a>[0-9]{1,2})/(?P<b>[0-9]{1,2})/(?P<year>[0-9]{4})(?![\w/])"),
        _slash_date,
    ),
    (
        re.compile(
            r"(?<![\w.])(?P<day>[0-9]{1,2})\.(?P<month>[0-9]{1,2})\.(?P<year>[0-9]{4})"
            r"(?!\w|\.[0-9])"
        ),
        _dotted_date,
    ),
    (
        re.compile(
            rf"\b(?P<month>{_MONTH_RE})(?P<dot>\.)?\s+(?P<day>[0-9]{{1,2}})(?:st|nd|rd|th)?"
            r"(?:[-–](?P<day2>[0-9]{1,2})(?:st|nd|rd|th)?)?(?![\w:%])"
            r"(?:,?\s+(?P<year>[0-9]{4})(?![\w]))?"
        ),
        _month_name_date,
    ),
    (
        re.compile(
            r"(?<![\w.,])(?:(?P<day1>[0-9]{1,2})(?:st|nd|rd|th)?\s?[-–]\s?)?"
            rf"(?P<day>[0-9]{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?"
            rf"(?P<month>{_MONTH_RE})\b(?:\.?,?\s+(?P<year>[0-9]{{4}})(?![\w]))?"
        ),
        _day_month_date,
    ),
    # versions and IP addresses, ranges, fractions
    (
        re.compile(
            r"(?<![\w.])(?:(?P<v>v)|(?P<word>(?i:version|ver\.)\s*))?"
            r"(?P<parts>[0-9]+(?:\.[0-9]+)*)(?!\w|\.[0-9])"
        ),
        _version,
    ),
    (
        re.compile(
            rf"(?<![\w.,:/$€£¥+#\u2212-])(?P<a>{_RANGE_NUMBER})(?:-|\s?–\s?)(?P<b>{_RANGE_NUMBER})"
            r"(?![0-9]|[-–/:.,][0-9]|[-–][A-Za-z])"
        ),
        _range,
    ),
    (
        re.compile(
            r"(?<![\w./])(?:(?P<whole>[0-9]{1,3})\s+)?(?P<n>[0-9]+)/(?P<d>[0-9]+)"
            r"(?![0-9]|/[0-9]|[.,][0-9])"
        ),
        _slash_pair,
    ),
    (
        re.compile(r"(?:(?<![\w.])(?P<whole>[0-9]+)\s?)?(?<![^\W\d_])(?P<v>[¼½¾⅐⅑⅒⅓⅔⅕⅖⅗⅘⅙⅚⅛⅜⅝⅞])"),
        _vulgar_fraction,
    ),
    # times, then the colon pairs that are no time (durations, ratios)
    (
        re.compile(
            r"(?<![\w:.])(?P<hour>[01]?[0-9]|2[0-3]|24(?=:00))"
            r":(?P<minute>[0-5][0-9])(?::(?P<second>[0-5][0-9]))?"
            rf"(?:\s?{_AM_PM}|(?![\w:]|\.[0-9]))(?P<oclock>\s+o['’]clock\b)?"
        ),
        _clock,
    ),
    (re.compile(rf"(?<![\w:.])(?P<hour>1[0-2]|0?[1-9])\s?{_AM_PM}"), _hour_ap),
    (re.compile(r"(?<![\w:.])(?P<a>[0-9]+):(?P<b>[0-9]+)(?![\w:]|[.,][0-9])"), _colon_pair),
    # heights 5'10", dimensions 1920x1080, multipliers 3x and x2, resolutions 1080p
    (
        re.compile(
            r"(?<![\w.'’])(?P<ft>[0-9])['′’](?:(?P<inch>1[01]|[0-9])|\s(?P<inch_>1[01]|[0-9])(?=[\"″”]))"
            r"(?:\"|″|”|''|’’)?"
            r"(?![\w'’]|[.,][0-9])"
        ),
        _feet_inches,
    ),
    (
        re.compile(
            r"(?<![\w.])(?P<a>[0-9]+(?:\.[0-9]+)?)(?P<s>\s?)(?P<op>[xX×])(?P=s)"
            r"(?P<b>[0-9]+(?:\.[0-9]+)?)(?:(?P=s)[xX×](?P=s)(?P<c>[0-9]+(?:\.[0-9]+)?))?"
            r"(?![0-9]|[.,][0-9])"
        ),
        _dimensions,
    ),
    (  # "2x + 3", "3x^2" are algebra: x stays a letter
        re.compile(r"(?<![\w.])(?P<num>[0-9]+(?:\.[0-9]+)?)(?:[xX]|\s?×)(?!\w|\s*[-+=^*<>])"),
        _times_after,
    ),
    (
        re.compile(r"(?<![\w.])(?P<x>[x×])(?P<num>[0-9]+(?:\.[0-9]+)?)(?!\w|\.[0-9])"),
        _times_before,
    ),
    (
        re.compile(r"(?<![\w.])(?P<n>[0-9]{3,4})(?P<p>[pi])(?!\w)"),
        lambda m: f"{pairs(m['n'])} {m['p']}" if m["n"] in _RESOLUTIONS else m[0],
    ),
    # money, decades, percentages, ordinals, measurements
    (
        re.compile(
            r"(?<![\w])(?P<sign>[-\u2212])?(?P<cur>[$€£¥])\s?"
            + _NUM
            + r"(?:\s+(?P<scale>thousand|million|billion|trillion)\b"
            r"|(?P<suffix>mn|bn|[kKmMbB])(?![\w]))?"
            r"(?P<dup>\s+(?:dollars?|euros?|pounds?|yen)\b)?"
        ),
        _money,
    ),
    (re.compile(_START + _NUM + r"\s?¢"), _cents),
    (
        re.compile(r"(?<![\w])(?P<y>1[0-9]{2}0|20[0-9]0)s\b"),
        lambda m: decade(m["y"]),
    ),
    (re.compile(r"(?<![\w'’])['’](?P<d>[0-9]0)s\b"), lambda m: _short_decade(m["d"])),
    (re.compile(r"(?<![\w'’])(?P<d>[1-9]0)s\b"), _short_decade_after_cue),
    (re.compile(r"(?<![\w'’])['’](?P<y>[0-9]{2})(?![\w'’]|[.,][0-9])"), _two_digit_year_after_cue),
    (
        re.compile(
            r"(?<![\w.])(?P<y>[0-9]{1,4})(?P<space>\s?)(?P<era>BCE|BC|CE|AD|B\.C\.|A\.D\.)(?!\w)"
        ),
        lambda m: f"{year(m['y'])} {m['era']}",
    ),
    (
        re.compile(r"\b(?P<era>AD|A\.D\.)\s?(?P<y>[0-9]{1,4})" + _NO_DIGIT_AFTER),
        lambda m: f"{m['era']} {year(m['y'])}",
    ),
    (re.compile(_START + _NUM + r"\s?%(?:\s+percent\b)?"), _percent),
    (re.compile(r"(?<![\w])(?P<int>" + _INT + r")(?i:st|nd|rd|th)" + _END), _ordinal),
    (
        re.compile(
            _START + _NUM + rf"(?P<sep>\s?|-)(?P<unit>{_UNIT_RE})(?![\w/])(?=(?P<noun>\s+[a-z]))?"
        ),
        _measure,
    ),
    # years
    (
        re.compile(
            r"(?:(?<![\w])|(?<=[FC]Y))(?P<year>1[0-9]{3}|20[0-9]{2})(?![\w]|[.,][0-9])"
            r"(?:(?P<mid>\s+(?:to|and|or|through|until|till)\s+)"
            r"(?P<year2>1[0-9]{3}|20[0-9]{2})(?![\w]|[.,][0-9]))?"
        ),
        _year,
    ),
    # every other number (".5" too), then digits stuck to letters
    (
        re.compile(r"(?<![\w.,$€£¥])\.(?P<frac>[0-9]+)(?![\w]|\.[0-9])"),
        lambda m: "point " + digits(m["frac"]),
    ),
    (re.compile(_START + _NUM + _END), _number),
    (re.compile(r"[0-9]+"), _leftover_digits),
)
"""The passes that read numbers: each needs an ASCII digit or a vulgar fraction (``½``)."""

_HAS_NUMBER = re.compile(r"[0-9¼½¾⅐-⅞]")


def normalize(text: str) -> str:
    """Spell out the numbers, dates, times, money and abbreviations of English ``text``.

    Text outside the rewritten spans is kept character for character (case, punctuation,
    newlines); the result holds no ASCII digit.

    >>> normalize("Mr. Jones came on 15/03/2024 at 8:05 a.m. with €3.")
    'Mister Jones came on March fifteenth, twenty twenty four at eight oh five a.m. with three \
euros.'
    >>> normalize("The 21st, in 1999, ran 10kg vs. 1 km; -3.5 and 007.")
    'The twenty first, in nineteen ninety nine, ran ten kilograms versus one kilometer; minus \
three point five and zero zero seven.'
    >>> normalize("Call (555) 867-5309 on the 4th of May for a 3x faster start.")
    'Call five five five, eight six seven, five three zero nine on the fourth of May for a three \
times faster start.'
    """
    for pattern, replacement in _WORD_PASSES:
        text = pattern.sub(replacement, text)
    if _HAS_NUMBER.search(text):  # most text has none: skip the number passes
        for pattern, replacement in _NUMBER_PASSES:
            text = pattern.sub(replacement, text)
    return text
