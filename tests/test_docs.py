"""The docs: each implementation detail quotes a line of code that is in the file it links to; every name
`module.name` that the docs, docstrings and help texts write is one its module defines; the README links every
page."""
import ast
import glob
import inspect
import io
import os
import re
import subprocess
import sys
import tokenize

import pytest

pytestmark = pytest.mark.docs  # the docs against the code: pytest -m "not docs" leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[`([^`]+)`\]\(((?:\.\./)?[a-z_]+\.py)\)")  # [`a line of code`](../file.py)
PAGE = re.compile(r"\]\(((?!https?:|#)[^)\s]+)\)")  # a markdown link to a file of this repository
# The project's modules: every .py at the top. The programs are what a user runs; a library never imports one.
MODULES = sorted(p for p in os.listdir(ROOT) if p.endswith(".py"))
PROGRAMS = {"stapo", "eval", "curves"}


def test_every_implementation_detail_quotes_a_line_of_its_file():
    """docs/implementation.md quotes a line of code per detail and links to its file: the quote is one whole
    line of that file, indentation aside, and no other line of the file reads the same, so a search finds it.
    A line that changes breaks its quote here; a line that only moves keeps it (no line numbers)."""
    text = open(os.path.join(ROOT, "docs", "implementation.md")).read()
    links = LINK.findall(text)
    assert len(links) >= 25 and len(links) == text.count("](../"), "a detail links other than by a quote"
    wrong = []
    for code, path in links:
        lines = [line.strip() for line in open(os.path.join(ROOT, "docs", path)).read().splitlines()]
        if lines.count(code) != 1:
            wrong.append(f"{path[3:]} has {lines.count(code)} lines that read `{code}`")
    assert not wrong, "\n".join(wrong)


def api_table():
    """The README's API table: (module, name, its parameters as written: [(name, default or no default)])."""
    import stapo_core
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("| function | what it returns |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("| `"):
            break
        signature = line.split("`")[1]
        module, _, name = signature.split("(")[0].rpartition(".")
        tree = ast.parse(f"def {signature.split('.', 1)[-1] if module else signature}: pass").body[0].args
        defaults = [None] * (len(tree.args) - len(tree.defaults)) + [ast.literal_eval(d) for d in tree.defaults]
        has = [False] * (len(tree.args) - len(tree.defaults)) + [True] * len(tree.defaults)
        rows.append((module or stapo_core.__name__, name,
                     [(a.arg, d if h else inspect.Parameter.empty) for a, d, h in zip(tree.args, defaults, has)]))
    return rows


def test_the_readme_api_table_is_the_codes_signatures():
    """Every row of the README's API table gives its function's parameters, in order, with the defaults the
    code has: a changed default, a renamed, dropped or reordered parameter fails here (the drift test above
    resolves names only): e.g. a default of None in the README where the code has 128."""
    import importlib
    rows = api_table()
    assert len(rows) >= 7 and {n for _, n, _ in rows} >= {"stapo_loss", "s2t_mask", "token_logprobs_and_entropy"}
    for module, name, written in rows:
        function = getattr(importlib.import_module(module), name)
        actual = [(p.name, p.default) for p in inspect.signature(function).parameters.values()]
        assert written == actual, f"README: {module}.{name}{written}; code: {actual}"


DIFF = re.compile(r"```diff ([a-z_]+\.py)\n(.*?)```", re.S)


def test_the_ladders_diffs_are_lines_of_the_code_that_runs():
    """docs/ladder.md climbs from GRPO to STAPO in diffs of the code: every line of each diff, its +, - or space
    aside, is one whole line of the file the diff names, and no other line of it reads the same (as
    docs/implementation.md's quotes). A changed line of token_scales, clip_settings or S2T breaks its rung."""
    text = open(os.path.join(ROOT, "docs", "ladder.md")).read()
    blocks = DIFF.findall(text)
    assert len(blocks) >= 4 and {path for path, _ in blocks} == {"stapo.py", "stapo_core.py"}
    wrong = []
    for path, body in blocks:
        lines = [line.strip() for line in open(os.path.join(ROOT, path)).read().splitlines()]
        for line in body.splitlines():
            assert line[:1] in "+- ", f"ladder.md: a diff line of {path} starts with none of + - space: {line}"
            if lines.count(line[1:].strip()) != 1:
                wrong.append(f"{path} has {lines.count(line[1:].strip())} lines that read `{line[1:].strip()}`")
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_each_rung_of_the_ladder_runs_and_prints_what_the_page_shows(tmp_path, capsys):
    """Each rung's command (`python examples/toy.py --method M ...` in docs/ladder.md) runs as written, here
    shortened (2 RL steps after a 5-step warm start: the page's runs are the toy's full ones), and ends as the
    page shows it ending: the S2T summary, then the accuracy line."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import toy
    text = open(os.path.join(ROOT, "docs", "ladder.md")).read()
    commands = re.findall(r"^python examples/toy\.py (.*?)(?:\s+#.*)?$", text, re.M)
    assert [c.split()[1] for c in commands] == ["grpo", "justrl", "stapo"]
    for command in commands:
        argv = command.split()
        argv[argv.index("--out") + 1] = str(tmp_path / argv[1])
        toy.main(argv + ["--steps", "2", "--sft-steps", "5", "--no-figure"])
        printed = capsys.readouterr().out.splitlines()
        assert printed[-1].startswith("toy: accuracy ") and any(x.startswith("S2T") for x in printed)


def test_the_ladders_printed_outputs_are_its_committed_runs(tmp_path):
    """Each rung's output on docs/ladder.md is the end of its full run's log, as committed in
    docs/toy_runs/ladder.tar.xz (the S2T summary to the accuracy line, the progress bars left out)."""
    import tarfile
    with tarfile.open(os.path.join(ROOT, "docs", "toy_runs", "ladder.tar.xz")) as archive:
        archive.extractall(tmp_path, filter="data")
    text = open(os.path.join(ROOT, "docs", "ladder.md")).read()
    shown = re.findall(r"```\n(S2T.*?)\n```", text, re.S)
    assert len(shown) == 3
    for method, block in zip(("grpo", "justrl", "stapo"), shown):
        log = open(tmp_path / f"ladder_{method}.log").read().splitlines()
        ending = [line for line in log if line.startswith(("S2T", "  step", "the run's curves", "held-out", "toy: "))]
        assert block.splitlines() == ending, method


def test_the_readme_reaches_every_page():
    """Every page in docs/ is linked from the README, and every link of the README and of docs/ to a file of
    this repository resolves, none of them to a line number of the project's code."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    linked = {os.path.normpath(p.split("#")[0]) for p in PAGE.findall(readme)}
    pages = [os.path.join("docs", p) for p in sorted(os.listdir(os.path.join(ROOT, "docs")))
             if p.endswith(".md")]
    for page in pages:
        assert page in linked, f"{page} is not linked from the README"
    for doc in ["README.md"] + pages:
        for target in PAGE.findall(open(os.path.join(ROOT, doc)).read()):
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target.split("#")[0]))
            assert os.path.exists(path), f"{doc} links to {target}, which does not exist"
            assert not re.search(r"\.py#L\d", target), f"{doc} links to a line number: {target}"


def test_every_readme_results_figure_is_in_the_log_it_links():
    """The README's results table: each row links the log (or logs) its script wrote in benchmarks/results/,
    and every number the row writes outside its first cell (its figures, their statistic) is in one of those
    logs as printed (thousands' commas aside). Breaks when a figure is edited by hand, re-measured without
    committing its log, or links a log that does not hold it."""
    table = [line for line in open(os.path.join(ROOT, "README.md")).read().split("## Results")[1]
             .split("\n## ")[0].splitlines() if line.startswith("|")][2:]
    assert len(table) >= 4
    for row in table:
        logs = [t for t in PAGE.findall(row) if t.startswith("benchmarks/results/")]
        assert logs, f"a results row links no log: {row}"
        text = "".join(open(os.path.join(ROOT, t)).read() for t in logs).replace(",", "")
        figures = re.sub(r"\[[^\]]*\]\([^)]*\)", "", "|".join(row.split("|")[2:]))  # links' own text aside
        missing = [n for n in re.findall(r"\d+(?:[.,]\d+)*", figures) if n.replace(",", "") not in text]
        assert not missing, f"{missing} of this row are in none of {logs}: {row}"


# ---- no drift: every `module.name` written for a reader is a name that module defines --------------------

# The modules a text may name: the top-level ones, the examples, and the tests' reference runs.
NAMED = {**{p[:-3]: os.path.join(ROOT, p) for p in MODULES},
         **{os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(ROOT, "examples", "*.py"))},
         "reference": os.path.join(ROOT, "tests", "reference.py")}
# module.name, module.Class.name: not a file's name (stapo.py), not the tail of a longer dotted name
REFERENCE = re.compile(r"(?<![\w.-])(%s)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)" % "|".join(NAMED))
FILE_TYPES = {"py", "md", "json", "jsonl", "txt", "png", "sh", "yaml", "ini", "parquet", "safetensors"}


def defined(body):
    """{name: its def or class node, or None}: what a module's (or a class's) body defines, read in its code.
    An import is no definition: `stapo.dist` works only through the trainer's imports."""
    names = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({n.id: None for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # a definition under a guard
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            names.update(defined(sum(blocks + [h.body for h in getattr(node, "handlers", [])], [])))
    return names


def resolves(module, chain, trees={}):
    """Whether module's code defines the dotted chain: a top-level name, then a class's methods, class
    attributes and the `self.x` its methods set. Past a function or a value nothing more is checked, nor what
    a class may inherit from its bases (ChunkedHead.apply is torch's)."""
    if module not in trees:
        trees[module] = ast.parse(open(NAMED[module]).read())
    scope, inherits = defined(trees[module].body), False
    for name in chain.split("."):
        if name not in scope and not name.startswith("__"):
            return inherits
        node = scope.get(name)
        if not isinstance(node, ast.ClassDef):
            return True
        scope, inherits = defined(node.body), bool(node.bases)
        scope.update({n.attr: None for n in ast.walk(node) if isinstance(n, ast.Attribute)
                      and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", None) == "self"})
    return True


def prose():
    """(file, line, text) of what is written for a reader: README.md and docs/*.md line by line (but the
    quotes of docs/implementation.md: code, checked against their files above), and the docstrings, help
    texts, messages and comments of the modules, the examples and the benchmarks."""
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    for doc in ["README.md"] + docs:
        for n, line in enumerate(open(os.path.join(ROOT, doc)).read().splitlines(), 1):
            yield doc, n, LINK.sub("", line)
    for path in sorted(set(NAMED.values()) | set(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))):
        source, where = open(path).read(), os.path.relpath(path, ROOT)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield where, node.lineno, node.value
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                yield where, token.start[0], token.string


def stale_names(texts):
    """file:line module.name of each name in texts [(file, line, text)] that its module does not define."""
    found = [(f"{path}:{line + text[:m.start()].count(chr(10))}", m.groups())
             for path, line, text in texts for m in REFERENCE.finditer(text)]
    return [f"{where} {module}.{chain}" for where, (module, chain) in found
            if chain.split(".")[0] not in FILE_TYPES and not resolves(module, chain)]


def test_every_module_name_in_the_docs_and_docstrings_is_defined_there():
    """No drift: each `module.name` (or `module.Class.name`) that the README, docs/, a docstring, a help text,
    a message or a comment writes is defined by that module's code, not reached through its imports. A rename
    that leaves the old name in prose fails here, at the file and line that still writes it."""
    texts = list(prose())
    assert sum(len(REFERENCE.findall(text)) for _, _, text in texts) >= 30  # the scan does see the names
    stale = stale_names(texts)
    assert not stale, "\n".join(stale)
    planted = [("here", 7, "stapo.train_step, stapo.measure_twice\nand rollout.VLLMEngine.shut")]
    assert stale_names(planted) == ["here:7 stapo.measure_twice", "here:8 rollout.VLLMEngine.shut"]


def test_benchmarks_and_examples_take_each_name_from_the_module_that_defines_it():
    """The benchmarks and the examples use the project as a library: each `module.name` they read is defined
    by that module (`stapo.dist`, `stapo.build_policy` work only through the trainer's imports). A patch of
    the name a module uses (`policy.ChunkedHead = fake`) is a store, and allowed."""
    wrong = []
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                       + glob.glob(os.path.join(ROOT, "examples", "*.py"))):
        tree = ast.parse(open(path).read())
        alias = {a.asname or a.name: a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for a in n.names if a.name in NAMED}
        reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                 and isinstance(n.value, ast.Name) and n.value.id in alias]
        wrong += [f"{os.path.relpath(path, ROOT)}:{n.lineno} {n.value.id}.{n.attr}" for n in reads
                  if not resolves(alias[n.value.id], n.attr)]
    assert not wrong, "\n".join(wrong)


def project_imports():
    """{module: the project's modules it imports}, read from the code."""
    names = {m[:-3] for m in MODULES}
    graph = {}
    for path in MODULES:
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        found = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        found |= {n.module.split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module}
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
    """The rules: stapo_core and head import none of the project's modules (each is copyable alone); no
    library module imports a program (stapo, eval, curves); no module imports stapo (only the examples,
    benchmarks and tests do); there is no circle. And the README's import map is the code's, arrow for
    arrow."""
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
    code = (f"import sys; {before}; old = set(sys.modules); {statement}; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - old}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return set(eval(out))


def test_stapo_core_loads_nothing_but_torch_and_the_standard_library():
    """`import stapo_core` in a fresh interpreter: after torch, it loads itself and nothing else (no module of
    the project, no transformers, no datasets); with torch, nothing outside torch's own imports and the
    standard library. Breaks the day stapo_core imports a sibling for convenience."""
    assert loaded_by("import stapo_core") == {"stapo_core"}
    with_torch = loaded_by("import stapo_core", before="pass")
    outside = with_torch - set(sys.stdlib_module_names) - loaded_by("import torch", before="pass")
    assert outside == {"stapo_core"}, outside
    assert not with_torch & ({m[:-3] for m in MODULES if m != "stapo_core.py"} | {"transformers", "datasets"})


def test_importing_a_module_starts_no_thread_pool_or_exit_hook():
    """Importing the project's modules, one after another in one interpreter, starts no thread (a pool's
    threads, a watcher) and registers no atexit hook: the checker's pool and its hook start on first use.
    Counted after importing the libraries the modules use, so only the project's own imports are measured."""
    code = ("import atexit, threading, torch, datasets, sympy, tqdm; "
            "from transformers import AutoModelForCausalLM; "
            "n, hooks = threading.active_count(), atexit._ncallbacks()\n"
            f"for m in {[m[:-3] for m in MODULES]}:\n"
            "    __import__(m); print(m, threading.active_count() - n, atexit._ncallbacks() - hooks)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = [line.split() for line in r.stdout.splitlines()]
    assert len(counts) == len(MODULES) and all(c[1:] == ["0", "0"] for c in counts), counts


def test_every_flag_has_a_help_line():
    """`--help` tells a user what each flag does: every add_argument of the modules, the examples and the
    benchmarks carries help text (stapo.py's flags get theirs from FLAGS and SWITCHES)."""
    paths = MODULES + glob.glob(os.path.join(ROOT, "examples", "*.py")) \
        + glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
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
    README's "whose" column names the owner its help line names. Breaks when a default changes in one
    place."""
    import stapo
    defaults = {"--" + key.replace("_", "-"): (default, text) for group in stapo.FLAGS.values()
                for key, default, text, *_ in group}
    switches = set(stapo.SWITCHES) | {"--no-chat-template", "--no-checkpointing"}
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
            written = row.replace("1e-6", "1e-06")
            numbers = {float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", written)}
            for f in [f for f in flags if f in defaults]:
                default, text = defaults[f]
                if isinstance(default, bool) or default == "":
                    continue
                if isinstance(default, (int, float)):
                    shown = float(default) in numbers
                else:
                    shown = default.lower() in row.lower()
                assert shown, (f, default, row)
                if table is readme and whose(text):
                    assert cells[-1].split()[0] == whose(text), (f, cells[-1], whose(text))
