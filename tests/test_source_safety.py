"""No code path in harness/ can run code from a file it reads: no pickle (or its relatives),
no eval/exec, no torch.load without weights_only=True. Checked on the syntax tree of every
source file (docstrings and comments cannot trip it), so it stays true as the code grows."""

import ast
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "harness"
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "shelve", "marshal", "cloudpickle", "joblib"}


def unsafe_uses(source: str, filename: str = "<snippet>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            keywords = {k.arg: k.value for k in node.keywords}
            if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                found.append(f"{where}: {func.id}()")
            elif isinstance(func, ast.Attribute) and func.attr == "load" and ast.unparse(func.value) == "torch":
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where}: torch.load without weights_only=True")
            elif isinstance(func, ast.Attribute) and func.attr == "read_pickle":
                found.append(f"{where}: read_pickle()")
            allow = keywords.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value is True:
                found.append(f"{where}: allow_pickle=True")
    return found


def test_harness_never_unpickles_or_evaluates_what_it_reads():
    files = sorted(HARNESS.rglob("*.py"))
    assert len(files) > 30  # the tree was found
    found = [use for path in files for use in unsafe_uses(path.read_text(), str(path.relative_to(HARNESS.parent)))]
    assert found == []


@pytest.mark.parametrize("snippet, safe", [
    ("import pickle", False),
    ("from dill import loads", False),
    ("x = eval('1')", False),
    ("exec(code)", False),
    ("import torch\nstate = torch.load(path)", False),
    ("import torch\nstate = torch.load(path, weights_only=False)", False),
    ("df = pd.read_pickle(p)", False),
    ("a = np.load(p, allow_pickle=True)", False),
    ("import torch\nstate = torch.load(path, weights_only=True)", True),
    ("model.eval()", True),
    ('"""pickle is never used; eval(x) neither"""', True),
], ids=lambda v: str(v)[:30])
def test_the_check_catches_each_unsafe_form(snippet, safe):
    assert (unsafe_uses(snippet) == []) == safe
