"""The docs: each implementation detail points at the line that holds its code; the README is short and
links every page."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[`([^`]+)`\]\(((?:\.\./)?[a-z_]+\.py)#L(\d+)\)")
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


# The project's modules; the programs are what a user runs (a library module never imports one).
MODULES = ["stapo_core.py", "stapo.py", "policy.py", "head.py", "analysis.py", "rollout.py", "evaluation.py", "eval.py",
           "metrics.py", "problems.py", "parallel.py", "checkpoint.py", "reward.py", "curves.py"]
PROGRAMS = {"stapo", "eval", "curves"}


def project_imports():
    """{module: the project's modules it imports}, read from the code."""
    import ast
    names = {m[:-3] for m in MODULES}
    graph = {}
    for path in MODULES:
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        found = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        found |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        graph[path[:-3]] = found & names
    return graph


def readme_import_map():
    """{module: what the README's import map says it imports}: the block after "Imports run one way"."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("Imports run one way")[1].split("```")[1]
    graph = {}
    for line in block.strip().splitlines():
        left, right = (side.strip() for side in line.split("->"))
        targets = set() if right == "none of the project's modules" else {t.strip() for t in right.split(",")}
        for module in left.split(","):
            graph[module.strip()] = targets
    return graph


def test_imports_run_one_way_and_the_readme_map_is_true():
    """The rules: stapo_core and head import none of the project's modules (each is copyable alone); no library
    module imports a program (stapo, eval, curves); no module imports stapo (only the examples, benchmarks and
    tests do); there is no circle. And the README's import map is the code's, arrow for arrow."""
    graph = project_imports()
    assert graph["stapo_core"] == set() and graph["head"] == set()
    for module, imported in graph.items():
        if module not in PROGRAMS:
            assert not imported & PROGRAMS, (module, imported & PROGRAMS)
        assert "stapo" not in imported, module
    done = set()
    while len(done) < len(graph):  # peel off the modules whose imports are all peeled: a circle never peels
        ready = {m for m in graph if m not in done and graph[m] <= done}
        assert ready, f"an import circle among {sorted(set(graph) - done)}"
        done |= ready
    assert readme_import_map() == graph


def loaded_by(statement, before="import torch"):
    """The top-level modules that `statement` loads in a fresh interpreter after `before`."""
    import subprocess
    import sys
    code = (f"import sys; {before}; old = set(sys.modules); {statement}; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - old}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(eval(out))


def test_stapo_core_loads_nothing_but_torch_and_the_standard_library():
    """`import stapo_core` in a fresh interpreter: after torch, it loads itself and nothing else (no module of
    the project, no transformers, no datasets); with torch, nothing outside torch's own imports and the
    standard library. Breaks the day stapo_core imports a sibling for convenience."""
    import sys
    assert loaded_by("import stapo_core") == {"stapo_core"}
    with_torch = loaded_by("import stapo_core", before="pass")
    outside = with_torch - set(sys.stdlib_module_names) - loaded_by("import torch", before="pass")
    assert outside == {"stapo_core"}, outside
    assert not with_torch & ({m[:-3] for m in MODULES if m != "stapo_core.py"} | {"transformers", "datasets"})


def test_importing_a_module_starts_no_thread_pool_or_exit_hook():
    """Importing the project's modules, one after another in one interpreter, starts no thread (a pool's
    threads, a watcher) and registers no atexit hook: the checker's pool and its hook start on first use.
    Counted after importing the libraries the modules use, so only the project's own imports are measured."""
    import subprocess
    import sys
    code = ("import atexit, threading, torch, datasets, sympy, tqdm; from transformers import AutoModelForCausalLM; "
            "n, hooks = threading.active_count(), atexit._ncallbacks()\n"
            f"for m in {[m[:-3] for m in MODULES]}:\n"
            "    __import__(m); print(m, threading.active_count() - n, atexit._ncallbacks() - hooks)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = [line.split() for line in r.stdout.splitlines()]
    assert len(counts) == len(MODULES) and all(c[1:] == ["0", "0"] for c in counts), counts


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


def flag_rows(path, heading, column):
    """The first table under `heading` in a markdown page: {the flags its `column` names: the row}."""
    lines = open(os.path.join(ROOT, path)).read().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i in range(start, len(lines) + 1) if i == len(lines) or not lines[i].startswith("|"))
    rows = [row.replace("\\|", "/") for row in lines[start + 2:end]]  # a cell's escaped | is no column
    return {tuple(re.findall(r"--[a-z][a-z0-9-]*", row.split("|")[column + 1])): row for row in rows}


def whose(help_text):
    """A FLAGS help line's owner: the first of (paper, (JustRL, (ours in it; None when it names none."""
    found = re.search(r"\((paper|JustRL|ours)\b", help_text)
    return found and found.group(1)


def test_the_settings_tables_say_what_flags_says():
    """One source for the flags: every flag of stapo.py appears in the README's settings table (the paper's
    settings) or docs/training.md's (the rest); each row's value shows the flag's default from FLAGS, and the
    README's "whose" column names the owner its help line names. Breaks when a default changes in one place."""
    import stapo
    defaults = {"--" + key.replace("_", "-"): (default, text) for group in stapo.FLAGS.values()
                for key, default, text, *_ in group}
    switches = set(stapo.SWITCHES) | {"--no-chat-template"}
    readme = flag_rows("README.md", "## The paper's settings", column=2)
    training = flag_rows("docs/training.md", "## Flags beyond the paper's settings", column=0)
    named = {f for table in (readme, training) for flags in table for f in flags}
    assert named - set(defaults) - switches == set()  # no row names a flag the trainer lacks
    assert set(defaults) | switches <= named, sorted((set(defaults) | switches) - named)
    first = {"--" + key.replace("_", "-") for key, *_ in next(iter(stapo.FLAGS.values()))}
    assert first <= {f for flags in readme for f in flags}  # the paper's settings are the README's
    for table in (readme, training):
        for flags, row in table.items():
            cells = [c.strip() for c in row.strip("|").split("|")]
            numbers = {float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", row.replace("1e-6", "1e-06"))}
            for f in [f for f in flags if f in defaults]:
                default, text = defaults[f]
                if isinstance(default, bool) or default == "":
                    continue
                shown = float(default) in numbers if isinstance(default, (int, float)) else default.lower() in row.lower()
                assert shown, (f, default, row)
                if table is readme and whose(text):
                    assert cells[-1].split()[0] == whose(text), (f, cells[-1], whose(text))
