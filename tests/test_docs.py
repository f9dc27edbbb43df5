"""The README's implementation-details links point at the lines that hold the code they name."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[`([^`]+)`\]\(((?:stapo|rollout|eval|reward)\.py)#L(\d+)\)")


def test_every_implementation_detail_link_points_at_its_code():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Implementation details"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    links = LINK.findall(section)
    assert len(links) >= 15
    for code, path, line in links:
        lines = open(os.path.join(ROOT, path)).read().splitlines()
        assert code in lines[int(line) - 1], f"{path}#L{line} does not hold `{code}`: {lines[int(line) - 1]!r}"


def test_imports_run_one_way():
    """stapo -> eval -> rollout, reward; the engines and the checker never import the trainer (or eval)."""
    import ast
    allowed = {"stapo.py": {"rollout", "reward", "eval"}, "eval.py": {"rollout", "reward"},
               "rollout.py": set(), "reward.py": set()}
    for path, ok in allowed.items():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        ours = names & {"stapo", "rollout", "reward", "eval"}
        assert ours <= ok, (path, ours - ok)
