"""Math answers: extraction from a response, normalisation, and the (unguarded) judgement.

`judge_math(response, ground_truth)` is what a worker of the math reward pool runs; it may take
long or hang on adversarial input (sympy), so training code calls `megatron_ba.rewards.math_score`
/ `MathRewardPool`, which run it in worker processes under a hard wall-clock limit.

Extraction (one candidate per response, in this order of precedence):
1. A final-answer line: a line that begins with "Answer:" (DAPO's template; case-insensitive,
   markdown such as `**Answer:**`, `### Final Answer:` allowed), or whose last sentence begins
   with "Answer:" after a finished one (". Answer: 9", the synthetic arithmetic task's form). The
   LAST such marker is the answer, whatever comes after it; its text after the colon (or, if
   empty, the next non-empty line); a \\boxed{} inside it yields the (last) box content.
2. Otherwise the last \\boxed{...} / \\fbox{...} (or `\\boxed 5`) of the response.
3. Otherwise no answer: score 0.
An "answer:" inside running prose ("We may check our answer: $17 \\cdot 44$", "so Answer: 34")
is not a final-answer marker. Hedging does not pay: only the last box and only the last Answer
line count, and several values in one answer ("3, 4", "3 or 4", "3 \\pm 1") are compared as a set.
Judgement: math-verify with the gold parsed first (its comparison is asymmetric: the gold decides
e.g. whether "1,2" is a set or a number), then an exact match after DAPO/Minerva-style string
normalisation as the fallback for what math-verify cannot parse. Equations: the right-hand side
alone matches only where the left-hand side is a bare name (`x = 5` ~ `5`, `k=3` ~ `3`); an
equation such as `5x - 7y + 11z + 4 = 0` must be answered as an equation (math-verify accepts
rearrangements it can prove equal; the fallback compares the normalised equation text).
"""

from __future__ import annotations

import re

# "Answer:" at the start of a line, after optional markdown ("**", "#", ">", "-") and "Final".
_ANSWER_LINE = re.compile(r"(?im)^[ \t>#*_-]*(?:final[ \t]+)?answer[ \t]*[*_]*[ \t]*:(.*)$")
# "Answer:" (capital A) opening a sentence at the end of a line: "... 6+3=9. Answer: 9". The
# sentence before it has ended; "so Answer: 34" and "check our answer: 5" have not.
_ANSWER_SENTENCE = re.compile(r"(?m)(?<=[.!?])[ \t]+(?:\*\*)?Answer[ \t]*(?:\*\*)?[ \t]*:(.*)$")
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[start] == "{" and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def last_boxed(text: str) -> tuple[str, int] | None:
    """(content, position) of the last \\boxed{...} / \\fbox{...} (or `\\boxed 5`), or None."""
    best = None
    for cmd in _BOX_COMMANDS:
        pos = text.rfind(cmd)
        while pos != -1:
            after = pos + len(cmd)
            rest = text[after:]
            if rest.startswith("{"):
                got = _braced(text, after)
                if got is not None:
                    if best is None or pos > best[1]:
                        best = (got[0], pos)
                    break
            elif rest.startswith(" "):
                words = rest.strip().split("$")[0].split()
                token = words[0] if words else ""
                if token:
                    if best is None or pos > best[1]:
                        best = (token, pos)
                    break
            pos = text.rfind(cmd, 0, pos)
    return best


def _strip_math_delimiters(text: str) -> str:
    s = text.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def _line_value(response: str, line: re.Match) -> str:
    """The text of a final-answer line (or of the next non-empty line when it is empty)."""
    value = line.group(1).strip().strip("*").strip()  # "**Answer:** 34**" -> "34"
    if not value:
        following = response[line.end() :].lstrip().split("\n", 1)
        value = following[0].strip() if following else ""
    box = last_boxed(value)
    if box is not None:
        return box[0]
    return value.rstrip(".").strip()


def extract_answer(response: str) -> str | None:
    """The final answer in `response`, or None (precedence in the module docstring)."""
    if not isinstance(response, str):
        raise ValueError(f"response must be a str, got {type(response).__name__}")
    lines = sorted(
        [*_ANSWER_LINE.finditer(response), *_ANSWER_SENTENCE.finditer(response)],
        key=lambda m: m.start(),
    )
    if lines:
        value = _strip_math_delimiters(_line_value(response, lines[-1]))
        if value:
            return value
    box = last_boxed(response)
    if box is not None:
        return _strip_math_delimiters(box[0]) or None
    return None


# ---- DAPO/Minerva-style normalisation (the fallback comparison) -------------------------------

_UNIT_WORDS = (
    "square units|square feet|square inches|square meters|square centimeters|sq units|units|"
    "unit|degrees|degree|cm|centimeters|meters|meter|mm|km|kilometers|inches|inch|feet|foot|ft|"
    "miles|mile|hours|hour|minutes|minute|seconds|second|sec|dollars|dollar|cents|cent|points|"
    "ways|days|day|years|year|students|people|pounds|lbs|grams|kg|mph"
)
_UNITS = re.compile(rf"\s*\b({_UNIT_WORDS})\b(\^\{{?\d\}}?)?\s*$")
_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\displaystyle")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
# A bare name: one letter or a LaTeX name (\\theta), optionally subscripted (x_1, a_{n}).
_BARE_NAME = re.compile(r"(?:[A-Za-z]|\\[A-Za-z]+)(?:_(?:[A-Za-z0-9]|\{[A-Za-z0-9,]+\}))?")
_RELATIONS = ("\\le", "\\ge", "\\ne", "\\approx", "<", ">")


def drop_bare_name_lhs(s: str) -> str:
    """`x = 5` -> `5` (and `x = y = 5` -> `5`); an equation whose left side is not a bare name
    (`5x - 7y + 4 = 0`) stays whole, so its right-hand side alone cannot match it."""
    if any(op in s for op in _RELATIONS):
        return s
    while "=" in s:
        lhs, _, rhs = s.partition("=")
        if not rhs.strip() or not _BARE_NAME.fullmatch(lhs.replace(" ", "")):
            break
        s = rhs.strip()
    return s


def _unwrap(cmd: str, s: str) -> str:
    """Replace \\cmd{x} by x (outermost first, repeatedly)."""
    while True:
        pos = s.find(cmd + "{")
        if pos == -1:
            return s
        got = _braced(s, pos + len(cmd))
        if got is None:
            return s
        s = s[:pos] + got[0] + s[got[1] :]


def normalize_answer(answer: str) -> str:
    """Canonical string form of a final answer (for exact-match comparison)."""
    s = _strip_math_delimiters(answer.strip())
    s = s.replace("\n", " ").strip().rstrip(".").strip()
    s = drop_bare_name_lhs(s)  # "x = 3" -> "3", never "5x + 4 = 0" -> "0"
    for cmd in ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\mbox"):
        s = _unwrap(cmd, s)
    s = _UNITS.sub("", s.strip())
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".") or "0"
    if re.fullmatch(r"\(-?\d+\)", s):  # AIME solutions' \textbf{(073)} -> 073
        s = s[1:-1]
    if re.fullmatch(r"-?\d+", s):
        s = str(int(s))  # 073 -> 73: AIME answers are 0-999, often zero-padded
    return s


# ---- judgement ----------------------------------------------------------------------------------


def _parse(text: str, timeout: int | None):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse("\\boxed{" + text + "}", extraction_config=configs, parsing_timeout=timeout)


def answers_match(predicted: str, ground_truth: str, *, soft_timeout_s: int | None = 3) -> bool:
    """Whether an extracted answer equals the ground truth (math-verify, then normalised text).

    `soft_timeout_s` is math-verify's own SIGALRM limit: only valid on a main thread; pass None
    elsewhere (the pool's hard limit still applies).
    """
    gold_text = _strip_math_delimiters(ground_truth)
    pred_text = _strip_math_delimiters(predicted)
    try:
        from math_verify import verify

        gold = _parse(gold_text, soft_timeout_s)  # gold first: the comparison is asymmetric
        if gold:
            pred = _parse(pred_text, soft_timeout_s)
            if pred and verify(gold, pred, timeout_seconds=soft_timeout_s):
                return True
    except Exception:  # a checker crash is a miss, never a training crash
        pass
    norm_gold = normalize_answer(gold_text)
    return bool(norm_gold) and normalize_answer(pred_text) == norm_gold


def judge_math(response: str, ground_truth: str, *, soft_timeout_s: int | None = 3) -> float:
    """1.0 if the final answer of `response` equals `ground_truth`, else 0.0 (unguarded)."""
    if not isinstance(ground_truth, str):
        raise ValueError(f"ground_truth must be a str, got {type(ground_truth).__name__}")
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, ground_truth, soft_timeout_s=soft_timeout_s) else 0.0
