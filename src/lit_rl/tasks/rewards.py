"""Verifiable rewards for math answers: pull the final answer out of a completion and compare it.

Extraction (``extract_answer``), in this order:

1. ``#### N`` (GSM8K style): the number right after the LAST ``####``; any text after that
   number is ignored.
2. ``\\boxed{...}``: the content of the last ``\\boxed{}`` (nested braces are fine).
3. Only in ``"flexible"`` mode: the last number anywhere in the text.

A LaTeX fraction counts as one number wherever a number is read (after ``####`` and as the last number):
``\\frac{3}{4}``, ``\\dfrac``, ``\\tfrac``, the brace-less ``\\frac34``, with a sign before it and inside
``$...$``; without this, ``\\frac{3}{4}`` would be read as its last digit, 4.

``"strict"`` mode accepts only ``#### N``: a boxed answer or a bare number scores 0.

Numbers are read as people and models write them: ".5", typographic minus signs ("−3"), digit-group
separators before exactly three digits ("1,234", "1{,}234", "1\\,234", thin spaces; "3,5" is no number:
no European decimal commas), percentages ("50%" == "50") and units after the number ("18 cm",
"18\\text{ dollars}").

Comparison (``answers_match``): a numeric fast path first (group separators, ``$``, ``%``, units, a
leading ``+`` and a trailing period are dropped; decimals and fractions are compared exactly as
rationals, so "2.50" == "2.5", "3/4" == "0.75" and "\\frac{24}{2}" == "12"), then ``math_verify`` as a fallback for
LaTeX forms such as ``\\frac{3}{4}``. Model text is never evaluated as code: the only parser
that sees it is math_verify's, and only the short extracted answer is passed to it.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

__all__ = ["ANSWER_MODES", "extract_answer", "answers_match", "math_reward"]

ANSWER_MODES = ("flexible", "strict")

# Longest extracted answer we hand to math_verify / Fraction; anything longer is not an answer.
_MAX_ANSWER_CHARS = 200
# math_verify's own timeout (seconds); it works by SIGALRM, so only in the main thread.
_MATH_VERIFY_TIMEOUT_S = 5

# Signs as typeset: ASCII, the minus sign U+2212, en/figure dashes and the small and full-width forms.
_MINUS_SIGNS = "\u2212\u2013\u2012\ufe63\uff0d"
_PLUS_SIGNS = "\ufe62\uff0b"
_SIGN = "[-+" + _MINUS_SIGNS + _PLUS_SIGNS + "]"
# A digit-group separator: a comma (LaTeX "{,}" too), LaTeX's thin space "\," or a (narrow) thin space,
# followed by exactly three digits. A comma before one, two or four digits separates nothing: "3,5" is not
# 35 (and not the European 3.5; such an answer is not a plain number).
_GROUP_SEP = r"(?:,|\{,\}|\\,|\u2009|\u202f)"
_INTEGER = r"(?:\d{1,3}(?:" + _GROUP_SEP + r"\d{3})+(?!\d)|\d+)"
# A number as models and GSM8K write it: optional sign, digits with optional group separators, optional
# decimal part, or a decimal part alone (".5"), optional "/denominator". A minus sign directly after a word
# character or ")" is read as subtraction ("5-3"), not as part of the number.
_NUMBER = (
    r"(?:(?<![\w)\]}])" + _SIGN + r")?"
    r"(?:" + _INTEGER + r"(?:\.\d+)?|(?<![\w.])\.\d+)"
    r"(?:/\d+(?:\.\d+)?)?"
)
# A LaTeX fraction \frac, \dfrac or \tfrac with an optional sign; each part is a braced group (one level of
# nested braces, "\frac{\sqrt{3}}{2}") or a single digit ("\frac34" is 3/4, as TeX reads it).
_FRAC_PART = r"(?:\{(?:[^{}]|\{[^{}]*\})*\}|\d)"
_LATEX_FRAC = r"(?:(?<![\w)\]}])" + _SIGN + r"\s*)?\\[dt]?frac\s*" + _FRAC_PART + r"\s*" + _FRAC_PART
# One number as read from the text: a LaTeX fraction first, so its digits are not read on their own.
_NUMBER_RE = re.compile(_LATEX_FRAC + "|" + _NUMBER)
# What may sit between "####" and the number: spaces, markdown bold, a dollar sign.
_AFTER_HASHES_RE = re.compile(r"[\s*$]*(?:\\\$)?\s*(" + _LATEX_FRAC + "|" + _NUMBER + r")")
# A LaTeX fraction whose parts are plain numbers, for the exact numeric path.
_NUMERIC_FRAC_RE = re.compile(
    r"(?P<sign>-)?\\[dt]?frac\s*(?:\{(?P<num>[^{}]*)\}|(?P<num1>\d))\s*(?:\{(?P<den>[^{}]*)\}|(?P<den1>\d))"
)
# Shapes the numeric fast path accepts once the answer is cleaned up (group separators become ",").
_PLAIN_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:/\d+(?:\.\d+)?)?")
# Units after a number: "\text{ cm}", "\mathrm{kg}", "\,\text{dollars}", degrees, or plain words ("18 apples").
_UNIT_RE = re.compile(
    r"(?P<space>(?:\s|\\[,;: !])*)(?:\\(?:text|textrm|mathrm|mbox|operatorname)\{[^{}]*\}|\^\s*\{?\\circ\}?|°"
    r"|(?P<word>[A-Za-z][A-Za-z .]*))\s*$"
)
# Words after a number that are mathematics, not a unit ("2pi", "3 sqrt"): never stripped.
_MATH_WORDS = {"pi", "sqrt", "e", "i", "ln", "log", "exp", "sin", "cos", "tan", "inf", "infinity"}


def _strip_units(s: str) -> str:
    """``s`` without units after its number ("18 cm" -> "18", "5\\,\\text{kg}" -> "5", "90^\\circ" -> "90");
    a single letter right after a digit ("3x") and mathematical words stay."""
    for _ in range(3):
        m = _UNIT_RE.search(s)
        if m is None or m.start() == 0 or not s[: m.start()].strip():
            break
        word = (m.group("word") or "").strip(" .")
        if word and (word.lower() in _MATH_WORDS or (len(word) == 1 and not m.group("space"))):
            break
        s = s[: m.start()].rstrip(" .")
    return s


def _extract_hashes(text: str) -> str | None:
    """Return the number right after the last ``####`` in ``text``, or None."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    m = _AFTER_HASHES_RE.match(text, pos + 4)
    return m.group(1) if m else None


def _extract_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` in ``text`` (braces matched), or None."""
    pos = text.rfind("\\boxed{")
    if pos < 0:
        return None
    start = pos + len("\\boxed{")
    depth = 1
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                content = text[start:i].strip()
                return content or None
    return None  # unbalanced braces: no usable answer


def _extract_last_number(text: str) -> str | None:
    """Return the last number in ``text``, or None if it contains no digits."""
    last = None
    for m in _NUMBER_RE.finditer(text):
        last = m.group(0)
    return last


def extract_answer(text: str, mode: str = "flexible") -> str | None:
    """Extract the final answer from a model completion.

    Args:
        text: the completion text.
        mode: ``"flexible"`` (``#### N``, then the last ``\\boxed{}``, then the last number in
            the text) or ``"strict"`` (``#### N`` only).

    Returns:
        The answer as it appears in the text (e.g. ``"1,234"``, ``"\\frac{3}{4}"``), or None
        when nothing answer-like is found or ``text`` is not a string.

    Raises:
        ValueError: ``mode`` is not one of ``ANSWER_MODES``.
    """
    if mode not in ANSWER_MODES:
        raise ValueError(f"answer mode must be one of {ANSWER_MODES}, got {mode!r}")
    if not isinstance(text, str):
        return None
    answer = _extract_hashes(text)
    if answer is not None or mode == "strict":
        return answer
    answer = _extract_boxed(text)
    if answer is not None:
        return answer
    return _extract_last_number(text)


def _to_fraction(answer: str) -> Fraction | None:
    """Parse a plain numeric answer exactly, else None: "1,234", "1{,}234", "1\\,234", "$2.50", "−3" (U+2212),
    ".5", "3/4", "50%", "18 \\text{cm}", "12 apples", "\\frac{24}{2}", "-\\dfrac{3}{4}", "\\frac34".
    Group separators count only before exactly three digits, so "3,5" is None (no European decimal commas)."""
    s = answer.strip()
    if len(s) > _MAX_ANSWER_CHARS:
        return None
    s = _strip_units(s)
    for minus in _MINUS_SIGNS:
        s = s.replace(minus, "-")
    for plus in _PLUS_SIGNS:
        s = s.replace(plus, "+")
    for sep in ("{,}", "\\,", "\u2009", "\u202f"):
        s = s.replace(sep, ",")
    for junk in ("\\$", "\\%", "\\!", "$", "%", " "):
        s = s.replace(junk, "")
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    frac = _NUMERIC_FRAC_RE.fullmatch(s)
    if frac is not None:
        num = _to_fraction(frac.group("num") or frac.group("num1"))
        den = _to_fraction(frac.group("den") or frac.group("den1"))
        if num is None or den is None or den == 0:
            return None
        return -num / den if frac.group("sign") else num / den
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    numerator, _, denominator = s.replace(",", "").partition("/")
    value = Fraction(numerator)
    if denominator:
        den = Fraction(denominator)
        if den == 0:
            return None
        value /= den
    return value


def _math_verify_match(pred: str, gold: str) -> bool:
    """Compare two answers with math_verify (LaTeX aware); False when either cannot be parsed."""
    if len(pred) > _MAX_ANSWER_CHARS or len(gold) > _MAX_ANSWER_CHARS:
        return False
    in_main_thread = threading.current_thread() is threading.main_thread()
    if not in_main_thread and "^" in pred:
        # Without the SIGALRM timeout a power tower like 9^{9^{9^9}} could stall sympy.
        return False
    timeout = _MATH_VERIFY_TIMEOUT_S if in_main_thread else None

    from math_verify import parse, verify  # imported lazily: it pulls in sympy

    def _parse(s: str) -> list:
        # Wrapping in $...$ lets math_verify read bare LaTeX such as \dfrac{3}{4}.
        parsed = parse(f"${s}$", parsing_timeout=timeout)
        return parsed if parsed else parse(s, parsing_timeout=timeout)

    gold_parsed = _parse(gold)
    pred_parsed = _parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def answers_match(pred: str, gold: str) -> bool:
    """Whether an extracted answer equals the gold answer.

    Numeric comparison first (exact, as rationals, after dropping commas, ``$``, ``%``, a
    leading ``+`` and a trailing period); if either side is not a plain number, math_verify
    decides (e.g. ``\\frac{3}{4}`` vs ``0.75``).

    Returns:
        True on a match; False otherwise, including when either argument is not a string or
        comparison fails for any reason (never raises).
    """
    try:
        if not isinstance(pred, str) or not isinstance(gold, str):
            return False
        p, g = _to_fraction(pred), _to_fraction(gold)
        if p is not None and g is not None:
            return p == g
        return _math_verify_match(pred.strip(), gold.strip())
    except Exception:  # noqa: BLE001 - a reward must never crash training
        return False


def math_reward(completion: str, gold: str, mode: str = "flexible") -> float:
    """Binary reward for a math completion.

    Args:
        completion: the model's text.
        gold: the gold final answer, e.g. ``"42"`` or ``"3/4"``.
        mode: ``"flexible"`` or ``"strict"``, see ``extract_answer``.

    Returns:
        1.0 if the extracted answer matches ``gold``, else 0.0. Any exception during
        extraction or comparison gives 0.0; nothing propagates.

    Raises:
        ValueError: ``mode`` is not one of ``ANSWER_MODES`` (checked before anything else,
            since that is a configuration error, not a property of the completion).
    """
    if mode not in ANSWER_MODES:
        raise ValueError(f"answer mode must be one of {ANSWER_MODES}, got {mode!r}")
    try:
        pred = extract_answer(completion, mode)
        if pred is None:
            return 0.0
        return 1.0 if answers_match(pred, gold) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never crash training
        return 0.0
