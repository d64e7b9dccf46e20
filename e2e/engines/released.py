"""Load parts of an engine's released code (the pinned `sglang` / `vllm` wheels, installed with --no-deps).

Why: the engines' request types, route tables, deserializers and receive logic are the contract the agent
must follow, and a field list copied by hand drifts (a copied fixture once left out the session routes).
Importing `sglang.srt.managers.io_struct` or `vllm.entrypoints...` pulls the whole serving stack (CUDA
kernels, model registries), so this module reads the installed source files instead:

* `load_file` executes one whole module file whose imports are light (e.g. `tensor_bucket.py`);
* `extract` executes only the named top-level definitions of a heavy file, verbatim, in a fresh module
  whose globals the caller provides (e.g. the request classes of `io_struct.py`);
* `routes` reads the (method, path) pairs a FastAPI app or router registers, from its decorators.

Nothing here is copied from the engines: every definition is executed from the installed wheel, so a
new release that renames a field or a route breaks the tests that use it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ALIAS_PREFIX = "weightsync_released"

#: The engine releases weightsync's adapters are written against.
PINNED = {"sglang": "0.5.23", "vllm": "0.33.0"}


class EngineCodeMissing(RuntimeError):
    """The pinned engine wheel is not installed (the README's test command installs it)."""


def installed_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError as exc:
        raise EngineCodeMissing(
            f"{dist} is not installed; `make setup` installs {dist}=={PINNED.get(dist, '?')} with --no-deps") from exc


def source_path(package: str, relpath: str) -> Path:
    """The installed file `relpath` of top-level package `package`, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EngineCodeMissing(f"package {package!r} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    if not path.is_file():
        raise EngineCodeMissing(f"{package} {installed_version(package)} has no {relpath}")
    return path


def _alias(package: str, relpath: str) -> str:
    return ".".join([ALIAS_PREFIX, package, *relpath.removesuffix(".py").split("/")])


def load_file(package: str, relpath: str) -> types.ModuleType:
    """Execute the whole file (its imports must be importable here) as a module of its own."""
    name = _alias(package, relpath)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, source_path(package, relpath))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def _def_name(node: ast.stmt) -> str | None:
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def extract(package: str, relpath: str, names: Iterable[str], namespace: Mapping[str, Any],
            *, module_suffix: str = "") -> types.ModuleType:
    """Execute only the top-level definitions `names` of the file, in file order, in a new module whose
    globals start as `namespace` (what those definitions refer to). The module is registered in
    sys.modules, so string annotations (`from __future__ import annotations`) resolve against it."""
    path = source_path(package, relpath)
    tree = ast.parse(path.read_text(), filename=str(path))
    wanted = set(names)
    body = [n for n in tree.body if _def_name(n) in wanted]
    found = {_def_name(n) for n in body}
    if missing := wanted - found:
        raise EngineCodeMissing(f"{package} {installed_version(package)}: {relpath} defines none of {sorted(missing)}")
    future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in tree.body)
    name = _alias(package, relpath) + (f"__{module_suffix}" if module_suffix else "__extract")
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    mod.__dict__.update({k: v for k, v in namespace.items() if not (k.startswith('__') and k.endswith('__'))})
    sys.modules[name] = mod
    flags = __import__("__future__").annotations.compiler_flag if future else 0
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec", flags=flags, dont_inherit=True)
    exec(code, mod.__dict__)
    return mod


def _const_str(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def routes(package: str, relpath: str, objects: Iterable[str] = ("app", "router")) -> set[tuple[str, str]]:
    """(METHOD, path) for every `@<obj>.get/.post/.put/.delete/.api_route(path, methods=[...])` decorator."""
    path = source_path(package, relpath)
    tree = ast.parse(path.read_text(), filename=str(path))
    objs = set(objects)
    out: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id in objs):
                continue
            route = _const_str(dec.args[0]) if dec.args else None
            if route is None:
                continue
            verb = dec.func.attr
            if verb == "api_route":
                methods = next((kw.value for kw in dec.keywords if kw.arg == "methods"), None)
                names = [_const_str(e) for e in methods.elts] if isinstance(methods, ast.List) else ["GET"]
                out.update((m.upper(), route) for m in names if m)
            elif verb in ("get", "post", "put", "delete", "patch"):
                out.add((verb.upper(), route))
    return out
