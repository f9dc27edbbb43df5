"""The docs: each implementation detail points at the line that holds its code; the README is short and
links every page."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[`([^`]+)`\]\(((?:\.\./)?(?:stapo|policy|rollout|eval|reward|problems|metrics|parallel)\.py)#L(\d+)\)")
PAGE = re.compile(r"\]\(((?!https?:|#)[^)\s]+)\)")  # a markdown link to a file of this repository


def test_every_implementation_detail_link_points_at_its_code():
    """docs/implementation.md quotes a line of code per detail and links to it; a moved line breaks the link."""
    page = os.path.join(ROOT, "docs", "implementation.md")
    links = LINK.findall(open(page).read())
    assert len(links) >= 25
    for code, path, line in links:
        lines = open(os.path.normpath(os.path.join(ROOT, "docs", path))).read().splitlines()
        assert code in lines[int(line) - 1], f"{path}#L{line} does not hold `{code}`: {lines[int(line) - 1]!r}"


def test_the_front_page_is_short_and_reaches_every_page():
    """The README stays a page a newcomer finishes (250 lines at most); every page in docs/ is linked from it,
    and every link of the README and of docs/ to a file of this repository resolves."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(readme.splitlines()) <= 250
    linked = {os.path.normpath(p.split("#")[0]) for p in PAGE.findall(readme)}
    for page in os.listdir(os.path.join(ROOT, "docs")):
        if page.endswith(".md"):
            assert os.path.join("docs", page) in linked, f"docs/{page} is not linked from the README"
    for doc in ["README.md"] + [os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs"))]:
        if doc.endswith(".md"):
            for target in PAGE.findall(open(os.path.join(ROOT, doc)).read()):
                path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target.split("#")[0]))
                assert os.path.exists(path), f"{doc} links to {target}, which does not exist"


def test_imports_run_one_way():
    """stapo -> eval -> rollout, problems, parallel, reward; policy -> head, parallel; metrics, checkpoint ->
    parallel; curves -> metrics. The engines, the problems, the process group and the checker import none of
    the project's modules: no circle."""
    import ast
    modules = {"stapo", "eval", "metrics", "rollout", "problems", "parallel", "reward", "curves", "head", "checkpoint",
               "policy"}
    allowed = {"stapo.py": modules - {"stapo", "curves"}, "eval.py": {"rollout", "problems", "parallel", "reward"},
               "metrics.py": {"parallel"}, "curves.py": {"metrics"}, "rollout.py": set(), "problems.py": set(),
               "parallel.py": set(), "reward.py": set(), "head.py": set(),
               "checkpoint.py": {"parallel"}, "policy.py": {"head", "parallel"}}
    for path, ok in allowed.items():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        ours = names & modules
        assert ours <= ok, (path, ours - ok)


MODULES = ["stapo.py", "policy.py", "rollout.py", "eval.py", "metrics.py", "problems.py", "parallel.py",
           "checkpoint.py", "head.py", "reward.py", "curves.py"]


def test_no_function_or_class_is_over_60_lines():
    """One idea per unit: a function or class of more than 60 lines is split (the checker's parser aside, a
    recursive-descent grammar that reads as one). A unit grown past the limit fails here."""
    import ast
    long = []
    for path in MODULES:
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        units = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        parser = [range(n.lineno, n.end_lineno + 1) for n in units if n.name == "_Parser"]
        for node in units:
            if node.end_lineno - node.lineno >= 60 and not any(node.lineno in lines for lines in parser):
                long.append(f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_every_flag_has_a_help_line():
    """`--help` tells a user what each flag does: every add_argument of the modules, the examples and the
    benchmarks carries help text (stapo.py's flags get theirs from FLAGS and SWITCHES)."""
    import ast
    import glob
    paths = MODULES + glob.glob(os.path.join(ROOT, "examples", "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    bare = []
    for path in paths:
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                if not any(k.arg == "help" for k in node.keywords):
                    bare.append(f"{os.path.relpath(os.path.join(ROOT, path), ROOT)}:{node.lineno}")
    assert bare == []
    import stapo
    assert all(text for flags in stapo.FLAGS.values() for _, _, text, *_ in flags)
    assert all(stapo.SWITCHES.values())
