"""The part of vLLM that kvcompact depends on, read from a vLLM source tree or wheel without importing it, and
what changed between two releases: so that moving to a new vLLM starts from a reviewed diff.

    .venv/bin/python scripts/vllm_surface_diff.py NEW [--base OLD] [--json OUT]

NEW, OLD: a vLLM wheel (``.whl``) or a directory that holds the ``vllm`` package (an unpacked wheel, a
site-packages, a checkout); OLD defaults to the installed vLLM's sources. Lists, for each, what
:mod:`kvcompact.vllm.compat` checks at start-up, read statically:

- ``hooked``: the parameters of every method in the hook table (:data:`kvcompact.vllm.plugin.HOOKS`); the diff
  adds whatever keeps a hook from standing in for it (:func:`kvcompact.vllm.compat.signature_problems`);
- ``read``: the names kvcompact reads or calls (``compat.READ``), with a callable's parameters;
- ``stamped``: the names kvcompact sets on vLLM's objects (``compat.STAMPED``), which vLLM must not have;
- ``instance``: the attributes read on live objects (``compat.SCHEDULER_ATTRS`` ...), as far as the class of each
  step of the path is known (``unchecked`` past that); ``compat.LAYER_ATTRS`` are checked on the live layers
  only (vLLM sets them outside the class, or in each backend's own implementation);
- ``imports``: every ``from vllm... import name`` in kvcompact's sources.

Prints each entry that differs between OLD and NEW, and every hook problem in NEW; exits 1 if there is any.
``--json OUT`` writes NEW's surface: tests/data/vllm_surface_*.json are this output for the releases kvcompact
supports, and the hook tests bind against them.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import inspect
import json
import re
import sys
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvcompact.vllm import compat  # noqa: E402
from kvcompact.vllm.plugin import HOOKS  # noqa: E402

# The class of each object path the instance attributes walk through (what vLLM annotates them as).
OBJECT_TYPES = {
    "scheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
    "scheduler.kv_cache_manager": ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
    "scheduler.kv_cache_manager.coordinator": ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator"),
    "scheduler.kv_cache_manager.block_pool": ("vllm.v1.core.block_pool", "BlockPool"),
    "manager": ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager"),
    "runner": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    "runner.input_batch": ("vllm.v1.worker.gpu_input_batch", "InputBatch"),
    "runner.compilation_config": ("vllm.config.compilation", "CompilationConfig"),
    "runner.kv_cache_config": ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    "runner.drafter": ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer"),
    "runner_v2": ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    "runner_v2.req_states": ("vllm.v1.worker.gpu.states", "RequestState"),
    "runner_v2.block_tables": ("vllm.v1.worker.gpu.block_table", "BlockTables"),
    "runner_v2.kv_cache_config": ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    "runner_v2.compilation_config": ("vllm.config.compilation", "CompilationConfig"),
}


class Tree:
    """A vLLM package's Python sources, from a directory or a wheel."""

    def __init__(self, where: str) -> None:
        path = Path(where).expanduser()
        self.zip = zipfile.ZipFile(path) if path.suffix == ".whl" else None
        self.root = path
        if self.zip is None and not (path / "vllm").is_dir():
            raise SystemExit(f"{where}: neither a wheel nor a directory holding the vllm package")

    def source(self, module: str) -> str | None:
        rel = module.replace(".", "/")
        for name in (f"{rel}.py", f"{rel}/__init__.py"):
            if self.zip is not None:
                if name in self.zip.namelist():
                    return self.zip.read(name).decode()
            elif (self.root / name).is_file():
                return (self.root / name).read_text()
        return None

    def is_package(self, module: str) -> bool:
        rel = module.replace(".", "/") + "/__init__.py"
        return rel in self.zip.namelist() if self.zip is not None else (self.root / rel).is_file()

    def version(self) -> str:
        text = self.source("vllm._version") or ""
        found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", text)
        return found.group(1) if found else "unknown"

    @cache  # noqa: B019 - one tree per run
    def parse(self, module: str) -> ast.Module | None:
        text = self.source(module)
        return None if text is None else ast.parse(text)


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements, those inside top-level if / try blocks included (guarded imports)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If | ast.Try):
            out += _top_level(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                out += _top_level(handler.body)
        else:
            out.append(node)
    return out


def _import_source(tree: Tree, module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    package = parts if tree.is_package(module) else parts[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def find_name(tree: Tree, module: str, name: str, depth: int = 0) -> tuple[str, ast.stmt | None] | None:
    """Where ``module.name`` is defined: (module, its def / class / assignment node; None for a submodule or a name
    imported from outside vLLM), following re-exports. None: not there."""
    parsed = tree.parse(module)
    if parsed is not None:
        for node in _top_level(parsed.body):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, node
            if isinstance(node, ast.ImportFrom):
                source = _import_source(tree, module, node)
                if node.names[0].name == "*" and source.startswith("vllm") and depth <= 8:
                    found = find_name(tree, source, name, depth + 1)
                    if found is not None:
                        return found
                    continue
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        if not source.startswith("vllm") or depth > 8:
                            return source, None
                        return find_name(tree, source, alias.name, depth + 1)
    if tree.source(f"{module}.{name}") is not None:
        return f"{module}.{name}", None
    return None


def _members(tree: Tree, module: str, cls: str, depth: int = 0) -> list[tuple[str, ast.ClassDef]]:
    """The class and its bases defined in vLLM (nearest first)."""
    found = find_name(tree, module, cls)
    if found is None or not isinstance(found[1], ast.ClassDef) or depth > 8:
        return []
    where, node = found
    out = [(where, node)]
    for base in node.bases:
        while isinstance(base, ast.Subscript):
            base = base.value
        if isinstance(base, ast.Name):
            out += _members(tree, where, base.id, depth + 1)
    return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The parameter list as Python writes it, without annotations; a default that is not a constant is shown as
    ``...``."""
    a = copy.deepcopy(fn.args)
    for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
        if arg is not None:
            arg.annotation = None
    a.defaults = [d if isinstance(d, ast.Constant) else ast.Constant(...) for d in a.defaults]
    a.kw_defaults = [d if d is None or isinstance(d, ast.Constant) else ast.Constant(...) for d in a.kw_defaults]
    return f"({ast.unparse(a)})"


def member(tree: Tree, module: str, cls: str | None, name: str) -> Any:
    """A function's or method's parameters (``"(self, request)"``), ``"attribute"`` for anything else, None when
    missing."""
    if cls is None:
        found = find_name(tree, module, name)
        if found is None:
            return None
        node = found[1]
        return _params(node) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else "attribute"
    for _, node in _members(tree, module, cls):
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                return _params(item)
            targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(
                item, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return "attribute"
    return None


def self_attribute(tree: Tree, module: str, cls: str, name: str) -> bool:
    """Whether the class (or a base) has ``name`` as a member or assigns ``self.name`` in any method."""
    if member(tree, module, cls, name) is not None:
        return True
    for _, node in _members(tree, module, cls):
        for item in ast.walk(node):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(
                item, ast.AnnAssign | ast.AugAssign) else []
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]  # (self.a, b) = ...
            if any(isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                   and t.value.id == "self" for t in targets):
                return True
    return False


def instance_path(tree: Tree, owner: str, path: str) -> str:
    """``present`` / ``missing`` / ``unchecked`` (the class of a step of the path is not known) for an attribute
    path read on a live object."""
    prefix = owner
    for part in path.split("."):
        if prefix not in OBJECT_TYPES:
            return "unchecked"
        if not self_attribute(tree, *OBJECT_TYPES[prefix], part):
            return "missing"
        prefix = f"{prefix}.{part}"
    return "present"


def vllm_imports() -> list[tuple[str, str]]:
    """Every ``from vllm... import name`` in kvcompact's package."""
    out = set()
    for path in (ROOT / "src" / "kvcompact").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                out.update((node.module, alias.name) for alias in node.names)
    return sorted(out)


def surface(tree: Tree) -> dict[str, Any]:
    """Everything kvcompact depends on in one vLLM tree, as the module docstring lists it."""
    hooked = {f"{row.module}.{row.cls}.{row.method}": member(tree, row.module, row.cls, row.method) for row in HOOKS}
    read = {}
    for module, cls, names in compat.READ:
        for name in names:
            read[".".join(p for p in (module, cls, name) if p)] = member(tree, module, cls, name)
    stamped = {f"{module}.{cls}.{name}": member(tree, module, cls, name) is not None
               for module, cls, names in compat.STAMPED for name in names}
    instance = {f"{owner}.{p}": instance_path(tree, owner, p)
                for owner, paths in (("scheduler", compat.SCHEDULER_ATTRS), ("manager", compat.MANAGER_ATTRS),
                                     ("runner", compat.RUNNER_ATTRS), ("runner", compat.DRAFTER_ATTRS),
                                     ("runner_v2", compat.RUNNER_V2_ATTRS))
                for p in paths}
    imports = {f"{module}.{name}": find_name(tree, module, name) is not None for module, name in vllm_imports()}
    return {"vllm": tree.version(), "hooked": hooked, "read": read, "stamped": stamped, "instance": instance,
            "imports": imports}


def signature(params: str) -> inspect.Signature:
    """The ``inspect.Signature`` of a recorded parameter list (``...``: a default that is not a constant)."""
    tree = ast.parse(f"def f{params}: pass")
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    args = [x for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None]
    defaults = [d for d in (*a.defaults, *a.kw_defaults) if d is not None]
    if len(tree.body) != 1 or any(x.annotation for x in args) or any(not isinstance(d, ast.Constant) for d in defaults):
        raise ValueError(f"not a recorded parameter list: {params!r}")
    namespace: dict[str, Any] = {}
    exec(compile(tree, "<recorded>", "exec"), namespace)  # a parameter list with constant defaults, nothing else
    return inspect.signature(namespace["f"])


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    lines = []
    for section in ("hooked", "read", "stamped", "instance", "imports"):
        for key in sorted(set(old[section]) | set(new[section])):
            a, b = old[section].get(key), new[section].get(key)
            if a != b:
                lines.append(f"{section}  {key}\n    {old['vllm']}: {a}\n    {new['vllm']}: {b}")
    return lines + [f"hook    {problem} (vLLM {new['vllm']})" for problem in hook_problems(new)]


def hook_problems(recorded: dict[str, Any]) -> list[str]:
    """What :func:`kvcompact.vllm.compat.hooked_signatures` finds wrong with the hooks against a recorded surface."""
    def signature_of(row: Any) -> inspect.Signature | None:
        params = recorded["hooked"].get(f"{row.module}.{row.cls}.{row.method}")
        return None if params is None else signature(params)

    return compat.hooked_signatures(HOOKS, signature_of)


def installed_tree() -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("no vLLM installed: pass --base")
    return str(Path(spec.origin).parents[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("new", help="vLLM wheel or directory holding the vllm package")
    parser.add_argument("--base", help="the same for the release to compare with (default: the installed vLLM)")
    parser.add_argument("--json", help="write NEW's surface to this file")
    args = parser.parse_args()
    new = surface(Tree(args.new))
    old = surface(Tree(args.base or installed_tree()))
    if args.json:
        Path(args.json).write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    lines = diff(old, new)
    print("\n".join(lines) if lines else f"no difference between vLLM {old['vllm']} and {new['vllm']}")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
