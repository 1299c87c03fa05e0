"""Nothing that arrives over the network or from a file is unpickled or evaluated.

Walks the syntax tree of every module of the project (controller, workers, proto converters,
deploy scripts, bench): no pickle/marshal/shelve/dill imports, no eval/exec/compile, no
yaml.load/unsafe_load/full_load without the safe loader, every np.load with
allow_pickle=False, every torch.load with weights_only=True. Ray pickles its own actor calls
inside the cluster (a trust boundary of its own, see docs/security.md); the project adds none.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOTS = ["controller/expertmesh", "workers/expertmesh", "proto/expertmesh/v1", "deploy", "bench"]
BANNED_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "jsonpickle",
}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}


def _sources(repo: Path) -> list[Path]:
    files = []
    for root in ROOTS:
        files += [p for p in (repo / root).rglob("*.py") if "_pb2" not in p.name]
    return sorted(files)


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def problems(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [
                f"import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES
            ]
        elif (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES
        ):
            out.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            owner = (
                f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            )
            if isinstance(f, ast.Name) and name in BANNED_CALLS:
                out.append(f"{name}() at line {node.lineno}")
            if owner == "yaml" and name in {"load", "load_all", "unsafe_load", "full_load"}:
                loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                safe = isinstance(loader, ast.Attribute) and loader.attr in {
                    "SafeLoader",
                    "CSafeLoader",
                }
                if not safe:
                    out.append(f"yaml.{name} without SafeLoader at line {node.lineno}")
            if (
                owner in {"np", "numpy"}
                and name == "load"
                and not _is_const(_kw(node, "allow_pickle"), False)
            ):
                out.append(f"np.load without allow_pickle=False at line {node.lineno}")
            if (
                owner == "torch"
                and name == "load"
                and not _is_const(_kw(node, "weights_only"), True)
            ):
                out.append(f"torch.load without weights_only=True at line {node.lineno}")
    return out


def test_the_checker_catches_what_it_should():
    bad = """
import pickle
from marshal import loads
import yaml, numpy as np, torch
eval("1"); exec("x = 1")
yaml.load(s)
yaml.load(s, Loader=yaml.Loader)
np.load(f)
np.load(f, allow_pickle=True)
torch.load(f)
"""
    good = """
import yaml, numpy as np, torch
yaml.safe_load(s); yaml.load(s, Loader=yaml.SafeLoader)
np.load(f, allow_pickle=False); torch.load(f, weights_only=True)
"""
    assert len(problems(ast.parse(bad))) == 9
    assert problems(ast.parse(good)) == []


@pytest.mark.parametrize("root", ROOTS)
def test_no_unpickling_or_eval_in_the_project(repo, root):
    files = [p for p in _sources(repo) if p.is_relative_to(repo / root)]
    assert files, root
    found = {
        str(p.relative_to(repo)): probs
        for p in files
        if (probs := problems(ast.parse(p.read_text(), filename=str(p))))
    }
    assert found == {}
