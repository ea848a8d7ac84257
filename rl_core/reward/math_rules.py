"""The answer rules of verl 0.9's math scorers, restated so that ppoflow's rewards equal verl's:

* MATH (Hendrycks et al.): the last ``\\boxed{...}`` (or ``\\boxed x``, or ``\\fbox{...}``) is normalised with the
  MATH paper's string rules (:func:`normalize_math_answer`) and compared with the normalised ground truth;
* DAPO / Minerva: the last ``Answer: ...`` line (Minerva's format), else the last ``\\boxed{...}`` in the final 100
  characters compared verbatim; the answer is normalised by Minerva's rules (:func:`normalize_minerva_answer`),
  and a wrong answer scores -1.

Edge cases follow verl on purpose (e.g. a normalisation that fails falls back to comparing the raw strings),
since a user comparing reward curves with a verl run must see the same numbers.
"""

from __future__ import annotations

import re


# ---------------------------------------------------------------------------------------------- boxed answers
def last_boxed(text: str, allow_space_form: bool = True, allow_fbox: bool = True) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` with its braces balanced (the command included), or None.

    ``allow_space_form``: ``\\boxed 5`` counts (up to the next ``$``); ``allow_fbox``: ``\\fbox{...}`` when there is no
    ``\\boxed``."""
    if allow_space_form and "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed" if allow_space_form else "\\boxed{")
    if start < 0 and allow_fbox:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start : position + 1]
    return None


def boxed_content(boxed: str) -> str:
    """``\\boxed{x}`` or ``\\boxed x`` -> ``x``; ValueError for anything else (``\\fbox{..}`` included, as in verl)."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{") : -1]
    raise ValueError(f"not a boxed answer: {boxed[:40]!r}")


# ---------------------------------------------------------------------------------------------- MATH rules
def _braced_fractions(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{7}`` -> ``\\frac{1}{7}``; an unbraced fraction shorter than two
    characters leaves the whole string as it was; a trailing ``\\frac`` raises IndexError (as MATH's rules do)."""
    head, *tails = text.split("\\frac")
    out = head
    for tail in tails:
        out += "\\frac"
        if tail[0] == "{":
            out += tail
            continue
        if len(tail) < 2:
            return text
        numerator, second, rest = tail[0], tail[1], tail[2:]
        out += "{" + numerator + "}" + (second + rest if second == "{" else "{" + second + "}" + rest)
    return out


def _slash_fraction(text: str) -> str:
    """``3/4`` (two plain integers) -> ``\\frac{3}{4}``."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{numerator}}}{{{denominator}}}" if text == f"{numerator}/{denominator}" else text


def _braced_roots(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    head, *tails = text.split("\\sqrt")
    return head + "".join(
        "\\sqrt" + (tail if tail.startswith("{") else "{" + tail[0] + "}" + tail[1:]) for tail in tails
    )


def normalize_math_answer(text: str) -> str:
    """The MATH paper's normalisation (in this order): drop line breaks, ``\\!``, ``\\left``/``\\right``, degrees,
    ``\\$``, a trailing unit in ``\\text{ ...}``, percent signs; ``\\\\`` -> ``\\``, t/dfrac -> frac; a leading
    ``.`` gets a 0; a short ``k = `` prefix goes; roots and fractions get braces; spaces go; ``0.5`` -> 1/2; ``a/b``
    -> frac. Raises ValueError where MATH's rules fail (two ``\\text{ `` units)."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        text = text.replace(old, new)
    if "\\text{ " in text:
        pieces = text.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("more than one unit")
        text = pieces[0]
    text = text.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _braced_roots(text).replace(" ", "")
    text = _braced_fractions(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_fraction(text)


def math_answers_equal(answer: str, ground_truth: str) -> bool:
    """Equal after :func:`normalize_math_answer`; the raw strings are compared when normalising fails."""
    try:
        return normalize_math_answer(answer) == normalize_math_answer(ground_truth)
    except Exception:
        return answer == ground_truth


def hendrycks_math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals the ground truth by the MATH rules, else 0.0."""
    boxed = last_boxed(solution_str)
    if boxed is None:
        return 0.0
    try:
        return 1.0 if math_answers_equal(boxed_content(boxed), ground_truth) else 0.0
    except Exception:
        return 0.0


# ---------------------------------------------------------------------------------------------- Minerva / DAPO rules
MINERVA_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
MINERVA_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
MINERVA_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_minerva_answer(answer: str) -> str:
    """Minerva's normalisation: the text after the last ``=``, fixed substitutions and removals (units, articles,
    spaces), the content of ``$..$``, ``\\text{}``, ``\\textbf{}``, ``\\overline{}`` and ``\\boxed{}``, braces for
    ``\\fracab`` and ``\\sqrta``, no ``$``, and thousands separators dropped from a plain number."""
    answer = answer.split("=")[-1]
    for old, new in MINERVA_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for removed in MINERVA_REMOVED:
        answer = answer.replace(removed, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_math_score(solution_str: str, ground_truth: str) -> dict:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``: Minerva's ``Answer:`` first (last 300 characters), else
    the last ``\\boxed{}`` of the last 100 characters compared verbatim with the ground truth."""
    solution_str = solution_str[-300:]
    matches = MINERVA_ANSWER.findall(solution_str)
    prediction = normalize_minerva_answer(matches[-1] if matches else "[INVALID]")
    correct = prediction == normalize_minerva_answer(ground_truth)
    if prediction == "[INVALID]":
        boxed = last_boxed(solution_str[-100:], allow_space_form=False, allow_fbox=False)
        if boxed is not None:
            prediction = boxed_content(boxed)
            correct = prediction == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction}
