"""reward.py: the answer checker behind the reward (+1 / -1) and every benchmark number.

    extract_boxed(text)                -> str | None   the final boxed answer (boxes joined by "and" or commas)
    extract_answer(text)               -> str | None   boxed, else an unboxed final answer (eval.py --unboxed)
    is_equivalent(pred, gold, timeout) -> bool         math equivalence of two final answers
    score(completion, gold)            -> float        +1.0 if the final box is equivalent to gold, else -1.0
    dapo_score(completion, gold)       -> float        the paper's reward, DAPO's: the box string-equal to gold
    judge_prompt / judge_verdict                       the judge's prompt and its A/B/C verdict (eval.py --judge)

Model output is hostile. It never reaches eval, exec, sympify or parse_expr: a small parser of our own
turns whitelisted tokens into sympy objects directly, and refuses power towers, huge factorials, deep
nesting and overlong answers up front. The common cases (equal strings, plain numbers) never touch sympy;
the rest runs in a worker process per thread, killed and restarted on timeout, so no check can hang.

Rules, in order (docs/checker.md lists them with examples): normalisation; strings equal after it (words
case-insensitively); a worked line's last side (`x = 2+3 = 5`); a named answer against its value (`x = 5`);
one inequality against another, up to a positive factor; structures (matrices; tuples and intervals in
order; sets and lists unordered; an inequality of one variable as its interval); equations, up to a non-zero
factor; numbers (exact, or within REL_TOL = 1e-4 when written as decimals); else sympy.simplify.
"""
import atexit, functools, json, math, os, re, select, subprocess, sys, threading, time, weakref
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

REL_TOL = 1e-4       # for answers written as decimals: 3.14159 ~ 3.1416, but 3.1416 !~ 3.1426
MAX_LEN, MAX_DEPTH = 1000, 50


# ---- Boxes -----------------------------------------------------------------------------------------------

_WORD = re.compile(r"\s+([^\s$]+)")  # the answer of a box without braces, `\boxed 5`


def _boxes(text):
    """[(start, end, content)] of every outermost \\boxed{...} / \\fbox{...} / `\\boxed x`, in order; one pass."""
    opened, closing = [], {}
    for j, c in enumerate(re.sub(r"\\.", "  ", text)):  # an escaped \{ or \} cannot open or close a box
        if c == "{":
            opened.append(j)
        elif c == "}" and opened:
            closing[opened.pop()] = j
    out = []
    for m in re.finditer(r"\\boxed|\\fbox", text):
        i = m.end()
        word = None if text.startswith("{", i) else _WORD.match(text, i)
        end = word.end() if word else closing.get(i, -1) + 1
        if end and not (out and m.start() < out[-1][1]):  # a box inside the previous box is part of it
            out.append((m.start(), end, word.group(1) if word else text[i + 1:end - 1].strip()))
    return out


_GAP = r"(?:\s|\$|\\[()\[\]])*"  # spacing and math delimiters: `$\boxed{1}$ and \(\boxed{2}\)`
_BETWEEN_BOXES = re.compile(_GAP + r"(?:(?:[,;]|(?:\\text\{\s*)?(?:and|or)(?:\s*\})?|\\q?quad\b)" + _GAP + ")+")


def extract_boxed(text):
    """The final boxed answer: the content of the last box, joined with the boxes just before it when
    commas, `and`, `or` or \\quad separate them (`\\boxed{1} \\quad \\text{and} \\quad \\boxed{-2}` ->
    `1, -2`; but `\\boxed{3}\\boxed{7}` -> `7`, the last box, as in DAPO's reward); None if there is none."""
    boxes = _boxes(text) if isinstance(text, str) else []
    if not boxes or max(text.rfind("\\boxed"), text.rfind("\\fbox")) >= boxes[-1][1]:
        return None  # no box, or the last one never closes (`\\boxed{5}\\boxed{`): no final answer
    last = [boxes.pop()]
    while boxes and _BETWEEN_BOXES.fullmatch(text[boxes[-1][1]:last[0][0]]):
        last.insert(0, boxes.pop())
    return ", ".join(b[2] for b in last)


_JOIN = re.compile(r"[\s,;]{0,80}(?:[^.!?\n]{0,40}?\b(?:and|or)\s{0,40}(?:[A-Za-z](?:_\s?\w+)?\s{0,9}=)?\s{0,40})?")
_MARKUP = re.compile(r"\$|\\[()\[\]]|\\q?quad\b|\\text\s*\{|[{}]")


def _boxed_tail(text):
    """For is_equivalent: the text spanning the last box and the boxes joined to it by a separator, by nothing or
    by a short phrase ending in `and`/`or` (`\\boxed{(3, 3)} for part (a) and \\boxed{(1, 1)}`); else extract_boxed."""
    box = extract_boxed(text)
    boxes = _boxes(text) if box is not None else []
    first = len(boxes) - 1
    while first > 0 and _JOIN.fullmatch(_MARKUP.sub(" ", text[boxes[first - 1][1]:boxes[first][0]])):
        first -= 1
    return text[boxes[first][0]:boxes[-1][1]] if first < len(boxes) - 1 else box


# Math spans: $$..$$ and \[..\] may span lines; $..$ and \(..\) may not (a stray $ is a dollar sign)
_SPAN = re.compile(r"\$\$(.+?)\$\$|(?<!\\)\$((?:\\\$|[^$\n])+?)\$|\\\(([^\n]+?)\\\)|\\\[(.+?)\\\]", re.S)
_CHAT_TOKEN = re.compile(r"<\|[a-z_]+\|>|</s>|<｜end▁of▁sentence｜>")  # a turn ends: no answer after it
_MINERVA = re.compile(r"final answer is\s*(.+?)\s*I hope it is correct", re.I | re.S)
_FINAL = re.compile(r"answer\s*(?:\*\*)?\s*(?:is|:|=)\s*:?\s*(?:\*\*)?", re.I)
_CONCLUDES = re.compile(r"\b(?:therefore|thus|hence|so|finally)\b", re.I)
_NUMBER = re.compile(r"-?\d*\\(?:[dt]?frac(?:\{[^{}]*\}|\d){2}|sqrt(?:\{[^{}]*\}|\d))"  # \frac{10}{9}, 2\sqrt{3} whole
                     r"|(?<![A-Za-z\d.,])-?\d+(?:,\d{3})*(?:[.,]\d+)?(?:/\d+)?")


def _sentences(text):
    """The non-empty sentences of text, each math span kept whole (its dots and line breaks split nothing)."""
    masked = _SPAN.sub(lambda m: "\0" * len(m.group()), text)
    cuts = [0] + [m.end() for m in re.finditer(r"[.!?](?=\s|$)|\n", masked)] + [len(text)]
    return [text[i:j] for i, j in zip(cuts, cuts[1:]) if re.search(r"[^\s.!?*]", text[i:j])]


def _last_math(s):
    """The content of the last math span of s, else (when s has none) its last number or bare \\frac, else None."""
    spans = list(_SPAN.finditer(s))
    numbers = _NUMBER.findall(s)
    return spans[-1].group(spans[-1].lastindex).strip() if spans else numbers[-1] if numbers else None


def _phrase(x):
    """The answer in a final phrase: `$9$.` -> 9; `The largest $n$ is 34` -> 34; `Sphere 3 hours ago` -> 3."""
    x = re.sub(r"^(?:\\?[\"'*\s])+|(?:\\?[\"'*\s.,;:!])+$", "", x)  # quotes, bold, the full stop
    masked = _SPAN.sub(lambda m: "\0" * len(m.group()), x) if re.match(r"(?:the|our)\b", x, re.I) else ""
    verb = list(re.finditer(r"\b(?:is|are|equals)\s", masked))
    x = x[verb[-1].end():].strip() if verb else x  # `The volume of $V$ is 120`: what follows the verb
    words = re.sub(r"\b(?:and|or)\b|\\[a-zA-Z]+", "", _SPAN.sub(" ", x))
    if not re.search(r"[A-Za-z]{2,}", words):  # math only: `$12$ and $13$` -> `12 and 13`, `x=3`
        return _SPAN.sub(lambda m: m.group(m.lastindex).strip(), x).strip() or None
    return _last_math(x) or x  # words around math: the last math, else the last number, else the words


def extract_answer(text):
    """The final answer of a free-form response, for evaluation tools; None if none. In order: Minerva's
    `Final Answer: The final answer is X. I hope it is correct.` after the last box; the last box(es);
    the last `answer is X` / `Answer: X` (`Final Answer: The largest $n$ is 34.` -> 34); the last
    `Therefore ...` sentence's last math, else its last number; the math a response ends on (`The matrix
    is $...$.`); the last number of a final sentence without math. Nothing after a chat-template token
    (`<|im_start|>`) counts. score() never uses it: the training reward requires the box."""
    if not isinstance(text, str):
        return None
    text = _CHAT_TOKEN.split(text, 1)[0]
    tail = text[-8000:]  # where a long response states its answer
    minerva = list(_MINERVA.finditer(tail))
    if minerva and minerva[-1].start() > max(tail.rfind("\\boxed"), tail.rfind("\\fbox")):
        return _phrase(minerva[-1].group(1))  # the final answer stated after the last box
    box = extract_boxed(text)
    if box is not None:
        return box
    sentences = _sentences(tail[-4000:]) or [""]
    said = [s[_FINAL.search(s).end():] for s in sentences if _FINAL.search(s)]
    if said and _phrase(said[-1]):
        return _phrase(said[-1])
    concluded = [s[_CONCLUDES.search(s).end():] for s in sentences if _CONCLUDES.search(s)]
    if concluded and _last_math(concluded[-1]) is not None:
        return _last_math(concluded[-1])
    spans = list(_SPAN.finditer(sentences[-1]))
    if not spans or not sentences[-1][spans[-1].end():].strip(" .,;:!*"):
        return _last_math(sentences[-1])  # the math a response ends on, or the last number of its end
    return None


def score(completion, gold):
    """The training reward: +1.0 if the completion's last boxed answer (against a gold of several parts, with
    the boxes joined to it) is equivalent to gold, else -1.0; it credits 1/2 for 0.5, dapo_score does not."""
    tail = _boxed_tail(completion)
    return 1.0 if tail is not None and is_equivalent(tail, gold) else -1.0


def dapo_score(completion, gold):
    """The paper's reward, DAPO's as JustRL runs it (verl/utils/reward_score/math_dapo.py, strict_box_verify=True):
    +1.0 if the last `\\boxed{` of the last 100 characters closes there and holds exactly the string gold, else
    -1.0. Nothing is normalised; every brace counts, escaped or not; `\\boxed 5` and \\fbox are no box."""
    window = completion[-300:][-100:]  # verl keeps 300 characters, then strict mode the last 100 of those
    _, opened, body = window.rpartition("\\boxed{")
    depth = 1
    for end, c in enumerate(body):
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return 1.0 if opened and body[:end] == gold else -1.0
    return -1.0


def score_all(completions, golds, reward="equiv"):
    """score() ("equiv", on a lasting pool of threads with a sympy worker each) or dapo_score() ("dapo")."""
    if reward == "dapo":
        return [dapo_score(text, gold) for text, gold in zip(completions, golds)]
    if reward != "equiv":
        raise ValueError("reward is 'equiv' or 'dapo', not %r" % (reward,))
    return [1.0 if ok else -1.0 for ok in check_all(map(_boxed_tail, completions), golds)]


def check_all(answers, golds):
    """is_equivalent over many extracted answers (None is wrong), on the same pool of threads."""
    def check(answer, gold):
        return answer is not None and is_equivalent(answer, gold)
    return list(_pool().map(check, answers, golds))


# ---- The judge: a model's second opinion on what the rules reject (eval.py --judge) ----------------------

JUDGE_PROMPT = """You grade answers to math problems. A reference answer is given and is correct.
Decide whether the final answer of the response below is the same as the reference answer. Ignore the
reasoning and the formatting (a \\boxed{{}} around the answer, spacing, an equivalent form); all parts of a
multi-part answer must match. A response that is cut off, loops, or gives no final answer is invalid.
Reply with one letter only: A if correct, B if incorrect, C if invalid.

Problem:
{question}

Reference answer:
{gold_answer}

Response:
{llm_response}

Letter:"""


def judge_prompt(problem, gold, response, template=None):
    """The judge's prompt. `template` (e.g. CompassVerifier's own, from a file) has the same three fields."""
    return (template or JUDGE_PROMPT).format(question=problem, gold_answer=gold, llm_response=response)


def judge_verdict(reply):
    """A (correct), B (incorrect), C (invalid) or None: the reply itself, or its last \\boxed{letter}."""
    reply = reply.strip()
    if reply in ("A", "B", "C"):
        return reply
    box = extract_boxed(reply)
    return box if box in ("A", "B", "C") else None


# ---- Normalisation: pure string work ---------------------------------------------------------------------

_TEXT = r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname|rm)\s*"
_SUBS = [(r"\\left\b|\\right\b|\\displaystyle|\\bigl|\\bigr|\\big\b", ""), (r"\\[dtc]frac", r"\\frac"),
         (r",\\!\s*", ","), (r"(?<!\\)\\!", ""), (r"(?<!\\)\\(?:,|;|:| |quad|qquad)|~", " "),
         (r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°", ""), (r"\\?%|\\\$|\$", ""),
         (r"(\d)\s*\{,\s*\}\s*(?=\d)", r"\1,"), (r"\\end\{array\}", r"\\end{matrix}"),
         (r"\\geqslant|\\geq?\b|≥", ">="), (r"\\leqslant|\\leq?\b|≤", "<="), (r"\\ne(?:q)?\b|≠", "!="),
         (r"\\lt\b", "<"), (r"\\gt\b", ">"), (r"\\begin\{array\}\{[^{}]*\}", r"\\begin{matrix}"),
         (r"\\dots|\\ldots|\\cdots", "..."), (r"\\in\b", "="), (r"±", r"\\pm")]
_SUBS = [(re.compile(p), r) for p, r in _SUBS]

# Units come off an answer that holds a digit: any \text-like group, or a known unit word after a space.
_UNIT_WORDS = ("m cm mm km nm um pm s ms us ns min mins h hr hrs g kg mg K J kJ eV keV MeV GeV W kW MW N Pa kPa "
               "Hz kHz MHz GHz V mV A mA C mol L mL erg ergs dyn yr yrs year years day days hour hours minute "
               "minutes second seconds sec degree degrees dollar dollars cent cents unit units meter meters metre "
               "metres inch inches foot feet ft mile miles mph pc kpc Mpc AU au ly T G atm bar cal kcal rad Ohm "
               "ohm ohms arcsec arcmin mag Jy sq square cubic liters litres percent percentage pct").split()
_POWER = r"(?:\s*\^\s*\{?\s*-?\d+\s*\}?)?"
_WRAPPED_UNIT = re.compile(r"(?:/|\\cdot)?\s*" + _TEXT + r"\{(?:[^{}]|\{[^{}]*\})*\}" + _POWER + "$")
_BARE_UNIT = re.compile(r"(?:\s|/|\\cdot)\s*(?:\\mu\s*[a-zA-Z]+|μ[a-zA-Z]+|\\AA|Å|[MRL]_\{?\\odot\}?|\\Omega|(?:%s)\b)"
                        % "|".join(sorted(_UNIT_WORDS, key=len, reverse=True)) + _POWER + "$")


def _strip_units(s):
    """`4.5 \\times 10^{33} \\text{ erg s}^{-1}` -> `4.5 \\times 10^{33}`; `300 K` -> `300`; `2 mn` stays."""
    head, bare = s, False
    while True:
        wrapped = _WRAPPED_UNIT.search(head)
        m = wrapped or _BARE_UNIT.search(head)
        if not m or not re.search(r"\d", head[:m.start()]):
            break
        bare = bare or wrapped is None
        head = head[:m.start()].rstrip()
    plain = re.sub(r"\\(?:times|cdot|frac|sqrt|pi)\b|(?<=\d)[eE](?=[-+]?\d)", "", head)
    return s if bare and re.search(r"[a-zA-Z\\]", plain) else head  # a bare unit follows a plain number


def _thousands(s):
    """7,425,000 -> 7425000, when that number is the only thing with commas (27,54,108 stays a list) and
    stands outside brackets ((2,251,252) stays a tuple)."""
    found = re.findall(r"(?<![\d.])-?[1-9]\d{0,2}(?:,\d{3})+(?![\d,])", s)
    if len(found) == 1 and found[0].count(",") == s.count(",") and not re.search(r"[(\[{]", s):
        s = s.replace(found[0], found[0].replace(",", ""))
    return s


def _expand_pm(s):
    """`1 \\pm \\sqrt{19}` -> `1 + \\sqrt{19}, 1 - \\sqrt{19}`, item by item of a comma list."""
    items = []
    for item in _split_top(s, [","]):
        signs = [item]
        while "\\pm" in signs[0] and len(signs) < 8:
            signs = [x.replace("\\pm", sign, 1) for x in signs for sign in "+-"]
        items += signs
    return ", ".join(items)


def _nesting(s):
    """(deepest bracket nesting, whether the brackets balance) of s."""
    d, m, ok = 0, 0, True
    for c in s:  # an escaped \\{ or \\} counts as the brace it is
        d += (c in "({[") - (c in ")}]")
        m, ok = max(m, d), ok and d >= 0
    return m, ok and d == 0


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}
_BRACKETED_MATRIX = re.compile(r"^[(\[]\s*(\\begin\{[pbvB]?matrix\}.*\\end\{[pbvB]?matrix\})\s*[)\]]$", re.S)


def _orient(s):
    """`5 >= x` -> `x <= 5`, `5 > x > 1` -> `1 < x < 5`: a bound on one variable, read as an interval; and
    `1 <= |z| <= 2` -> `z = [-2, -1] \\cup [1, 2]`."""
    m = re.fullmatch(r"([^<>=!|]+?)\s*(<=?)\s*\|([a-zA-Z])\|\s*(<=?)\s*([^<>=!|]+)", s)
    if m and (number(m.group(1).strip()) or (-1,))[0] >= 0:
        lo, op1, x, op2, hi = (g.strip() for g in m.groups())
        i, o = ("[]" if op1 == "<=" else "()"), ("[]" if op2 == "<=" else "()")  # inner and outer brackets
        return "%s = %s-(%s), -(%s)%s \\cup %s%s, %s%s" % (x, o[0], hi, lo, i[1], i[0], lo, hi, o[1])
    m = re.fullmatch(r"([^<>=!]+?)\s*([<>]=?)\s*([a-zA-Z])\s*(?:([<>]=?)\s*([^<>=!]+))?", s)
    if not m or re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", m.group(1) + (m.group(5) or ""))):
        return s  # a bound holds no variable
    lo, op1, x, op2, hi = (g and g.strip() for g in m.groups())
    if op2 is None:
        return "%s %s %s" % (x, _FLIP[op1], lo)
    return "%s %s %s %s %s" % (hi, _FLIP[op2], x, _FLIP[op1], lo) if op1[0] == op2[0] == ">" else s


def _semicolons(s):
    """`(0;0;6)` -> `(0,0,6)`; `-12;-11` -> `-12, -11`; `p=5,q=2;p=7,q=2` -> `(p=5,q=2), (p=7,q=2)`."""
    s = re.sub(r";(?=[^()\[\]]*[)\]])", ",", s)  # inside brackets, a ; separates coordinates
    groups = _split_top(s, [";"])
    if len(groups) > 1 and any(len(_split_top(g, [","])) > 1 for g in groups):
        groups = ["(%s)" % g for g in groups]  # each group one tuple
    return ", ".join(groups)


def normalize(s):
    """A canonical spelling of one final answer (string work only; raises ValueError on absurd input)."""
    if not isinstance(s, str) or len(s) > MAX_LEN:
        raise ValueError("not a string, or longer than %d characters" % MAX_LEN)
    s = s.strip()
    for a, b in [("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")]:
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a):-len(b)].strip()
    if "\\\\" in s and "\\begin" not in s:  # `\\frac`, `\\le`: a command escaped twice
        s = re.sub(r"\\\\(?=[a-zA-Z])", r"\\", s)
    s = s[:-1].strip() if s.endswith("\\") and not s.endswith("\\\\") else s  # a stray backslash: `185\`
    if "\\boxed" in s or "\\fbox" in s:
        s = extract_boxed(s) or s
    if _nesting(s)[0] > MAX_DEPTH:
        raise ValueError("nested deeper than %d" % MAX_DEPTH)
    for pat, rep in _SUBS:
        s = pat.sub(rep, s)
    s = _BRACKETED_MATRIX.sub(r"\1", s) if "matrix" in s else s  # [\begin{matrix}..\end{matrix}]
    s = _strip_units(s.strip())
    s = re.sub(_TEXT + r"\{([^{}]*)\}", r"\1", s)  # other text wrappers keep their content
    s = re.sub(r",?\s+(?:and|or)\s+|(?<=[)\]])\s*(?:or|and)\s*(?=[(\[])", ", ", s)  # 1, and 5; (1,2)or(2,1)
    s = _semicolons(s) if ";" in s else s
    s = _thousands(s)
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    if re.fullmatch(r"-?\d{1,3}(?: \d{3})+(?:\.\d+)?", s):  # 1 000 000
        s = s.replace(" ", "")
    s = re.sub(r"^([a-zA-Z])\s*(?=(?:\(.*\]|\[.*\))$)", r"\1 = ", s)  # t(0,4]: t \in (0,4]
    if "\\approx" in s and "," not in s:  # 1/3 \approx 0.33 -> 1/3, but x \approx 11 -> 11
        head, tail = s.split("\\approx")[0].strip(), s.split("\\approx")[-1].strip()
        s = tail if not head or re.fullmatch(r"[a-zA-Z](?:_\{?\w+\}?)?", head) else head
    s = _orient(s)
    if "\\pm" in s:
        s = _expand_pm(s)
    s = re.sub(r"^\(?([A-E])\)?[.:)]\s.*$", r"\1", s)  # a choice and its text: `C. x = 42` -> C
    return re.sub(r"^\(([A-Za-z])\)$", r"\1", s)  # multiple choice (C) -> C


def _canon(s):
    return re.sub(r"[\s{}]", "", s)


# ---- Numbers, without sympy ------------------------------------------------------------------------------

def number(s):
    """(value, exact) for a plain number in any usual spelling, else None: 025, -1.5, 3/4, \\frac{3}{4}, 1\\frac{4}{5},
    4.5e33, 4.5\\times10^{33}, 4.5 \\cdot 10^{-3}, 10^{5}. Exponents beyond +-400 are refused."""
    s = s.replace(" ", "")
    m = re.fullmatch(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}", s)  # a mixed number: 1\frac{4}{5} = 9/5
    if m and 0 < int(m.group(3)) < int(m.group(4)):
        value = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
        return (-value if m.group(1) else value), True
    m = re.fullmatch(r"(-?)\\frac\{?(\d+)\}?\{?(\d+)\}?|(-?\d+)/(\d+)", s)
    if m:
        num, den = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
        return ((-1 if m.group(1) else 1) * Fraction(int(num), int(den)), True) if int(den) else None
    m = re.fullmatch(r"([-+]?(?:\d+\.?\d*|\.\d+))?"  # a mantissa, then an exponent in any spelling
                     r"(?:(?:e|E|\\times|\\cdot|\*)?(?:10\^\{?([-+]?\d+)\}?|(?<=[\d.])[eE]([-+]?\d+)))?", s)
    if not m or not s or (m.group(1) is None and m.group(2) is None):
        return None
    mant, exp = m.group(1), m.group(2) or m.group(3)
    if exp is not None and abs(int(exp)) > 400:
        raise ValueError("exponent too large")
    value = Fraction(mant or 1) * Fraction(10) ** int(exp or 0)
    return value, exp is None and "." not in (mant or "")


def _close(x, y):
    return x == y or abs(x - y) <= REL_TOL * max(abs(x), abs(y))


# ---- Structures and the comparison -----------------------------------------------------------------------

def _split_top(s, seps):
    """Split s at any of seps that stands outside every bracket."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(s):  # an escaped \\{ or \\} counts as the brace it is
        depth += (s[i] in "({[") - (s[i] in ")}]")
        sep = next((x for x in seps if s.startswith(x, i)), None) if depth == 0 else None
        if sep == "=" and s[i - 1:i] in ("<", ">", "!"):  # <=, >= and != are no equals sign
            sep = None
        if sep:
            out.append(s[start:i].strip())
            start = i = i + len(sep)
        else:
            i += 1
    return out + [s[start:].strip()]


def _wraps(s, open_, close):
    """Does the bracket opening at s[0] close exactly at the end of s?"""
    return s.startswith(open_) and s.endswith(close) and _nesting(s[len(open_):len(s) - len(close)])[1]


_INEQ = re.compile(r"^(?:([^<>=]+?)(<=?)\s*)?([a-zA-Z](?:\([a-zA-Z]\))?)\s*(<=?|>=?)\s*([^<>=]+)$")
_REL = re.compile(r"<=|>=|!=|<|>")


def structure(s):
    """(kind, items): matrix, set, bracketed tuple/interval, list, union or a single atom."""
    m = re.fullmatch(r"\\begin\{[pbvB]?matrix\}(.*)\\end\{[pbvB]?matrix\}", s, re.S)
    if m and "\\begin" not in m.group(1):  # one matrix (a sum or product of them is an atom)
        rows = [r for r in (x.strip() for x in re.split(r"\\\\", m.group(1))) if r]
        cells = [[c.strip() for c in r.split("&")] for r in rows]
        return "matrix%dx%d" % (len(cells), len(cells[0])), [c for r in cells for c in r]
    for open_, close in (("\\{", "\\}"), ("{", "}")):
        if _wraps(s, open_, close) and (open_ == "\\{" or "," in s):
            return "set", _split_top(s[len(open_):-len(close)], [","])
    if s[:1] in "([" and s[-1:] in ")]" and _nesting(s[1:-1])[1] and len(_split_top(s[1:-1], [","])) > 1:
        return s[0] + s[-1], _split_top(s[1:-1], [","])
    for kind, seps in (("list", [","]), ("list", ["\\cup", " or ", " and "])):
        parts = _split_top(s, seps)
        if len(parts) > 1:
            return kind, parts
    m = _INEQ.match(s)
    if m and "=" not in s.replace("<=", "").replace(">=", ""):
        lo, op1, _, op2, rhs = m.groups()
        if lo is not None and op2.startswith("<"):           # a < x <= b
            return ("(" if op1 == "<" else "[") + (")" if op2 == "<" else "]"), [lo, rhs]
        if lo is None and op2.startswith(">"):                # x >= a
            return ("(" if op2 == ">" else "[") + ")", [rhs, "\\infty"]
        if lo is None:                                        # x < b
            return "(" + (")" if op2 == "<" else "]"), ["-\\infty", rhs]
    return "atom", [s]


def is_equivalent(pred, gold, timeout=5.0):
    """Are two final answers (LaTeX, maybe in $..$, \\(..\\), \\[..\\]) mathematically the same? A gold that is a
    whole solution counts by its final answer; joined boxes (_boxed_tail) count together against several parts."""
    try:
        _worker()  # started before the clock: its start-up (seconds on a busy machine) is not the check's time
        deadline = time.monotonic() + timeout
        a, b = normalize(pred), normalize(_gold_answer(gold))
        return _equal(a, b, deadline) or _equal_parts(pred, b, deadline) or _equal_parts(gold, a, deadline)
    except Exception:  # absurd input, parse errors, timeouts: not equivalent
        return False


def _gold_answer(gold):
    """A whole solution's final answer: its last boxes, else extract_answer's where it says `answer` or is long."""
    tail = _boxed_tail(gold)
    if tail is None and isinstance(gold, str) and (len(gold) > MAX_LEN or _FINAL.search(gold)):
        tail = extract_answer(gold)
    return tail or gold


def _equal_parts(text, other, deadline):
    """Do the boxes joined at the end of text (_boxed_tail), read together, equal `other`, of several parts?"""
    boxes = _boxes(_boxed_tail(text) or "")
    several = len(boxes) > 1 and structure(other)[0] in ("list", "set")
    return several and _equal(normalize(", ".join(b[2] for b in boxes)), other, deadline)


def _bare_rhs(s):
    """`x = 5` -> `5` when the left side only names the answer: a variable (x_1, \\theta, f(x)), a tuple of
    them `(x, y)`, a segment or ratio `AB`, `\\frac{NO}{BO}`, `m_{\\max}`, `\\angle ABC`; else None."""
    sides = _split_top(s, ["="]) if "=" in s else [s]
    if len(sides) != 2:
        return None
    name = re.sub(r"_\{[^{}]*\}|_\\?\w+|\\[a-zA-Z]+", "", sides[0])  # subscripts and commands off
    return sides[1] if re.search(r"[a-zA-Z]", name) and not re.search(r"[\d+\-*/^<>!]", name) else None


def _worked(s):
    """`x = 5+5+1 = 7 = 11` -> `x = 11`; `1 = y = 0` -> `0`: a worked line's answer is its last side, after
    its name if it starts with one. Two sides stay an equation: `0.56 = 56\\%` is not `1.56 = 56\\%`."""
    sides = _split_top(s, ["="]) if "=" in s else [s]
    if len(sides) < 3 or len(_split_top(s, [","])) > 1:
        return s
    return sides[0] + " = " + sides[-1] if _bare_rhs(sides[0] + "=" + sides[-1]) else sides[-1]


def _relation(s):
    """(op, `(lhs)-(rhs)`) of a single inequality, > and >= turned round to < and <=; else None."""
    parts = _REL.split(s) if _REL.search(s) else [s]
    if len(parts) != 2 or "=" in _REL.sub("", s) or len(_split_top(s, [","])) > 1:
        return None
    op = _REL.search(s).group()
    lhs, rhs = parts[::-1] if op[0] == ">" else parts
    return _FLIP[op] if op[0] == ">" else op, "(%s)-(%s)" % (lhs, rhs)


def _equal(a, b, deadline):
    if _canon(a) == _canon(b):
        return True
    a, b = _worked(a), _worked(b)
    if re.fullmatch(r"[A-Za-z ]+", a) and re.fullmatch(r"[A-Za-z ]+", b):  # words: Yes ~ yes, but M !~ m
        return min(len(a), len(b)) > 1 and a.lower() == b.lower()
    ra, rb = _bare_rhs(a), _bare_rhs(b)
    line = re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", ra or rb or ""))  # y = 2x+1: no label, a line
    if (ra is None) != (rb is None) and not (line and all("=" in x for x in (a, b))):
        return _equal(ra or a, rb or b, deadline)  # x = 5 ~ 5; x \in [2, \infty) ~ [2, \infty)
    ia, ib = _INEQ.match(a), _INEQ.match(b)
    if ia and ib and ia.group(3) != ib.group(3):  # k >= 2 !~ K >= 2: an inequality keeps its variable
        return False
    la, lb = _relation(a), _relation(b)
    if la and lb and not (ia and ib):  # -x > -1 ~ x < 1: the same relation, up to a positive factor
        signs = ("pos", "neg") if la[0] == "!=" else ("pos",)
        return la[0] == lb[0] and _ask_worker("ratio", la[1], lb[1], deadline) in signs
    (ka, xa), (kb, xb) = structure(a), structure(b)
    ka, kb = (k.replace("set", "list") for k in (ka, kb))  # \{1, 3, 5\} ~ 1, 3, 5: both unordered
    if ka == "atom" and kb == "atom":
        return _atom_equal(a, b, deadline)
    if ka != kb and "\\begin" in a and "\\begin" in b:  # a sum or product of matrices against a matrix
        return _ask_worker("equal", a, b, deadline) == "true"
    if {ka, kb} == {"atom", "list"}:  # a decimal comma, 1,22 ~ 1.22, only against a number with a point
        da, db = (re.sub(r"^(-?\d+),(\d+)$", r"\1.\2", x) for x in (a, b))
        decimal = all(number(x) is not None and "." in x for x in (da, db))
        return (da, db) != (a, b) and decimal and _equal(da, db, deadline)
    if ka == "list" and len(xa) != len(xb):  # an item written twice counts once: (3,17,3,7), (3, 17, 3, 7)
        xa, xb = (list({_canon(x): x for x in items}.values()) for items in (xa, xb))
    if ka != kb or len(xa) != len(xb) or len(xa) > 32:
        return False
    if ka == "list":  # match each item to an unused equal one
        left = list(xb)
        for x in xa:
            j = next((j for j, y in enumerate(left) if _equal(x, y, deadline)), None)
            if j is None:
                return False
            left.pop(j)
        return True
    return all(_equal(x, y, deadline) for x, y in zip(xa, xb))


def _atom_equal(a, b, deadline):
    ea, eb = _split_top(a, ["="]), _split_top(b, ["="])
    if len(ea) != len(eb) or len(ea) > 2:
        return False
    if len(ea) == 2:  # both equations: the same sides, or lhs - rhs equal up to a non-zero factor
        if _equal(ea[0], eb[0], deadline):  # the same left side (a name): the same right side
            return _equal(ea[1], eb[1], deadline)
        da, db = "(%s)-(%s)" % tuple(ea), "(%s)-(%s)" % tuple(eb)
        return _ask_worker("ratio", da, db, deadline) in ("pos", "neg")
    na, nb = number(a), number(b)
    if na and nb:
        return na[0] == nb[0] if na[1] and nb[1] else _close(float(na[0]), float(nb[0]))
    return _ask_worker("equal", a, b, deadline) == "true"


# ---- The sympy side: a whitelist parser, run only inside the worker process ------------------------------

_TOKEN = re.compile(r"\s*(\d+\.?\d*|\.\d+|\\(?:begin|end)\{[a-zA-Z]*\}|\\\\|\\[a-zA-Z]+|\\[{}|]|[a-zA-Z]|\S)")
_FUNCS = ("sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp").split()
_GREEK = ("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho "
          "sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega "
          "hbar ell").split()
_INVERSE = {"sin": "asin", "cos": "acos", "tan": "atan", "cot": "acot", "sec": "asec", "csc": "acsc"}


class _Parser:
    """LaTeX math -> sympy, by recursive descent over whitelisted tokens. Raises on anything else."""

    def __init__(self, s):
        import sympy
        self.sp, self.toks, self.i = sympy, _TOKEN.findall(s), 0
        if "".join(self.toks) != re.sub(r"\s", "", s):
            raise ValueError("untokenisable input")

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expect=None):
        t = self.peek()
        if t is None or (expect is not None and t != expect):
            raise ValueError("expected %r, got %r" % (expect, t))
        self.i += 1
        return t

    def accept(self, t):
        """Take the next token if it is t."""
        found = self.peek() == t
        self.i += found
        return found

    def parse(self):
        e = self.expr()
        if self.peek() is not None:
            raise ValueError("trailing %r" % self.peek())
        return e

    def expr(self):
        e = self.term()
        while self.peek() in ("+", "-"):
            e = e + self.term() if self.take() == "+" else e - self.term()
        return e

    def term(self):
        e = self.unary()
        while True:
            t = self.peek()
            if t in ("*", "\\cdot", "\\times", "/", "\\div"):
                self.take()
                e = e * self.unary() if t in ("*", "\\cdot", "\\times") else e / self.unary()
            elif t is not None and (t[0].isalnum() or t in ("(", "{") or t[1:] in _FUNCS + _GREEK
                                    or t.startswith("\\begin{")
                                    or t in ("\\frac", "\\sqrt", "\\pi", "\\infty", "\\binom", "\\lfloor",
                                             "\\lceil", "\\max", "\\min", "\\angle", "\\sum", "\\prod")):
                e = e * self.power()  # implicit product: 2x, 2\sqrt{2}, x(x+1)
            else:
                return e

    def unary(self):
        if self.peek() in ("-", "+"):
            return -self.unary() if self.take() == "-" else self.unary()
        return self.power()

    def power(self):
        base = self.atom()
        while self.accept("!"):
            if base.is_number and not (base.is_Integer and 0 <= base <= 1000):
                raise ValueError("factorial of %s" % base)
            base = self.sp.factorial(base)  # n! stays symbolic
        if not self.accept("^"):
            return base
        exp = self.arg()
        if base.is_number and exp.is_number and abs(base) not in (0, 1):
            digits = abs(float(exp)) * abs(math.log10(abs(complex(base))))
            if digits > 10000:
                raise ValueError("power too large")  # 2^{1009} is fine; 9^{9^{9^9}} stops here
        return base ** exp

    def arg(self):
        """A braced group, or a single token: \\frac12, x^2, \\sqrt2, x^-1."""
        if self.accept("{"):
            e = self.expr()
            self.take("}")
            return e
        if self.accept("-"):
            return -self.arg()
        t = self.peek()
        if t is not None and t[0].isdigit() and len(t) > 1:
            self.toks[self.i] = t[1:]
            return self.sp.Integer(int(t[0]))
        return self.atom()

    def atom(self):
        sp, t = self.sp, self.take()
        if t[0].isdigit() or t[0] == ".":
            return sp.Float(t) if "." in t else sp.Integer(int(t))
        if t.isalpha() and len(t) == 1:
            if self.accept("_"):  # x_1, x_{n}, m_{\max}: one symbol named after its subscript
                return sp.Symbol(t + "_" + self.subscript())
            if self.peek() == "(" and (t.isupper() or t in "fgh"):  # I(0), f(x): a function's value, not a product
                return sp.Function(t)(*self.arguments())
            return {"e": sp.E, "i": sp.I}.get(t) or sp.Symbol(t)
        if t in ("(", "[", "{", "|"):
            e = self.expr()
            self.take({"(": ")", "[": "]", "{": "}", "|": "|"}[t])
            return sp.Abs(e) if t == "|" else e
        if t == "\\frac":
            return self.arg() / self.arg()
        if t == "\\binom":
            n, k = self.arg(), self.arg()
            if n.is_number and not (n.is_Integer and abs(n) <= 10000):
                raise ValueError("binomial")
            return sp.binomial(n, k)  # \binom{2n}{n} stays symbolic
        if t in ("\\lfloor", "\\lceil"):
            e = self.expr()
            self.take(t.replace("l", "r", 1))
            return sp.floor(e) if t == "\\lfloor" else sp.ceiling(e)
        if t in ("\\max", "\\min"):
            return (sp.Max if t == "\\max" else sp.Min)(*self.arguments())
        if t == "\\angle":  # \angle ABC: one symbol
            name = ""
            while self.peek() is not None and self.peek().isalpha() and len(self.peek()) == 1:
                name += self.take() + ("_" + self.subscript() if self.accept("_") else "")
            return sp.Symbol("angle_" + name)
        if t == "\\sqrt":
            if self.accept("["):
                n = self.expr()
                self.take("]")
                return sp.root(self.arg(), n)
            return sp.sqrt(self.arg())
        if t in ("\\pi", "\\infty"):
            return sp.pi if t == "\\pi" else sp.oo
        if t.startswith("\\begin{"):  # a matrix: cells between &, rows between \\\\
            rows = [[]]
            while not self.accept(t.replace("begin", "end")):
                if self.accept("\\\\"):
                    rows.append([])
                else:
                    rows[-1].append(self.expr())
                    self.accept("&")
            return sp.Matrix([r for r in rows if r])
        if t in ("\\sum", "\\prod"):  # \sum_{k=0}^{n-1} F_k F_{n-k-1}: its bounds, then the factors after
            self.take("_")
            k, lo = self.subscript().split("=")  # the raw text of `k=0`
            self.take("^")
            lo, hi = _Parser(lo).parse(), self.arg()
            if any(b.is_number and not abs(b) <= 10000 for b in (lo, hi)):
                raise ValueError("bounds")
            return (sp.Sum if t == "\\sum" else sp.Product)(self.factors(), (sp.Symbol(k), lo, hi))
        if t[1:] in _GREEK:
            return sp.Symbol(t[1:] + ("_" + self.subscript() if self.accept("_") else ""))
        if t[1:] in _FUNCS:
            return self._function(t[1:])
        raise ValueError("unknown token %r" % t)

    def subscript(self):
        """The raw text of a subscript, `1` in x_1 and `\\max` in m_{\\max}: a name, not an expression."""
        if not self.accept("{"):
            return self.take()
        depth, out = 1, ""
        while True:
            t = self.take()
            depth += (t == "{") - (t == "}")
            if depth == 0:
                return out
            out += t

    def arguments(self):
        """(a, b, ...) or \\{a, b, ...\\}: a function's arguments."""
        close = {"(": ")", "\\{": "\\}", "{": "}"}[self.take()]
        args = [self.expr()]
        while self.accept(","):
            args.append(self.expr())
        self.take(close)
        return args

    def factors(self):
        """The factors that follow, multiplied: the argument of \\cos 2t, the body of \\sum_{k=1}^{n} k^2."""
        x = self.power()
        while self.peek() is not None and (self.peek()[0].isalnum() or self.peek()[1:] in _GREEK + ["pi"]):
            x = x * self.power()
        return x

    def _function(self, name):
        sp = self.sp
        base = self.arg() if name == "log" and self.accept("_") else None
        power = self.arg() if self.accept("^") else None
        if power == -1 and name in _INVERSE:  # \sin^{-1} x is arcsin x
            name, power = _INVERSE[name], None
        x = self.atom() if self.peek() == "(" else self.factors()  # \cos 2t is cos(2t)
        renamed = {"ln": sp.log, "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan}
        f = renamed.get(name) or getattr(sp, name)
        y = sp.log(x, base) if base is not None else f(x)
        return y ** power if power is not None else y


def _sym_equal(a, b):
    import sympy as sp
    x, y = _Parser(a).parse(), _Parser(b).parse()
    if getattr(x, "is_Matrix", False) or getattr(y, "is_Matrix", False):  # A + B against the matrix it makes
        return x.shape == y.shape and sp.simplify(x - y).is_zero_matrix
    d = sp.S.Zero if x == y else sp.simplify(x - y)
    if d == 0:
        return True
    if x.free_symbols or y.free_symbols:
        return False
    if x.has(sp.Float) or y.has(sp.Float):  # written as decimals: the relative tolerance
        vx, vy = complex(sp.N(x, 50)), complex(sp.N(y, 50))
        return _close(vx.real, vy.real) and _close(vx.imag, vy.imag)
    # exact numbers simplify could not settle: unequal when the difference is provably non-zero (2^{-98})
    return d.is_zero is not False and abs(sp.N(d, 50)) <= 1e-30 * max(1, abs(sp.N(x, 50)))


def _sym_ratio(a, b):
    """"pos" or "neg" when a / b simplifies to a positive or negative number (and a has a variable)."""
    import sympy as sp
    x, y = _Parser(a).parse(), _Parser(b).parse()
    r = sp.simplify(x / y) if x.free_symbols and y != 0 else sp.S.Zero  # zero: no ratio
    if r.free_symbols or not r.is_number or r == 0:
        return "none"
    return "pos" if r.is_positive else "neg" if r.is_negative else "none"


# ---- The worker: one process per calling thread, JSON lines on pipes, killed on timeout ------------------

_RANKS = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))  # torchrun's ranks on this node share its cores
_POOL_SIZE = max(1, (os.cpu_count() or 1) // _RANKS)  # score_all's threads, each with its sympy process
_local, _workers = threading.local(), weakref.WeakSet()


@functools.lru_cache(maxsize=1)
def _pool():
    """score_all's thread pool and its exit hook, started on first use: importing starts nothing."""
    atexit.register(_shutdown)
    return ThreadPoolExecutor(max_workers=_POOL_SIZE)


def _shutdown():
    """At exit: no thread waits on a check, and no worker process outlives its parent."""
    _pool().shutdown(wait=False, cancel_futures=True)
    for worker in list(_workers):
        worker.close()


def _serve():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a blow-up is a MemoryError, not an OOM
    import sympy  # noqa: F401  (imported before "ready", so start-up never eats a check's timeout)
    print("ready", flush=True)
    for line in sys.stdin:
        op, a, b = json.loads(line)
        try:
            answer = _sym_ratio(a, b) if op == "ratio" else "true" if _sym_equal(a, b) else "false"
        except Exception:
            answer = "none" if op == "ratio" else "false"
        print(answer, flush=True)


class _Worker:
    """A sympy process serving one thread; it dies with the thread (or when a check times out)."""

    def __init__(self):
        here = os.path.dirname(os.path.abspath(__file__))
        serve = "import sys; sys.path.insert(0, %r); import reward; reward._serve()" % here
        # a session of its own: a signal to the trainer's group must spare the checks of its last step (StopAtStepEnd)
        self.proc = subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                     start_new_session=True)
        _workers.add(self)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("reward worker failed to start")

    def close(self):
        self.proc.kill()
        self.proc.wait()

    __del__ = close


def _worker():
    """This thread's sympy worker, started (or restarted after a timeout) on demand."""
    w = getattr(_local, "worker", None)
    if w is None or w.proc.poll() is not None:
        w = _local.worker = _Worker()
    return w


def _ask_worker(op, a, b, deadline):
    """The worker's answer to op ("equal": "true"/"false"; "ratio": "pos"/"neg"/"none"), None on timeout."""
    if time.monotonic() >= deadline:
        return None  # the check's time is spent: no fresh worker (seconds to start) for its remaining parts
    w = _worker()
    w.proc.stdin.write(json.dumps([op, a, b]) + "\n")
    w.proc.stdin.flush()
    if not select.select([w.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
        _local.worker = None  # a check that hangs dies with its worker; the next call starts a fresh one
        return None
    return w.proc.stdout.readline().strip()
