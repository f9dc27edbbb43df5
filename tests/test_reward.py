"""reward.py: equivalence (true and false), public grader cases, DAPO's reward, hostile input, timeouts, fuzz."""
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import reward
from reward import dapo_score, extract_answer, extract_boxed, is_equivalent, score, score_all
from support import load_script

HERE = os.path.dirname(os.path.abspath(__file__))

EQUIVALENT = [
    # normalisation
    ("\\left(1,2\\right)", "(1,2)"), ("\\dfrac{3}{4}", "\\frac34"), ("\\tfrac{1}{2}", "0.5"),
    ("3\\!\\,x", "3x"), ("5~\\text{cm}", "5"), ("\\text{5}", "5"), ("\\mathrm{5}", "5"), ("\\mbox{7}", "7"),
    ("5\\text{ cm}", "5"), ("10 \\text{ degrees}", "10"), ("30^\\circ", "30"), ("30^{\\circ}", "30"),
    ("50\\%", "50"), ("5.", "5"), ("7,425,000", "7425000"), ("1{,}000", "1000"), ("32,\\!348", "32348"),
    ("\\$18.90", "18.90"), ("\\$32,\\!348", "32348"), ("$\\frac{1}{2}$", "\\(0.5\\)"), ("\\[7\\]", "7"),
    # numbers
    ("025", "25"), ("0.5", "\\frac{1}{2}"), ("1/2", "0.5"), ("-0.25", "-\\frac{1}{4}"),
    ("4.5e33", "4.5\\times10^{33}"), ("4.5e33", "4.5 \\cdot 10^{33}"), ("4.5e33", "4.5 \\times 10^{33} \\mathrm{~erg}"),
    ("2.7778e-6", "2.7778 \\times 10^{-6}"), ("1e-5", "10^{-5}"), ("3.14159", "3.1416"),  # rel diff 3e-6
    # symbolic
    ("\\sqrt{8}", "2\\sqrt{2}"), ("\\frac{\\pi}{2}", "\\pi/2"), ("x^2+2x+1", "(x+1)^2"), ("\\sqrt[3]{27}", "3"),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"), ("2\\pi", "\\pi \\cdot 2"), ("\\log_2 8", "3"),
    ("1+2i", "2i+1"), ("\\binom{5}{2}", "10"), ("5!", "120"), ("|{-3}|", "3"), ("\\sin^2 x+\\cos^2 x", "1"),
    # structures
    ("(1, 2)", "\\left(1,2\\right)"), ("(1,2]", "(1, 2]"), ("1, 2", "2, 1"), ("\\{1,2,3\\}", "\\{3,1,2\\}"),
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{bmatrix}1 & 2 \\\\ 3 & 4\\end{bmatrix}"),
    ("(1,8,19), (2,7,13), (4,5,7)", "(4,5,7), (1,8,19), (2,7,13)"), ("69,84", "84, 69"),
    ("(-\\infty, -3] \\cup [2, \\infty)", "[2,\\infty) \\cup (-\\infty,-3]"),
    # equations and inequalities (an inequality in one variable is the interval it describes, both ways)
    ("x = 5", "5"), ("5", "x=5"), ("y = 2x+3", "y = 3 + 2x"), ("f(x)=x,f(x)=2-x", "f(x)=2-x, f(x)=x"),
    ("x \\ge 2", "[2, \\infty)"), ("[2,\\infty)", "x\\geq 2"), ("x > 2", "(2, \\infty)"), ("x<3", "(-\\infty,3)"),
    ("2 < x \\le 5", "(2,5]"), ("x \\in [2, \\infty)", "[2,\\infty)"),
    # text
    ("\\text{(C)}", "C"), ("\\text{Evelyn}", "Evelyn"), ("(B)", "\\textbf{B}"), ("\\text{yes}", "Yes"),
]

NOT_EQUIVALENT = [
    ("1", "-1"), ("\\frac{1}{2}", "2"), ("(1,2)", "[1,2]"), ("x+1", "x-1"), ("10", "100"), ("(1,2]", "(1,2)"),
    ("1000000", "1000001"), ("3.1416", "3.1426"), ("0.333", "\\frac{1}{3}"), ("4.5e33", "4.5e34"),
    ("2\\sqrt{2}", "\\sqrt{2}"), ("\\frac{\\pi}{2}", "\\pi"), ("x^2+2x+1", "(x-1)^2"), ("1, 2", "1, 2, 3"),
    ("1, 2", "1, 1"), ("\\{1,2\\}", "(1,2)"), ("(2,1)", "(1,2)"), ("y=2x+3", "y=2x-3"), ("x = 5", "6"),
    ("x \\ge 2", "(2, \\infty)"), ("x > 2", "[2,\\infty)"), ("C", "D"), ("\\text{Evelyn}", "Bob"),
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}"),
    ("\\begin{pmatrix}1&2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"), ("025", "250"),
    ("1+2i", "1-2i"), ("e", "2.718"), ("5", ""), ("", "5"), ("5\\text{ cm}", "6"), ("50\\%", "5"),
    ("12", "1, 2"), ("x", "y"), ("\\infty", "-\\infty"), ("\\sqrt{2}", "1.41"),
]


# The answer forms a checker meets, one numbered group per rule; each rule has true and false cases.
FORMS_EQUIVALENT = [
 # 1 sets and lists
 ("\\{1,3,5\\}", "1, 3, 5"), ("n \\in \\{1,3,5\\}", "1, 3, 5"), ("1, 3, \\text{ and } 5", "1, 3, 5"), ("1, 3 and 5", "5, 3, 1"),
 # 2 named
 ("(x,y) = (3,2)", "(3,2)"), ("(a,b,c)=(2,251,252)", "(2,251,252)"), ("AB=4, CD=5", "4, 5"),
 ("\\frac{NO}{BO}=\\frac{1}{\\sqrt6}", "\\frac{\\sqrt{6}}{6}"), ("m_{\\max}=\\frac{9}{32}\\sqrt{2}", "\\frac{9\\sqrt2}{32}"),
 ("M=\\frac{9}{32} \\sqrt{2}", "\\frac{9}{32}\\sqrt{2}"),
 ("t(0,4]", "(0,4]"), ("t(0,4]", "t \\in (0,4]"), ("k \\geqslant 2", "k \\geq 2"), ("k \\leqslant 2", "k \\le 2"),
 ("\\angle B E A_{1}=90,\\angle A E B_{1}=90", "90, 90"),
 # 3 pm
 ("1 \\pm \\sqrt{19}", "1+\\sqrt{19}, 1-\\sqrt{19}"), ("\\pm 2021", "\\{-2021, 2021\\}"), ("0, \\pm 2", "-2, 0, 2"),
 ("x = \\pm 3", "3, -3"), ("±2", "2, -2"),
 # 4 mixed numbers
 ("1\\frac{4}{5}", "\\frac{9}{5}"), ("1\\frac{4}{5}", "1.8"), ("137 \\frac{1}{2}", "275/2"), ("-2\\frac{1}{3}", "-\\frac{7}{3}"),
 # 5 thousands vs lists
 ("27,54,108,...,378", "27, 54, 108, ..., 378"), ("7,425,000", "7425000"), ("x = 1,000", "1000"),
 # 6 units
 ("4.5 \\times 10^{33} \\text{ erg s}^{-1}", "4.5e33"), ("4.5\\times10^{33}\\mathrm{erg\\,s^{-1}}", "4.5e33"),
 ("300 \\text{km}\\,\\text{s}^{-1}", "300"), ("12 \\text{ m}^2", "12"), ("2.7 \\text{ g/cm}^3", "2.7"), ("300 K", "300"),
 ("5 \\AA", "5"), ("3 \\mu m", "3"), ("0.5 M_\\odot", "0.5"), ("2 M_{\\odot}", "2"), ("90°", "90"), ("28 percent", "28\\%"),
 ("\\frac{600}{7} km/h", "\\frac{600}{7}"), ("6 \\times 10^{8} m/s", "6e8"),
 # 7 symbols
 ("\\rho_0 g h", "g h \\rho_{0}"), ("\\omega_n^2", "\\omega_{n} \\omega_n"), ("\\frac{\\hbar}{2}", "0.5\\hbar"),
 ("\\lfloor \\frac{n}{2} \\rfloor", "\\left\\lfloor \\frac{n}{2}\\right\\rfloor"), ("\\lceil 2.5 \\rceil", "3"), ("\\lfloor 2.5 \\rfloor", "2"),
 ("\\binom{2n}{n}", "\\frac{(2n)!}{(n!)^2}"), ("n!", "n (n-1)!"), ("\\max(3, 5)", "5"), ("\\max\\{a, b\\}", "\\max(b, a)"),
 ("\\angle ABC", "\\angle ABC"), ("2^{1009}", "2 \\cdot 2^{1008}"), ("\\cos 2t", "\\cos^2 t - \\sin^2 t"),
 ("\\sin^{-1} x", "\\arcsin x"), ("\\tan^{-1}(1)", "\\frac{\\pi}{4}"), ("\\sin 2x", "2\\sin x \\cos x"),
 # 8 boxes
 ("\\boxed{1} and \\boxed{-2}", "1, -2"), ("\\boxed{1}, \\boxed{-2}", "-2, 1"),
 # 10 kept right
 ("I(0)e^{-t/RC}", "e^{-t/RC} I(0)"), ("\\text{Yes}", "yes"), ("f(x)=x,f(x)=2-x", "f(x) = 2-x, f(x) = x"),
]
FORMS_NOT_EQUIVALENT = [
 # 1-8: near misses that must stay wrong; 10: function calls, unit-like letters and case
 ("\\{1,3,5\\}", "1, 3"), ("(x,y)=(3,2)", "(2,3)"), ("AB=4, CD=5", "4, 6"), ("x^2 = 4", "4"), ("x + y = 5", "5"),
 ("1 \\pm \\sqrt{19}", "1+\\sqrt{19}"), ("\\pm 2021", "2021"),
 ("1\\frac{4}{5}", "\\frac{4}{5}"), ("137 \\frac{1}{2}", "68.5"), ("1\\frac{4}{5}", "\\frac45"),
 ("27,54,108,...,378", "2754108378"),
 ("4.5 \\times 10^{33} \\text{ erg s}^{-1}", "4.5e34"), ("300 K", "301"),
 ("\\rho_0", "\\rho_1"), ("\\lfloor 2.5 \\rfloor", "3"), ("\\binom{2n}{n}", "\\binom{2n}{n+1}"), ("\\max(3,5)", "3"),
 ("2^{1009}", "2^{1008}"), ("\\cos 2t", "2\\cos t"), ("\\cos 2t", "t \\cos 2"), ("\\sin^{-1} x", "\\frac{1}{\\sin x}"),
 ("\\boxed{1} and \\boxed{-2}", "-2"),
 ("I(0)e^{-t/RC}", "0"), ("2 mn", "2"), ("M", "m"), ("3r^2", "3R^2"), ("2m", "2"), ("\\angle ABC", "\\angle ACB"),
 ("f(x)", "f"), ("P(1)", "P"), ("k \\geq 2", "K \\geq 2"), ("t(0,4]", "T(0,4]"),
 ("-3,0", "-3"), ("6764,10945", "6764"),  # a list is no decimal comma against an integer (1,22 ~ 1.22 stays)
]

# The answer classes of the public graders' cases the checker once failed, each with its near misses.
GRADER_CASES_EQUIVALENT = [
 # inequalities written another way round, or spelled \lt, \gt, \neq, !=
 ("5 \\geq x", "x \\le 5"), ("5 \\geq x", "(-\\infty, 5]"), ("10 > x > 1", "(1, 10)"), ("-x > -1", "x < 1"),
 ("-x >= -1", "x \\leq 1"), ("x \\lt 3", "x < 3"), ("x \\gt 5", "x > 5"), ("x \\neq 3", "x != 3"),
 ("3 \\neq x", "x \\ne 3"), ("0<f(x)<1", "(0,1)"), ("1 \\le |z| \\le 2", "z \\in [-2,-1] \\cup [1,2]"),
 ("-2 \\\\le x \\\\le 7", "x \\in [-2,7]"),
 # equations equal up to rearrangement or a non-zero factor; a worked line's last side
 ("2x+4y-3=0", "y=-\\frac{1}{2}x+\\frac{3}{4}"), ("x^2/4 + y^2/3 = 1", "x^2/16 + y^2/12 = 1/4"),
 ("34x+45y-20z+100=0", "-34x-45y+20z-100=0"), ("x = 5+5+1 = 7 = 11", "x = 11"), ("z = 1+1 = 2", "2"),
 ("x = 1/3 \\approx 0.33", "\\frac13"), ("x \\approx 11", "11"), ("\\approx 8.24", "8.24"),
 ("F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}", "F_n = \\sum_{k=0}^{n-1} F_{n-k-1} F_k"),
 # matrices: array in \left[ \right], a matrix in brackets, sums and products of matrices
 ("\\left[\\begin{array}{cc}1 & 2 \\\\ 3 & 4\\end{array}\\right]", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
 ("(\\begin{pmatrix}1\\\\2\\end{pmatrix})", "\\begin{bmatrix}1\\\\2\\end{bmatrix}"),
 ("\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix} + \\begin{pmatrix}5 & 6 \\\\ 7 & 8\\end{pmatrix}",
  "\\begin{pmatrix}6 & 8 \\\\ 10 & 12\\end{pmatrix}"),
 ("\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}\\begin{pmatrix}2 & 0 \\\\ 0 & 2\\end{pmatrix}",
  "\\begin{pmatrix}2 & 0 \\\\ 0 & 2\\end{pmatrix}"),
 # lists in other separators, named tuples repeated, separately boxed answers, an item written twice
 ("-12;-11;-10", "\\{-12, -11, -10\\}"), ("(11,7)or(7,11)", "(7,11), (11,7)"),
 ("p=5,q=2;p=7,q=2", "(5,2),(7,2)"), ("(0;0;6),(4;-2;0)", "(4,-2,0),(0,0,6)"),
 ("\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}", "(6,2), (2,2)"),
 ("\\(\\boxed{1}\\) and \\(\\boxed{-2}\\)", "-2, 1"), ("\\boxed{(2, 2)} \\text{ for (a) and } \\boxed{(6, 2)}", "(6,2), (2,2)"),
 ("(3,17,3,7), (3, 17, 3, 7), (17,3,3,7)", "(17,3,3,7), (3,17,3,7)"),
 # other graders' spellings: a choice with its text, a doubled backslash, a stray one, \textnormal, percentage
 ("C. x = 42", "C"), ("\\\\frac{1}{2}", "0.5"), ("185\\", "185"), ("125\\textnormal{ miles}", "125"),
 ("28 percentage", "28\\%"),
]
GRADER_CASES_NOT_EQUIVALENT = [
 ("5 \\geq x", "x \\geq 5"), ("10 > x > 1", "[1, 10)"), ("-x > -1", "x > 1"), ("-x > -1", "x \\le 1"),
 ("x \\neq 3", "x \\neq 4"), ("x < 1", "y < 1"), ("1 \\le |z| \\le 2", "z \\in [1,2]"), ("0<f(x)<1", "[0,1)"),
 # equations: a near miss stays wrong, and an unsolved equation is not its solution
 ("2x+4y-3=0", "y=-\\frac{1}{2}x-\\frac{3}{4}"), ("2x+4y-3=0", "y=-2x+\\frac{3}{4}"),
 ("x^2/4 + y^2/3 = 1", "x^2/16 + y^2/12 = 1"), ("34x+45y-20z+100=0", "-34x-45y+20z+100=0"),
 ("y = x^2", "y = x^3"), ("x^2 = 4", "x = 2"), ("k = 3", "k + 1 = 4"), ("x = 5", "y = 5"), ("2 = 3", "4 = 6"),
 ("7 = 11a+c", "11a+c"), ("x = 5+5+1 = 7 = 11", "x = 12"), ("x \\approx 11", "12"),
 ("1.56 = 56\\%", "0.56 = 56\\%"), ("\\frac{1}{2} = \\frac{10}{9}", "\\frac{10}{9}"), ("\\approx 9.24", "\\approx 8.24"),
 ("\\frac{2}{2^{98}}", "\\frac{1}{2^{98}}"), ("\\frac{1}{2^{99}}", "\\frac{1}{2^{98}}"), ("\\frac{1}{200!}", "\\frac{1}{201!}"),
 ("F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}", "F_n = \\sum_{k=0}^{n-2} F_k F_{n-k-2}"),
 ("\\left[\\begin{array}{cc}1 & 2 \\\\ 3 & 4\\end{array}\\right]", "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}"),
 ("\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix} + \\begin{pmatrix}5 & 6 \\\\ 7 & 8\\end{pmatrix}",
  "\\begin{pmatrix}6 & 8 \\\\ 10 & 13\\end{pmatrix}"),
 ("-12;-11;-10", "\\{-12, -11\\}"), ("(11,7)or(7,11)", "(7,11)"), ("p=5,q=2;p=7,q=2", "(5,2),(2,7)"),
 ("(0;0;6)", "(0,6,0)"), ("C. x = 42", "D"), ("185\\", "18"),
]


@pytest.mark.parametrize("a,b", EQUIVALENT + FORMS_EQUIVALENT + GRADER_CASES_EQUIVALENT)
def test_equivalent(a, b):
    assert is_equivalent(a, b) and is_equivalent(b, a)


@pytest.mark.parametrize("a,b", NOT_EQUIVALENT + FORMS_NOT_EQUIVALENT + GRADER_CASES_NOT_EQUIVALENT)
def test_not_equivalent(a, b):
    assert not is_equivalent(a, b) and not is_equivalent(b, a)


def test_relative_tolerance_both_sides():
    assert reward.REL_TOL == 1e-4
    assert is_equivalent("1.00009", "1")       # 9e-5 < 1e-4
    assert not is_equivalent("1.00011", "1")   # 1.1e-4 > 1e-4
    assert not is_equivalent("1000001", "1000000")  # integers are exact, whatever the tolerance


def test_the_public_graders_own_cases():
    """Every answer-level case of the public graders' test suites (tests/data/public_grader_cases.jsonl, as
    benchmarks/public_graders.py runs them for the README): our verdict is the source's, except in the
    cases whose `reason` says why we deliberately differ."""
    suite = load_script("benchmarks/public_graders.py")
    cases = suite.load()
    assert len(cases) >= 300 and len({c["source"].split("@")[0] for c in cases}) >= 5
    assert {c["class"] for c in cases} == set(suite.CLASSES)
    assert all(c["source"] and c["class"] and c["verdict"] in (0, 1) for c in cases)
    assert all(bool(c["reason"]) == (c["verdict"] != c["source_verdict"]) for c in cases)  # each says why
    assert len([c for c in cases if c["reason"]]) <= 15
    assert [c["id"] for c in cases if suite.stapo(c) != bool(c["verdict"])] == []


def test_extract_boxed():
    assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert extract_boxed("\\boxed{a{b{c}}d}") == "a{b{c}}d"
    assert extract_boxed("so \\boxed 5$ done") == "5"
    assert extract_boxed("\\fbox{3}") == "3"
    assert extract_boxed("\\boxed{1} then \\fbox{2}") == "2"
    assert extract_boxed("x = \\boxed{1} and x = \\boxed{-2}.") == "-2"  # words between: the last box only
    assert extract_boxed("$\\boxed{1}$ and $\\boxed{-2}$") == "1, -2"  # boxed separately: one answer
    assert extract_boxed("\\boxed{1}, \\boxed{2}, \\text{ or } \\boxed{3}") == "1, 2, 3"
    assert extract_boxed("\\boxed{3}\\boxed{7}") == "7" and extract_boxed("\\boxed{3} $\\boxed{7}$") == "7"  # no separator
    assert extract_boxed("\\boxed{1} \\quad \\boxed{2}") == "1, 2"
    assert extract_boxed("\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}") == "k = 45, n = 2"
    assert extract_boxed("\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).") == "1, -2"
    assert extract_boxed("\\boxed{1} papers and \\boxed{2} bins") == "2"  # words between: the last box only
    assert extract_boxed("\\boxed{\\boxed{7}}") == "\\boxed{7}" and score("\\boxed{\\boxed{7}}", "7") == 1.0
    assert extract_boxed("no box here") is None
    assert extract_boxed("\\boxed{unbalanced") is None
    assert extract_boxed("\\boxed{5}\\boxed{{") is None  # the last box never closes: no final answer (as DAPO)
    assert extract_boxed(None) is None


def test_extract_answer_takes_boxes_first_then_unboxed_final_forms():
    assert extract_answer("The answer is $9$, not \\boxed{8}") == "8"
    assert extract_answer("So the answer is $9$.") == "9"
    assert extract_answer("...\nAnswer: $\\frac{1}{2}$") == "\\frac{1}{2}"  # DAPO's format
    assert extract_answer("**Final Answer:** 42") == "42"
    assert extract_answer("The final answer is \\(x=3\\).") == "x=3"
    assert extract_answer("We simplify. Therefore $x \\geq 5$ is the solution.") == "x \\geq 5"
    assert extract_answer("To answer this we need $3$ facts") is None  # "answer" without is/:/=
    assert extract_answer("no final answer here") is None and extract_answer(None) is None
    assert score("So the answer is $9$.", "9") == -1.0  # the training reward still requires the box


def test_extract_answer_reads_the_common_final_answer_formats():
    minerva = "...so $x=100$.\nFinal Answer: The final answer is $100$. I hope it is correct."
    assert extract_answer(minerva) == "100"  # Minerva's format (lm-evaluation-harness's prompt)
    plain = "Final Answer: The final answer is 12,000,023. I hope it is correct."
    assert extract_answer(plain) == "12,000,023"
    assert extract_answer("the first CD gives $\\boxed{255}$. Final Answer: The final answer is $10,455$. "
                          "I hope it is correct.") == "10,455"  # stated after the last box, it wins
    assert extract_answer("Final Answer: The largest $n$ is 34.") == "34"
    assert extract_answer("Final Answer: Jane started growing Sphere 3 hours ago.") == "3"
    assert extract_answer("$\\frac{1}{2}$") == "\\frac{1}{2}"  # one bare span
    assert extract_answer("Answer \\[ 9 \\]") == "9"
    assert extract_answer("We find that $x \\lt 3$.") == "x \\lt 3"
    identity = "The identity matrix is $ \\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix} $."
    assert extract_answer(identity) == "\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}"  # math in a sentence
    assert extract_answer("So, the pair $(x, y)$ that solves it is $(7, 6)$.") == "(7, 6)"
    assert extract_answer("Therefore, the probability is 2/3. <|im_start|>user\nSolve \\boxed{5}") == "2/3"
    assert extract_answer("Therefore, there are 12 such sequences.") == "12"
    assert extract_answer("so the number is 10 which is 1,000.99") == "1,000.99"  # the last number, no math
    assert extract_answer("Answer $ \n 9 \n $") is None  # inline math does not span lines
    assert extract_answer("The answer is \\boxed{5}. Therefore $x = 3$.") == "5"  # a box still comes first


def test_score():
    assert score("... so the answer is $\\boxed{25}$.", "025") == 1.0
    assert score("... so the answer is $\\boxed{24}$.", "025") == -1.0
    assert score("the answer is 25", "25") == -1.0  # no box
    assert score("\\boxed{}", "0") == -1.0


def test_an_unboxed_latex_fraction_or_root_is_read_whole():
    assert extract_answer("So x = \\frac{10}{9}.") == "\\frac{10}{9}"  # not its last digit, 9
    assert extract_answer("x=\\dfrac{1}{3}") == "\\dfrac{1}{3}"
    assert extract_answer("Thus the ratio is \\frac12, in lowest terms.") == "\\frac12"
    assert extract_answer("Therefore x = 2\\sqrt{3}") == "2\\sqrt{3}"
    assert extract_answer("So we need 1\\frac{4}{5} cups.") == "1\\frac{4}{5}"
    assert extract_answer("Therefore, there are 12 such sequences.") == "12"  # plain numbers as before
    assert is_equivalent(extract_answer("So x = \\frac{10}{9}."), "10/9")
    assert not is_equivalent(extract_answer("So x = \\frac{10}{9}."), "9")


def test_boxes_joined_by_a_phrase_count_together_against_a_gold_of_several_parts():
    parts = "\\boxed{(3, 3)} for part (a) and \\boxed{(1, 1)}"
    assert score(parts, "(3, 3), (1, 1)") == 1.0 and is_equivalent(parts, "(1, 1), (3, 3)")
    assert score("$y_1 = \\boxed{2}$ and $y_2 = \\boxed{5}$", "y_1 = 2, y_2 = 5") == 1.0
    assert is_equivalent("\\boxed{1,2}", "\\boxed{1}\\boxed{2}")  # a gold boxed in parts
    three = "\\boxed{1} and \\boxed{2} and \\boxed{3}"
    assert score(three, "1, 2, 3") == 1.0 and score(three, "2, 3") == -1.0  # all the parts, no more
    assert score("\\boxed{1} no no no \\boxed{2}", "1, 2") == -1.0  # words that join nothing
    assert score("\\boxed{2} is wrong, so \\boxed{3}", "2, 3") == -1.0


def test_a_gold_of_one_part_is_graded_on_the_final_box_only():
    parts = "\\boxed{(3, 3)} for part (a) and \\boxed{(1, 1)}"
    assert score(parts, "(1, 1)") == 1.0 and score(parts, "(3, 3)") == -1.0
    draft = "First we get \\boxed{3}. Checking again, the answer is \\boxed{7}."
    assert score(draft, "7") == 1.0 and score(draft, "3") == -1.0
    assert score(draft, "3, 7") == -1.0  # a sentence ends between the boxes: the draft is no part
    assert score("\\boxed{3}\\boxed{7}", "7") == 1.0 and score("\\boxed{3}\\boxed{7}", "3") == -1.0


def test_a_gold_written_as_a_whole_solution_counts_by_its_final_answer():
    assert score("\\boxed{5}", "The answer is $\\boxed{5}$.") == 1.0
    solution = "We add 2 and 3 to get a sum. " * 40 + "So the sum is $\\boxed{5}$."
    assert len(solution) > reward.MAX_LEN and score("\\boxed{5}", solution) == 1.0
    assert score("\\boxed{2}", solution) == -1.0 and score("\\boxed{3}", solution) == -1.0
    assert is_equivalent("5", "We add 2 and 3, so the answer is 5.")
    assert not is_equivalent("3", "We add 2 and 3, so the answer is 5.")
    assert is_equivalent("-2, 1", "so the solutions are $n = \\boxed{1,-2}.$")


def test_dapo_score_is_the_last_box_as_an_exact_string():
    """verl's math_dapo.compute_score(text, gold, strict_box_verify=True), as JustRL trains with it."""
    assert dapo_score("so the answer is $\\boxed{42}$.", "42") == 1.0
    assert dapo_score("\\boxed{41}, no: \\boxed{42}", "42") == 1.0  # the last box counts
    assert dapo_score("\\boxed{41}, no: \\boxed{42}", "41") == -1.0
    assert dapo_score("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 1.0  # nested braces
    assert dapo_score("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}") == 1.0
    assert dapo_score("\\boxed{\\boxed{7}}", "7") == 1.0  # the last `\boxed{` is the inner one


@pytest.mark.parametrize("box,gold", [("0.5", "1/2"), ("\\frac{1}{2}", "\\frac12"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
                                      (" 42 ", "42"), ("42", " 42"), ("x = 42", "42"), ("42^\\circ", "42")])
def test_dapo_score_never_normalises(box, gold):
    """A right answer written another way: wrong for DAPO, right for the equivalence checker."""
    assert dapo_score("\\boxed{%s}" % box, gold) == -1.0
    assert score("\\boxed{%s}" % box, gold) == 1.0


def test_dapo_score_reads_only_the_last_100_characters():
    boxed = "x" * 500 + "\\boxed{42}"
    assert dapo_score(boxed + "." * 90, "42") == 1.0  # the box starts 100 characters from the end
    assert dapo_score(boxed + "." * 91, "42") == -1.0  # one more and its backslash is cut off
    assert dapo_score("\\boxed{42}" + " and so on" * 15, "42") == -1.0  # 150 characters after a right box
    assert dapo_score("\\boxed{" + "1" * 95 + "}", "1" * 95) == -1.0  # opened before the window
    assert dapo_score("\\boxed{" + "y" * 95 + "\\boxed{7}}", "7") == 1.0  # its inner box is in the window


def test_dapo_score_without_a_closed_box_is_wrong():
    assert dapo_score("The answer is 42.", "42") == -1.0
    assert dapo_score("\\boxed 42", "42") == -1.0 and dapo_score("\\fbox{42}", "42") == -1.0
    assert dapo_score("\\boxed{42} then \\boxed{43", "42") == -1.0  # the last box never closes
    assert dapo_score("\\boxed{\\{42}", "\\{42") == -1.0  # an escaped brace counts: the box never closes
    assert dapo_score("}} \\boxed{", "") == -1.0


def test_score_all_takes_either_reward():
    texts, golds = ["\\boxed{0.5}", "\\boxed{1/2}", "no box"], ["1/2"] * 3
    assert score_all(texts, golds, reward="dapo") == [-1.0, 1.0, -1.0]
    assert score_all(texts, golds) == score_all(texts, golds, reward="equiv") == [1.0, 1.0, -1.0]
    with pytest.raises(ValueError):
        score_all(texts, golds, reward="math")


def test_dapo_and_the_checker_disagree_on_the_public_responses():
    """The public graders' whole responses against their answer golds (93): the two rewards' verdicts, as
    measured, with each gold as a dataset stores it (Math-Verify's `$..$` off), and as written."""
    suite = load_script("benchmarks/public_graders.py")
    cases = [c for c in suite.load() if c["pred_kind"] == "text" and c["gold_kind"] == "answer"]
    pairs, raw = collections.Counter(), 0
    for c in cases:
        dollars = re.fullmatch(r"\$+(.*?)\$+", c["gold"].strip(), re.S)
        gold = dollars.group(1).strip() if dollars else c["gold"]
        pairs[dapo_score(c["pred"], gold), score(c["pred"], gold)] += 1
        raw += dapo_score(c["pred"], c["gold"]) != score(c["pred"], c["gold"])
    assert pairs == {(1.0, 1.0): 29, (-1.0, -1.0): 50, (-1.0, 1.0): 14}  # DAPO never credits what we reject
    assert raw == 39


def test_hostile_payloads_never_run(tmp_path):
    marker = tmp_path / "pwned"
    for payload in [f"__import__('os').system('touch {marker}')",
                    "().__class__.__bases__[0].__subclasses__()",
                    f"exec(\"open('{marker}','w')\")", f"eval('open(\"{marker}\",\"w\")')",
                    f"\\text{{__import__('os').system('touch {marker}')}}", f"x; import os; os.system('touch {marker}')",
                    "Symbol('x').__class__", "lambda: 1"]:
        assert score(f"\\boxed{{{payload}}}", "1") == -1.0
        assert not is_equivalent(payload, payload + "1")
    assert not marker.exists()


LONG, POWER = "normalize: not a string, or longer than 1000 characters", "parser: power too large"
ABSURD = {  # an absurd answer, and the guard that refuses it before sympy builds anything big
    "9^{9^{9^{9}}}": POWER, "{" * 10000 + "1" + "}" * 10000: LONG, "1" * 100000: LONG,
    "(" * 5000 + ")" * 5000: LONG, "(" * 10000 + "1": LONG, "10^{10^{10}}": POWER,
    "2^{2^{2^{2^{2^{2}}}}}": POWER, "2^{65536}": POWER, "1000!": "parsed: 2568 digits",
    "99999!": "parser: factorial of 99999", "\\binom{10^{9}}{5}": "parser: binomial",
    "1e999999": "number: exponent too large"}
GUARDS = """
import json, math, resource, sys, reward
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # as in the worker: a missing guard eats no host
for x in json.loads(sys.stdin.read()):
    stage = "normalize"
    try:
        s = reward.normalize(x)
        stage = "number"
        if reward.number(s) is None:
            stage = "parser"
            value = reward._Parser(s).parse()
            digits = int(int(value).bit_length() * math.log10(2)) + 1 if value.is_Integer else None
            stage = "parsed: %s digits" % digits
    except ValueError as e:
        stage += ": %s" % e
    print(json.dumps(stage))
"""


@pytest.fixture(scope="module")
def refusals():
    """{absurd answer: where the checker's own steps refuse it}, found in a fresh interpreter: a missing guard
    hangs there, and its timeout (a hang guard, no measure of speed) fails the test instead of hanging it."""
    out = subprocess.run([sys.executable, "-c", GUARDS], input=json.dumps(list(ABSURD)), capture_output=True,
                         text=True, cwd=os.path.join(HERE, ".."), timeout=600, check=True).stdout
    return dict(zip(ABSURD, map(json.loads, out.splitlines())))


@pytest.mark.parametrize("absurd", list(ABSURD), ids=lambda x: x[:20])
def test_absurd_inputs_are_refused_by_a_guard(absurd, refusals):
    """Each absurd answer is refused by a size guard (its length, nesting, exponent, a power's digits, a
    factorial's or binomial's argument) before sympy computes with it, or is a number within the guards
    (1000!: 2568 digits, the largest factorial allowed). Which guard refuses it is the property, not a
    time."""
    assert refusals[absurd] == ABSURD[absurd]
    assert not is_equivalent(absurd, "1")


def work_of(grade, text):
    """What grade(text) costs reward.py, counted, not timed: the lines of reward.py it runs, plus the
    characters it hands the regex engine (a whole string for a search, sub or fullmatch; what an anchored
    match consumes), plus the characters it slices out of the text."""
    count = [0]

    class Text(str):
        def __getitem__(self, key):
            part = str.__getitem__(self, key)
            count[0] += len(part)
            return part

    scans = ("match", "search", "fullmatch", "sub", "subn", "finditer", "findall", "split")

    class Counted:
        def __init__(self, pattern):
            self.pattern = pattern

        def __getattr__(self, name):
            method = getattr(self.pattern, name)
            if name not in scans:
                return method

            def counted(*args, **kwargs):
                out = method(*args, **kwargs)
                if name == "match":  # anchored at pos (args[1]): what it consumed
                    count[0] += out.end() - (args[1] if len(args) > 1 else 0) if out else 0
                else:  # the whole string: sub's is its second argument
                    count[0] += len(args[1] if name in ("sub", "subn") else args[0])
                return out
            return counted

    class Re:  # reward.re: its functions compile their pattern and count as above
        def __getattr__(self, name):
            if name not in scans:
                return getattr(re, name)
            return lambda pattern, *args, **kw: getattr(Counted(re.compile(pattern)), name)(*args, **kw)

    def trace(frame, event, arg):
        if frame.f_code.co_filename != reward.__file__:
            return None

        def line(frame, event, arg):
            count[0] += event == "line"
            return line
        return line
    saved = {k: v for k, v in vars(reward).items() if isinstance(v, re.Pattern)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reward, "re", Re())
        for name, pattern in saved.items():
            mp.setattr(reward, name, Counted(pattern))
        mp.setattr(reward, "_SUBS", [(Counted(p), r) for p, r in reward._SUBS])
        sys.settrace(trace)
        try:
            result = grade(Text(text))
        finally:
            sys.settrace(None)
    return result, count[0]


@pytest.mark.parametrize("hostile", [lambda k: "\\boxed{" * k, lambda k: "\\boxed{1} and " * k,
                                     lambda k: "\\boxed " * k, lambda k: "{" * 5 * k + "\\boxed{1}",
                                     lambda k: "\\boxed{1}\\boxed{2}" * k,
                                     lambda k: "\\boxed{1} and" + " " * 5 * k + "x \\boxed{2}"],
                         ids=["open", "joined", "unbraced", "braces", "adjacent", "spaces"])
def test_long_hostile_completions_cost_one_pass(hostile):
    """The graders' work on a long hostile completion (thousands of boxes, braces or spaces) grows in step
    with its length: one pass over the braces, not one per box. Counted (work_of) at k and 2k repeats in one
    run: twice the text costs at most 2.2 times the work (one rescan per box makes it about 4 times)."""
    reward._worker()  # score's check starts one: the same constant for both lengths
    costs = []
    for k in (400, 800):
        right, work = work_of(lambda t: score(t, "1, 2"), hostile(k))
        dapo, dapo_work = work_of(lambda t: dapo_score(t, "2"), hostile(k))
        assert right == -1.0 and dapo in (1.0, -1.0)
        costs.append(work + dapo_work)
    assert costs[1] <= 2.2 * costs[0], costs
    assert costs[1] <= 40 * len(hostile(800)), costs  # a few passes, each a few lines per character


def test_a_check_that_hangs_is_cut_at_its_deadline(monkeypatch):
    """A check sympy cannot finish in its timeout (0.5 s here): its one wait on the worker is bounded by the
    check's deadline and finds nothing to read, the check is refused, the worker that hangs is killed, and
    the next check gets a fresh one. The waits are recorded, not timed."""
    slow = "(x+1)^{400}(x+2)^{300}"
    is_equivalent("x+1", "x+1.5")  # warm the worker
    old = reward._local.worker.proc.pid
    waits, select = [], reward.select.select

    def recorded(read, write, error, timeout=None):
        ready = select(read, write, error, 0.0 if timeout is None else min(timeout, 0.5))  # never hangs here
        waits.append((timeout, ready[0]))
        return ready
    monkeypatch.setattr(reward, "select", type("Select", (), {"select": staticmethod(recorded)}))
    assert not is_equivalent(slow, "(x+2)^{400}(x+1)^{300}", timeout=0.5)
    assert len(waits) == 1 and waits[0][0] is not None and 0 <= waits[0][0] <= 0.5, waits
    assert waits[0][1] == []  # nothing to read: the wait ended at the deadline
    with pytest.raises(ProcessLookupError):
        os.kill(old, 0)  # killed and reaped
    assert is_equivalent("\\sqrt{8}", "2\\sqrt{2}")  # a fresh worker, and it works
    assert reward._local.worker.proc.pid != old


def test_a_check_starts_no_worker_after_its_deadline(monkeypatch):
    """After one part of a check times out, its other parts are refused at once: no worker is started for
    a check whose time is spent (a start takes seconds, and a list of 32 parts would take minutes)."""
    is_equivalent("x+1", "x+1.5")  # warm the worker
    starts, init = [], reward._Worker.__init__
    monkeypatch.setattr(reward._Worker, "__init__", lambda self: starts.append(1) or init(self))
    slow, slow2 = "(x+1)^{400}(x+2)^{300}", "(x+2)^{400}(x+1)^{300}"
    assert not is_equivalent(f"{slow}, {slow}", f"{slow2}, 1", timeout=0.5)
    assert starts == []


def _live_workers():
    import subprocess
    out = subprocess.run(["pgrep", "-f", "-P", str(os.getpid()), "reward._serve"], capture_output=True, text=True)
    return len(out.stdout.split())


def test_the_pool_shares_the_hosts_cores_among_the_local_ranks():
    """On a 224-thread node, torchrun's 8 ranks get 28 threads (and sympy processes) each, 224 in all,
    not 224 each; a rank alone gets every core."""
    code = "import os; os.cpu_count = lambda: 224; import reward; print(reward._pool()._max_workers)"
    for ranks, size in (("8", 28), ("", 224), ("1", 224)):
        env = {**os.environ, "LOCAL_WORLD_SIZE": ranks}
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.join(HERE, ".."),
                             capture_output=True, text=True, check=True).stdout
        assert int(out) == size, (ranks, out)


def test_workers_do_not_leak():
    for _ in range(5):  # each call needs sympy; the pool's threads, and so their workers, are reused
        assert reward.score_all(["\\boxed{x^2+2x+1}"] * 4, ["(x+1)^2"] * 4) == [1.0] * 4
    assert _live_workers() <= os.cpu_count() + 1  # + this thread's own
    threads = [threading.Thread(target=is_equivalent, args=("\\sqrt{8}", "2\\sqrt{2}")) for _ in range(6)]
    for t in threads:
        t.start()
        t.join()
    assert _live_workers() <= os.cpu_count() + 1  # a thread's worker ends with the thread


def test_checks_from_many_threads():
    results = [None] * 8

    def work(k):
        results[k] = all(is_equivalent(a, b) for a, b in EQUIVALENT[:20])
    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8


LATEX_BITS = ["\\frac", "\\sqrt", "{", "}", "(", ")", "[", "]", "^", "_", "x", "y", "1", "2", "9", "0", ".",
              ",", "=", "+", "-", "*", "/", "\\pi", "\\infty", "\\left(", "\\right)", "\\text{", "\\{", "\\}",
              "\\cdot", "\\times", "e", "i", "!", "|", "\\le", ">", " ", "\\begin{pmatrix}", "&", "\\\\",
              "\\end{pmatrix}", "\\boxed{", "\\sin", "\\log", "%", "$", "\\cup", "10^{", "e33", ";", "<", "\\neq",
              "\\approx", "\\sum_{k=", "\\begin{array}{cc}", "\\end{array}", "or", "Final Answer: ", "<|im_end|>"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(LATEX_BITS), max_size=30), st.lists(st.sampled_from(LATEX_BITS), max_size=12))
@example(list("x, y, x^2"), list("x^2, y, 2x"))  # several worker checks in one: each must keep one deadline
def test_fuzz_never_raises_and_waits_within_its_timeout(a, b):
    """Any input: a bool, and every wait on the worker is bounded by the check's one deadline (set once, after
    the worker's start-up: all its worker calls share it, and each wait is at most the 1 s timeout)."""
    a, b = "".join(a), "".join(b)
    deadlines, waits = [], []
    ask, select = reward._ask_worker, reward.select.select

    def recorded_ask(op, x, y, deadline):
        deadlines.append(deadline)
        return ask(op, x, y, deadline)

    def recorded_select(read, write, error, timeout=None):
        waits.append(timeout)
        return select(read, write, error, 0.0 if timeout is None else min(timeout, 1.0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reward, "_ask_worker", recorded_ask)
        mp.setattr(reward, "select", type("Select", (), {"select": staticmethod(recorded_select)}))
        assert isinstance(is_equivalent(a, b, timeout=1.0), bool)
    assert len(set(deadlines)) <= 1, deadlines
    assert all(w is not None and 0 <= w <= 1.0 for w in waits), waits
    assert score(a, b) in (1.0, -1.0)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_fuzz_arbitrary_text(a):
    assert isinstance(is_equivalent(a, "1", timeout=1.0), bool)
    assert isinstance(extract_boxed(a), (str, type(None))) and isinstance(extract_answer(a), (str, type(None)))
    assert dapo_score(a, "1") in (1.0, -1.0) and score(a, "1, 2") in (1.0, -1.0)


def test_worker_start_up_never_eats_a_checks_timeout(monkeypatch):
    """A fresh worker can take seconds to start on a busy machine: a right answer that needs sympy must
    still be judged right within a 1 s timeout when the start takes 2 s."""
    real_init = reward._Worker.__init__

    def slow_init(self):
        time.sleep(2.0)
        real_init(self)
    monkeypatch.setattr(reward._Worker, "__init__", slow_init)
    result = []
    thread = threading.Thread(target=lambda: result.append(is_equivalent("\\sqrt{8}", "2\\sqrt{2}", timeout=1.0)))
    thread.start()  # a new thread: no worker yet
    thread.join()
    assert result == [True]


BENCH = os.path.join(HERE, "..", "..", "shared", "data", "benchmarks")


@pytest.mark.skipif(not os.path.isdir(BENCH), reason="../shared/data/benchmarks is absent")
def test_the_corpus_built_from_the_benchmark_golds():
    """Every 4th gold of the six benchmarks, with its renderings (right) and near misses (wrong), as
    benchmarks/reward.py builds them for the README's agreement figure."""
    corpus = load_script("benchmarks/reward.py")
    golds = corpus.load_golds(BENCH)[::4]
    pairs = [(True, p, g) for _, g in golds for _, p in corpus.renderings(g)]
    pairs += [(False, p, g) for _, g in golds for _, p in corpus.near_misses(g)]
    assert len(pairs) > 2500
    assert [x for x in pairs if is_equivalent(x[1], x[2]) != x[0]] == []
