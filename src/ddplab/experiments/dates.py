"""A parallel corpus the translation example generates itself: dates as people write them → ISO.

    "the twenty-third of march, nineteen ninety-four"  ->  "1994-03-23"
    "tue 23/03/1994"                                    ->  "1994-03-23"

Every pair is a function of (seed, index), so every rank and every run builds the same corpus,
offline, with no file to ship. The task is small enough to learn on a CPU in minutes and hard
enough that a model must learn something: numbers written out in words, day-month order that
changes with the format, ordinal suffixes, and a weekday that is right but must be ignored.
"""

from __future__ import annotations

import datetime
import random

MONTHS = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
]
WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_ORDINAL_ONES = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}
FIRST_DAY = datetime.date(1900, 1, 1)
LAST_DAY = datetime.date(2099, 12, 31)


def number_words(n: int) -> str:
    """0..99 in words: 'seven', 'forty-two'."""
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def ordinal_words(n: int) -> str:
    """1..31 as an ordinal in words: 'first', 'twenty-third', 'thirtieth'."""
    words = number_words(n)
    head, _, last = words.rpartition("-")
    if last in _ORDINAL_ONES:
        last = _ORDINAL_ONES[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return f"{head}-{last}" if head else last


def ordinal_suffix(n: int) -> str:
    """1 -> '1st', 22 -> '22nd', 13 -> '13th'."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def year_words(year: int, rng: random.Random) -> str:
    """1994 -> 'nineteen ninety-four'; 2004 -> 'two thousand four' or 'two thousand and four'."""
    century, rest = divmod(year, 100)
    if (century == 20 and rest < 10) or (century == 20 and rng.random() < 0.5):
        if rest == 0:
            return "two thousand"
        return "two thousand " + ("and " if rng.random() < 0.5 else "") + number_words(rest)
    if rest == 0:
        return f"{number_words(century)} hundred"
    return f"{number_words(century)} " + (f"oh {_ONES[rest]}" if rest < 10 else number_words(rest))


def write_date(d: datetime.date, rng: random.Random) -> str:
    """One of several ways people write a date, chosen by `rng`."""
    month = MONTHS[d.month - 1]
    mon = MONTHS[d.month - 1][:3]
    weekday = WEEKDAYS[d.weekday()]
    formats = [
        lambda: f"{month} {d.day}, {d.year}",
        lambda: f"{d.day} {month} {d.year}",
        lambda: f"{mon} {ordinal_suffix(d.day)} {d.year}",
        lambda: f"{d.day:02d}/{d.month:02d}/{d.year}",
        lambda: f"{weekday[:3]} {d.day}.{d.month}.{d.year}",
        lambda: f"the {ordinal_words(d.day)} of {month}, {year_words(d.year, rng)}",
        lambda: f"{weekday}, {month} the {ordinal_words(d.day)} {year_words(d.year, rng)}",
        lambda: f"{month} {ordinal_words(d.day)} {year_words(d.year, rng)}",
    ]
    return rng.choice(formats)()


def date_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` (written date, ISO date) pairs with distinct dates between 1900 and 2099."""
    span = (LAST_DAY - FIRST_DAY).days + 1
    if n > span:
        raise ValueError(f"at most {span} distinct dates, asked for {n}")
    rng = random.Random(seed)
    days = rng.sample(range(span), n)
    pairs = []
    for offset in days:
        d = FIRST_DAY + datetime.timedelta(days=offset)
        pairs.append((write_date(d, rng), d.isoformat()))
    return pairs
