"""The layering of the source tree, read from the code (``ast``), one case per file and rule:

* ``kernels/`` (installed as ``fusedpar.kernels``): Triton kernels and their host launchers. No
  import of ``fusedpar.ops`` / ``fusedpar.nn`` / the model layer / ``benchmarks``, no
  ``torch.distributed``, no ``torch.autograd.Function`` subclass.
* ``fusedpar/ops/``: the ``torch.library`` custom ops (no ``torch.autograd.Function`` subclass
  anywhere: every differentiable op registers its backward; the one exception, the eager path of
  ``common.call_op``, is made from that registration and never traced), the transports, the
  schedules. No import of
  ``fusedpar.nn``, the model layer (``parallel``, ``checkpoint``, ``demo``) or ``benchmarks``.
* ``fusedpar/nn/``: modules only. No autograd Function subclass, no direct ``torch.distributed``
  (collectives go through ``fusedpar.ops``), no import of the model layer or ``benchmarks``.
* everywhere (``kernels/``, ``fusedpar/``, ``benchmarks/``): no private name (one leading
  underscore, not a dunder) of another project module, neither ``from x import _y`` nor
  ``x._y`` on an imported project module, and no private module from outside its package;
  no ``torch.ops.fusedpar`` attribute (code calls the custom-op objects, which lead to their
  definitions); no module over :data:`MAX_MODULE_LINES` lines, no host function over
  :data:`MAX_FUNCTION_LINES` lines (docstring excluded; ``@triton.jit`` kernels are device code
  and exempt); no docstring or comment that points to a design-document section or to a path
  outside the repository.
* op families: each is a package ``fusedpar/ops/<family>/`` with the same roles under the same
  module names (:data:`FAMILY_ROLES`: ``__init__``, ``api``, ``custom_ops``, ``bodies``); every
  ``custom_op`` call, ``register_fake`` and ``register_autograd`` lives in a family's
  ``custom_ops.py`` (``fusedpar/ops/common.py`` holds the one ``torch.library.custom_op`` call,
  the helper that names the namespace); a family's ``__init__`` exports its public API only (no
  ``_fwd`` / ``_bwd`` bodies, no ``_op`` objects, everything in ``__all__``); every other module of
  ``fusedpar/ops`` is in :data:`OPS_SHARED`; no function or method of ``fusedpar/`` or ``kernels/``
  copies another module's (the same arguments and body, :data:`MIN_COPY_NODES` nodes or more):
  a helper has one home.
* the Done criterion of the family layout: from every public name of ``fusedpar.ops`` (and of its
  packages' ``__all__``), the definitions it calls inside its family's folder and ``kernels/``
  reach a ``kernels/`` function that launches a ``@triton.jit`` kernel in at most :data:`MAX_HOPS`
  hops (API -> custom-op object -> body -> launcher), except the names of :data:`NO_KERNEL`
  (no kernel, each with its reason) and :data:`OVER_HOPS` (today's longer paths, checked to stay
  longer so the list shrinks when they are fixed).
* tests: every test module's name starts with one of :data:`TEST_AREAS` (the family or layer
  it tests).
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# source directory -> the dotted package it is installed as (pyproject's package-dir)
PACKAGES = {"kernels": "fusedpar.kernels", "fusedpar": "fusedpar", "benchmarks": "benchmarks"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
# (file, function qualname) pairs allowed over MAX_FUNCTION_LINES, each with its reason; keep empty
FUNCTION_LINES_ALLOWED: dict[tuple[str, str], str] = {}
MODULE_LINES_ALLOWED: dict[str, str] = {}

MODEL_LAYER = ("fusedpar.parallel", "fusedpar.checkpoint", "fusedpar.data", "fusedpar.hf", "fusedpar.hf_config",
               "fusedpar.hf_parallel", "fusedpar.demo")
FORBIDDEN_IMPORTS = {
    # layer (a source dir, relative) -> module prefixes it must not import
    "kernels": ("fusedpar.ops", "fusedpar.nn") + MODEL_LAYER + ("torch.distributed", "benchmarks"),
    "fusedpar/ops": ("fusedpar.nn",) + MODEL_LAYER + ("benchmarks",),
    "fusedpar/nn": MODEL_LAYER + ("torch.distributed", "benchmarks"),
    "fusedpar": ("benchmarks",),
}
# every differentiable op is a torch.library custom op with register_autograd (fusedpar/ops/common.py):
# an autograd.Function subclass anywhere would be opaque to torch.compile's graph capture
NO_AUTOGRAD_FUNCTION = ("kernels", "fusedpar", "benchmarks")


# ----------------------------------------------------------------------------------------------
# reading the tree
# ----------------------------------------------------------------------------------------------
def _source_files() -> list[str]:
    out = []
    for top in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            out += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in sorted(filenames) if f.endswith(".py")]
    return out


FILES = _source_files()


def module_name(rel: str) -> str:
    """``kernels/gemm.py`` -> ``fusedpar.kernels.gemm``; ``fusedpar/ops/__init__.py`` -> ``fusedpar.ops``."""
    top, *rest = rel[:-3].split("/")
    parts = PACKAGES[top].split(".") + rest
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(f): f for f in FILES}


def is_project(mod: str) -> bool:
    return mod in MODULES or any(mod.startswith(p + ".") for p in PACKAGES.values()) or mod in PACKAGES.values()


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass
class Import:
    module: str  # absolute dotted module imported from (``from module import name``) or imported
    name: str | None  # the imported name, None for ``import module``
    line: int


@dataclass
class Parsed:
    rel: str
    text: str
    tree: ast.Module
    imports: list[Import] = field(default_factory=list)


def _resolve(rel: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = module_name(rel).split(".")
    if not rel.endswith("__init__.py"):
        pkg = pkg[:-1]
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@lru_cache(maxsize=None)
def parse(rel: str) -> Parsed:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        text = f.read()
    return read_source(rel, text)


def read_source(rel: str, text: str) -> Parsed:
    """``text`` parsed as the file ``rel`` (its imports resolved to absolute module names)."""
    p = Parsed(rel, text, ast.parse(text, filename=rel))
    for node in ast.walk(p.tree):
        if isinstance(node, ast.Import):
            p.imports += [Import(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            p.imports += [Import(_resolve(rel, node), a.name, node.lineno) for a in node.names]
    return p


def _layer_of(rel: str) -> list[str]:
    """Every layer key of FORBIDDEN_IMPORTS that covers ``rel`` (``fusedpar/nn/x.py`` is in
    ``fusedpar/nn`` and ``fusedpar``)."""
    return [k for k in FORBIDDEN_IMPORTS if rel.startswith(k + "/")]


def _targets(imp: Import) -> list[str]:
    """The modules an import statement may load: ``from a.b import c`` loads ``a.b`` and, when
    ``c`` is a submodule, ``a.b.c``."""
    if imp.name is None:
        return [imp.module]
    return [imp.module, f"{imp.module}.{imp.name}"]


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _case(rule):
    return [pytest.param(f, id=f) for f in FILES if rule(f)]


# ----------------------------------------------------------------------------------------------
# layering
# ----------------------------------------------------------------------------------------------
def layer_violations(p: Parsed) -> list[str]:
    bad = []
    for layer in _layer_of(p.rel):
        for imp in p.imports:
            for prefix in FORBIDDEN_IMPORTS[layer]:
                if any(_under(t, prefix) for t in _targets(imp)):
                    bad.append(f"line {imp.line}: imports {imp.module}{'.' + imp.name if imp.name else ''} "
                               f"({layer}/ must not use {prefix})")
                    break
    # torch.distributed reached as an attribute (``torch.distributed.all_reduce``) counts too
    if any("torch.distributed" in FORBIDDEN_IMPORTS[layer] for layer in _layer_of(p.rel)):
        for node in ast.walk(p.tree):
            if isinstance(node, ast.Attribute) and _dotted(node) == "torch.distributed":
                bad.append(f"line {node.lineno}: uses torch.distributed")
    return bad


@pytest.mark.parametrize("rel", _case(_layer_of))
def test_no_import_from_a_higher_layer(rel):
    bad = layer_violations(parse(rel))
    assert not bad, f"{rel}:\n" + "\n".join(bad)


def _autograd_function_names(p: Parsed) -> set[str]:
    """Names under which this file sees ``torch.autograd.Function``."""
    names = {"torch.autograd.Function", "autograd.Function"}
    for imp in p.imports:
        if imp.module == "torch.autograd" and imp.name == "Function":
            names.add("Function")
    for node in ast.walk(p.tree):
        if isinstance(node, ast.ImportFrom) and _resolve(p.rel, node) == "torch.autograd":
            names |= {a.asname for a in node.names if a.name == "Function" and a.asname}
    return names


def autograd_functions(p: Parsed) -> list[str]:
    """Classes deriving from ``torch.autograd.Function``: ``class`` statements and three-argument
    ``type(name, bases, namespace)`` calls."""
    names = _autograd_function_names(p)
    found = [f"line {n.lineno}: class {n.name}({', '.join(_dotted(b) or '?' for b in n.bases)})"
             for n in ast.walk(p.tree) if isinstance(n, ast.ClassDef) and any(_dotted(b) in names for b in n.bases)]
    for n in ast.walk(p.tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "type" and len(n.args) == 3
                and isinstance(n.args[1], ast.Tuple) and any(_dotted(b) in names for b in n.args[1].elts)):
            found.append(f"line {n.lineno}: type(..., ({', '.join(_dotted(b) or '?' for b in n.args[1].elts)},), ...)")
    return found


#: the one place an autograd Function is made: the eager path of a custom op (``common.call_op``),
#: built from the op's own register_autograd backward and never used while torch.compile traces
EAGER_PATH_FUNCTIONS = {"fusedpar/ops/common.py": 1}


@pytest.mark.parametrize("rel", _case(lambda f: any(f.startswith(d + "/") for d in NO_AUTOGRAD_FUNCTION)))
def test_no_autograd_function(rel):
    bad = autograd_functions(parse(rel))
    if len(bad) == EAGER_PATH_FUNCTIONS.get(rel, 0) and rel in EAGER_PATH_FUNCTIONS:
        assert all("type(" in b for b in bad), bad
        return
    assert not bad, (f"{rel} defines autograd Functions (a differentiable op is a torch.library custom op in "
                     "fusedpar/ops/ with register_autograd):\n" + "\n".join(bad))


# ----------------------------------------------------------------------------------------------
# private names
# ----------------------------------------------------------------------------------------------
def _private_module_crossing(importer: str, mod: str) -> str | None:
    """The private component of ``mod`` when ``importer`` is outside the package that holds it
    (``benchmarks._common`` is private to ``benchmarks``)."""
    parts = mod.split(".")
    for i, part in enumerate(parts):
        if is_private(part):
            owner = ".".join(parts[:i])
            if not _under(importer, owner):
                return part
    return None


def _module_aliases(p: Parsed) -> dict[str, str]:
    """Local names bound to project modules: ``import fusedpar.ops.comm as c`` binds ``c``,
    ``from fusedpar.ops import comm`` binds ``comm``, ``import fusedpar.ops`` binds ``fusedpar``."""
    aliases = {}
    for node in ast.walk(p.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if is_project(a.name):
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        aliases[root] = root
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(p.rel, node)
            for a in node.names:
                if f"{mod}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{mod}.{a.name}"
    return aliases


def private_uses(p: Parsed) -> list[str]:
    me = module_name(p.rel)
    bad = []
    for imp in p.imports:
        if not is_project(imp.module):
            continue
        if imp.name is not None and is_private(imp.name) and imp.module != me:
            bad.append(f"line {imp.line}: from {imp.module} import {imp.name}")
        for target in _targets(imp) if imp.name is None or f"{imp.module}.{imp.name}" in MODULES else [imp.module]:
            if _private_module_crossing(me, target):
                bad.append(f"line {imp.line}: imports the private module {target} from outside its package")
    aliases = _module_aliases(p)
    for node in ast.walk(p.tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            base = _dotted(node.value)
            if base is None:
                continue
            root, *rest = base.split(".")
            if root in aliases:
                mod = ".".join([aliases[root]] + rest)
                if mod in MODULES and mod != me:
                    bad.append(f"line {node.lineno}: {base}.{node.attr} (private name of {mod})")
    return sorted(set(bad))


@pytest.mark.parametrize("rel", _case(lambda f: True))
def test_no_private_name_from_another_module(rel):
    bad = private_uses(parse(rel))
    assert not bad, f"{rel} uses private names of other project modules:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------------------
# op families: one package each, the same roles under the same module names
# ----------------------------------------------------------------------------------------------
OPS_DIR = "fusedpar/ops"
#: the roles every family package has, by module name
FAMILY_ROLES = {
    "__init__": "the family's public API (re-exported from api and its parts; no bodies, no op objects)",
    "api": "the checked functional API: argument checks, then the custom-op object",
    "custom_ops": "the torch.library custom ops: forward and backward ops, fakes, autograd registration",
    "bodies": "the ops' named forward / backward bodies (<op>_fwd / <op>_bwd)",
}
#: what fusedpar/ops holds besides the families, each with its role
OPS_SHARED = {
    "fusedpar/ops/__init__.py": "every family's public API and the transports",
    "fusedpar/ops/common.py": "the namespace and custom_op / input_grads, absent outputs, checked_api",
    "fusedpar/ops/comm/": "the communication layer: collectives, transports, keys, symmetric memory, waits, agreement",
}
# the call names that define or register an op (``torch.library.custom_op``, the helper ``custom_op``)
OP_DEFINITIONS = ("custom_op", "register_fake", "register_autograd")
#: what a family's __init__ must not export: bodies, op objects, schedules' internals
INTERNAL_EXPORT = re.compile(r"(_fwd|_bwd|_op)$")


def _family_of(rel: str) -> str | None:
    """``fusedpar/ops/moe/api.py`` -> ``"moe"`` (None outside a family package)."""
    parts = rel.split("/")
    if len(parts) == 4 and parts[:2] == ["fusedpar", "ops"] and f"{OPS_DIR}/{parts[2]}/" not in OPS_SHARED:
        return parts[2]
    return None


def _is_registration_module(rel: str) -> bool:
    return _family_of(rel) is not None and rel.endswith("/custom_ops.py")


def op_namespace_uses(p: Parsed) -> list[str]:
    """``torch.ops.fusedpar`` (or ``ops.fusedpar`` after ``from torch import ops``) attributes."""
    return [f"line {n.lineno}: {_dotted(n)}" for n in ast.walk(p.tree)
            if isinstance(n, ast.Attribute) and (_dotted(n) or "").split(".")[-2:] == ["ops", "fusedpar"]]


def op_definitions(p: Parsed) -> list[str]:
    """Calls that define or register a custom op outside a family's ``custom_ops.py``
    (``fusedpar/ops/common.py`` may call ``torch.library.custom_op``: the helper)."""
    if _is_registration_module(p.rel):
        return []
    bad = []
    for n in ast.walk(p.tree):
        if isinstance(n, ast.Call):
            name = _dotted(n.func) or ""
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a bare decorator: @op.register_fake
            bad += [f"line {d.lineno}: @{_dotted(d)}" for d in n.decorator_list
                    if (_dotted(d) or "").split(".")[-1] in OP_DEFINITIONS]
            continue
        else:
            continue
        if name.split(".")[-1] not in OP_DEFINITIONS:
            continue
        if p.rel == f"{OPS_DIR}/common.py" and name == "torch.library.custom_op":
            continue
        bad.append(f"line {n.lineno}: {name}(...)")
    return bad


def op_families(files) -> set[str]:
    return {f for f in map(_family_of, files) if f is not None}


def ops_layout_violations(files) -> list[str]:
    """Families without one of their roles; modules of fusedpar/ops outside the families and the
    shared places."""
    bad = [f"family {f}: no {OPS_DIR}/{f}/{role}.py ({why})" for f in sorted(op_families(files))
           for role, why in FAMILY_ROLES.items() if f"{OPS_DIR}/{f}/{role}.py" not in files]
    for rel in files:
        if rel.startswith(OPS_DIR + "/") and _family_of(rel) is None and rel not in OPS_SHARED \
                and not any(rel.startswith(d) for d in OPS_SHARED if d.endswith("/")):
            bad.append(f"{rel}: belongs to no op family and is not in OPS_SHARED")
    return bad


def internal_exports(p: Parsed) -> list[str]:
    """Names a family's ``__init__`` exports (``__all__`` or imports) that are bodies or op objects,
    or that its ``__all__`` does not list (every export is declared, nothing else leaks)."""
    imported = [a.asname or a.name for n in p.tree.body if isinstance(n, ast.ImportFrom) for a in n.names]
    listed = []
    for n in p.tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            listed = [e.value for e in n.value.elts]
    bad = [f"exports {x} (a body or an op object: import it from its module)" for x in imported + listed
           if INTERNAL_EXPORT.search(x)]
    bad += [f"imports {x} without listing it in __all__" for x in imported if x not in listed]
    return sorted(set(bad))


def _body_without_docstring(fn: ast.FunctionDef) -> list[ast.stmt]:
    return fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) else fn.body


def _function_shape(fn: ast.FunctionDef) -> str:
    """A function's arguments and body without its name and docstring (for copies)."""
    return ast.dump(fn.args) + "".join(ast.dump(b) for b in _body_without_docstring(fn))


def _shape_nodes(fn: ast.FunctionDef) -> int:
    """AST nodes of a function's arguments and body, docstring excluded."""
    return sum(1 for part in [fn.args, *_body_without_docstring(fn)] for _ in ast.walk(part))


#: a copy counts from this many AST nodes of arguments and body (``return x.shape`` has 6, a
#: one-line config lookup ``cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n)`` 28)
MIN_COPY_NODES = 20
COPY_DIRS = ("fusedpar/", "kernels/")


def _top_level_and_methods(tree: ast.Module):
    """(qualname, node) of the module's functions and of its classes' methods (not nested
    closures: a closure is private to its function)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from ((f"{node.name}.{f.name}", f) for f in node.body if isinstance(f, ast.FunctionDef))


def copied_helpers(files, source=None) -> list[str]:
    """Functions and methods of two modules under ``fusedpar/`` or ``kernels/`` with the same
    arguments and body (name and docstring ignored), at least :data:`MIN_COPY_NODES` AST nodes: a
    private copy of a helper that has one shared home. ``source(rel)`` gives a file's parsed
    source (default: the tree on disk)."""
    source = source or parse
    seen, bad = {}, []
    for rel in files:
        if not rel.startswith(COPY_DIRS):
            continue
        for qualname, fn in _top_level_and_methods(source(rel).tree):
            if _is_device_code(fn):
                continue
            if _shape_nodes(fn) < MIN_COPY_NODES:
                continue
            key = _function_shape(fn)
            if key in seen and seen[key][0] != rel:
                bad.append(f"{rel}: {qualname} copies {seen[key][0]}: {seen[key][1]}")
            seen.setdefault(key, (rel, qualname))
    return bad


@pytest.mark.parametrize("rel", _case(lambda f: True))
def test_custom_ops_are_called_as_objects(rel):
    bad = op_namespace_uses(parse(rel))
    assert not bad, (f"{rel} reaches ops through torch.ops.fusedpar (call the custom-op object its "
                     "family's custom_ops.py binds instead):\n" + "\n".join(bad))


@pytest.mark.parametrize("rel", _case(lambda f: True))
def test_custom_ops_are_defined_in_registration_modules(rel):
    bad = op_definitions(parse(rel))
    assert not bad, (f"{rel} defines or registers custom ops outside fusedpar/ops/<family>/custom_ops.py:\n"
                     + "\n".join(bad))


def test_every_op_family_follows_the_layout():
    assert op_families(FILES) == {"tensor_parallel", "sequence_parallel", "attention", "moe", "norm", "loss", "fp8"}
    bad = ops_layout_violations(FILES)
    assert not bad, "\n".join(bad)
    for path in OPS_SHARED:
        assert path in FILES or any(f.startswith(path) for f in FILES), path


@pytest.mark.parametrize("rel", _case(lambda f: _family_of(f) is not None and f.endswith("__init__.py")))
def test_a_family_exports_its_public_api_only(rel):
    bad = internal_exports(parse(rel))
    assert not bad, f"{rel}:\n" + "\n".join(bad)


def test_no_copy_of_a_helper_another_module_owns():
    bad = copied_helpers(FILES)
    assert not bad, "\n".join(bad)


def test_the_copy_checker_finds_copies():
    line = "    return cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n)\n"
    sources = {"fusedpar/a.py": 'def f(cfg, n):\n    """doc"""\n' + line,
               "kernels/b.py": "class C:\n    def g(cfg, n):\n" + "    " + line,
               "fusedpar/c.py": "def h(x):\n    return x.shape\n", "kernels/d.py": "def h(x):\n    return x.shape\n",
               "tests/e.py": "def f(cfg, n):\n" + line}
    found = copied_helpers(list(sources), lambda rel: read_source(rel, sources[rel]))
    assert found == ["kernels/b.py: C.g copies fusedpar/a.py: f"], found


# ----------------------------------------------------------------------------------------------
# the Done criterion: from a public name to its kernel launcher in at most MAX_HOPS hops
# ----------------------------------------------------------------------------------------------
#: go-to-definition steps from a public name (its API function) to the kernels/ launcher that does
#: the work: API -> custom-op object -> body -> launcher
MAX_HOPS = 3
#: public names that launch no Triton kernel, each with the reason
NO_KERNEL = {
    **{name: "a transport (the communication layer)" for name in (
        "Transport", "PortableTransport", "SymmetricTransport", "EmulatedTransport", "get_transport",
        "resolve_transport")},
    **{name: "a collective of the communication layer" for name in (
        "DONE", "Handle", "all_gather_into", "all_reduce", "all_to_all", "global_rank", "group_rank", "group_ranks",
        "group_size", "reduce_scatter_into", "resolve_group", "ring_shift", "send_recv", "set_straggler")},
    **{name: "a collective op whose backward is its mirror collective (no GEMM)" for name in (
        "all_gather_tokens", "gather_features", "scatter_features", "replicated_rows")},
    **{name: "a sequence layout helper (index arithmetic in torch)" for name in (
        "LAYOUTS", "document_positions", "sequence_shard", "shard_positions", "zigzag_positions", "zigzag_shard",
        "zigzag_unshard")},
    "MoEPlan": "the plan's data type (built by moe_plan)",
    "sharded_rms_norm": "torch ops in fp32: its statistics are all-reduced between the kernel's passes",
    "attach_aux_loss": "an identity op (the residual add) carrying the router losses' backward",
    "global_loss": "an all-reduce of (sum, count) in fp64",
    "vocab_parallel_cross_entropy": "torch ops over given logits (linear_cross_entropy is the fused kernel)",
}
#: public names that need more than MAX_HOPS hops today: name -> (hops, the path's extra step)
OVER_HOPS = {
    "matmul_reduce_scatter": (4, "body -> the symmetric schedule (or the ring) -> persistent_matmul"),
    "matmul_all_reduce": (5, "body -> chunked_matmul_all_reduce -> chunk_gemm -> matmul_checked"),
    "moe_mlp": (4, "body -> moe.plan.build_plan -> routing_metadata"),
}


def _top_defs(mod: str) -> dict[str, ast.AST]:
    """Top-level functions, classes and assigned names of project module ``mod``."""
    out = {}
    for n in parse(MODULES[mod]).tree.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, ast.Assign):
            out.update((t.id, n) for t in n.targets if isinstance(t, ast.Name))
    return out


@lru_cache(maxsize=None)
def _imported_names(mod: str) -> dict[str, tuple[str, str | None]]:
    """Local name -> (module, name) of every import in ``mod`` (name None: a module)."""
    p, out = parse(MODULES[mod]), {}
    for n in ast.walk(p.tree):
        if isinstance(n, ast.ImportFrom):
            m = _resolve(p.rel, n)
            out.update((a.asname or a.name, (f"{m}.{a.name}", None) if f"{m}.{a.name}" in MODULES else (m, a.name))
                       for a in n.names)
        elif isinstance(n, ast.Import):
            out.update((a.asname, (a.name, None)) for a in n.names if a.asname)
    return out


def definition_of(mod: str, name: str, depth: int = 0) -> tuple[str, str] | None:
    """Where go-to-definition of ``name`` seen from project module ``mod`` lands (re-exports
    followed: they cost no hop), as (module, name); None outside the project."""
    if name in _top_defs(mod):
        return mod, name
    m, n = _imported_names(mod).get(name, (None, None))
    if n is None or m not in MODULES or depth > 8:
        return None
    return definition_of(m, n, depth + 1)


def called_definitions(mod: str, node: ast.AST) -> list[tuple[str, str]]:
    """The project definitions ``node`` calls, or passes to a call (``custom_op(name)(body)``
    binds an op object to its body): plain names and ``module.name`` attributes."""
    out, modules = [], {k: m for k, (m, n) in _imported_names(mod).items() if n is None}
    for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
        for f in [call.func, *call.args]:
            if isinstance(f, ast.Name):
                out.append(definition_of(mod, f.id))
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and modules.get(f.value.id) in MODULES:
                out.append(definition_of(modules[f.value.id], f.attr))
    return list(dict.fromkeys(d for d in out if d is not None))


@lru_cache(maxsize=None)
def is_kernel_launcher(mod: str, name: str, within: tuple = ()) -> bool:
    """A host function of ``kernels/`` that launches a ``@triton.jit`` kernel (``kernel[grid](...)``),
    itself or through other functions of ``kernels/``."""
    node = _top_defs(mod).get(name) if mod.startswith("fusedpar.kernels.") else None
    if not isinstance(node, ast.FunctionDef) or _is_device_code(node) or (mod, name) in within:
        return False
    if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript) for c in ast.walk(node)):
        return True
    return any(is_kernel_launcher(m, n, within + ((mod, name),)) for m, n in called_definitions(mod, node)
               if m.startswith("fusedpar.kernels."))


def hops_to_launcher(family: str, mod: str, name: str, limit: int = 8) -> list[str] | None:
    """The shortest chain of definitions from ``mod.name`` to a kernel launcher, following calls
    inside ``fusedpar/ops/<family>/`` and into ``kernels/`` only (None: no launcher reached)."""
    frontier, seen = [((mod, name), [name])], {(mod, name)}
    for _ in range(limit + 1):
        nxt = []
        for (m, n), path in frontier:
            if is_kernel_launcher(m, n):
                return path
            if not m.startswith(f"fusedpar.ops.{family}."):
                continue
            for d in called_definitions(m, _top_defs(m)[n]):
                if d not in seen:
                    seen.add(d)
                    nxt.append((d, path + [f"{d[0].removeprefix('fusedpar.')}.{d[1]}"]))
        frontier = nxt
    return None


def public_op_names() -> dict[str, tuple[str, str]]:
    """Every name of ``fusedpar.ops.__all__`` and of its packages' ``__all__`` -> its family
    (the package it comes from) and the module that defines it."""
    out = {}
    for package in ["fusedpar.ops"] + sorted(m for m in MODULES if m.count(".") == 2 and m.startswith("fusedpar.ops.")
                                             and MODULES[m].endswith("__init__.py")):
        for node in parse(MODULES[package]).tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                for name in (e.value for e in node.value.elts):
                    where = definition_of(package, name)
                    assert where is not None, f"{package}.__all__ names {name}, defined nowhere in the project"
                    out[name] = (where[0].split(".")[2], where[0])
    return out


PUBLIC_OPS = public_op_names()


@pytest.mark.parametrize("name", sorted(PUBLIC_OPS))
def test_a_public_name_reaches_its_kernel_launcher_in_three_hops(name):
    family, mod = PUBLIC_OPS[name]
    path = hops_to_launcher(family, mod, name)
    if name in NO_KERNEL:
        assert path is None, f"{name} reaches a kernel launcher ({' -> '.join(path)}): remove it from NO_KERNEL"
        return
    assert path is not None, (f"{name} ({mod}) reaches no kernels/ launcher inside fusedpar/ops/{family}/ + kernels/: "
                              "a launch path outside its family, or a name for NO_KERNEL with its reason")
    hops, allowed = len(path) - 1, OVER_HOPS.get(name, (MAX_HOPS,))[0]
    assert hops <= allowed, f"{name}: {hops} hops > {allowed}: {' -> '.join(path)}"
    if name in OVER_HOPS:
        assert hops > MAX_HOPS, f"{name} now takes {hops} hops: remove it from OVER_HOPS"


def test_the_exception_lists_name_public_names():
    assert not (set(NO_KERNEL) | set(OVER_HOPS)) - set(PUBLIC_OPS), sorted((set(NO_KERNEL) | set(OVER_HOPS)) - set(PUBLIC_OPS))
    assert not set(NO_KERNEL) & set(OVER_HOPS)
    assert hops_to_launcher("norm", "fusedpar.ops.norm.api", "rms_norm") == [
        "rms_norm", "ops.norm.custom_ops.rms_norm_op", "ops.norm.bodies.rms_norm_fwd", "kernels.rmsnorm.rms_norm_fwd"]
    assert is_kernel_launcher("fusedpar.kernels.gemm", "matmul")
    assert not is_kernel_launcher("fusedpar.kernels.checks", "check_int")



#: what a test module's name starts with (``test_<area>...``): the op family, layer or part of the
#: project it tests, so the tests of one family are found together
TEST_AREAS = {
    # op families (fusedpar/ops/<family>/ and their kernels)
    "comm": "transfers, transports, agreement", "tensor_parallel": "the TP GEMM ops (ring, symmetric, fp8)",
    "sequence_parallel": "ring / Ulysses / hybrid attention", "attention": "flash attention on one device",
    "moe": "routing, permutes, grouped GEMM, the MoE layer", "norm": "RMSNorm", "loss": "the losses, linear CE",
    "fp8": "quantisation, the fp8 GEMM, fp8_linear",
    # the kernels' runtime
    "gemm": "the GEMM kernels (plain, persistent, fused epilogues)", "tuning": "autotuning configs",
    "blas_order": "interpreter dots independent of the BLAS",
    "interpreter": "fusedpar's fittings of Triton's CPU interpreter (kernels/interpreter.py)",
    # modules, the model layer, the project
    "nn": "fusedpar.nn modules", "model": "whole Transformers composed with the parallelisms",
    "parallel": "fusedpar.parallel", "checkpoint": "fusedpar.checkpoint", "hf": "Hugging Face in / out",
    "torch_compile": "torch.compile of ops, blocks, errors", "demo": "fusedpar.demo", "readme": "the README's examples",
    "benchmarks": "the benchmarks' CLI and compile check", "layers": "this file",
    "bad_inputs": "argument errors across the API", "bad_layouts": "layouts that do not fit",
}


def area_of_test_module(name: str) -> str | None:
    """The area of test module ``name`` (``test_moe_layer.py`` -> ``"moe"``), the longest that fits."""
    stem = name.removeprefix("test_").removesuffix(".py")
    fits = [a for a in TEST_AREAS if stem == a or stem.startswith(a + "_")]
    return max(fits, key=len) if fits else None


def test_pyproject_installs_every_package():
    """A package directory missing from pyproject's list would be absent from a non-editable install."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", f.read(), re.M | re.S).group(1)))
    found = {module_name(f) for f in FILES if f.endswith("__init__.py") and f.split("/")[0] != "benchmarks"}
    assert found == listed, f"packages on disk {sorted(found)} != pyproject's {sorted(listed)}"

def test_every_test_module_is_named_by_its_area():
    modules = sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_") and f.endswith(".py"))
    bad = [m for m in modules if area_of_test_module(m) is None]
    assert not bad, f"test modules whose name starts with no area of TEST_AREAS: {bad}"
    assert area_of_test_module("test_moe_layer.py") == "moe" and area_of_test_module("test_tensor_parallel_ops.py") == "tensor_parallel"
    assert area_of_test_module("test_tp_ops.py") is None and area_of_test_module("test_gemmx.py") is None

# ----------------------------------------------------------------------------------------------
# sizes
# ----------------------------------------------------------------------------------------------
def _is_device_code(fn: ast.AST) -> bool:
    """``@triton.jit`` (or ``@jit``, ``@triton.autotune(...)``, ``@triton.heuristics(...)``) kernels."""
    for d in fn.decorator_list:
        name = _dotted(d.func if isinstance(d, ast.Call) else d) or ""
        if name.split(".")[-1] in ("jit", "autotune", "heuristics"):
            return True
    return False


def _functions(tree: ast.Module):
    """(qualname, node) of every function and method, nested ones included."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def function_lines(fn: ast.AST) -> int:
    """Lines of a function from its ``def`` to its last line, without its docstring."""
    n = fn.end_lineno - fn.lineno + 1
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        n -= body[0].end_lineno - body[0].lineno + 1
    return n


@pytest.mark.parametrize("rel", _case(lambda f: True))
def test_module_and_function_sizes(rel):
    p = parse(rel)
    bad = []
    n_lines = len(p.text.splitlines())
    if n_lines > MAX_MODULE_LINES and rel not in MODULE_LINES_ALLOWED:
        bad.append(f"the module has {n_lines} lines (> {MAX_MODULE_LINES})")
    for qualname, fn in _functions(p.tree):
        if _is_device_code(fn) or (rel, qualname) in FUNCTION_LINES_ALLOWED:
            continue
        n = function_lines(fn)
        if n > MAX_FUNCTION_LINES:
            bad.append(f"line {fn.lineno}: {qualname} has {n} lines without its docstring (> {MAX_FUNCTION_LINES})")
    assert not bad, f"{rel}:\n" + "\n".join(bad)


def test_allow_lists_name_existing_code():
    for rel, qualname in FUNCTION_LINES_ALLOWED:
        assert qualname in dict(_functions(parse(rel).tree)), (rel, qualname)
    for rel in MODULE_LINES_ALLOWED:
        assert rel in FILES, rel


# ----------------------------------------------------------------------------------------------
# references in docstrings and comments
# ----------------------------------------------------------------------------------------------
# every source and test file but this one (its patterns and self-checks spell what they look for)
DOC_FILES = FILES + [f"tests/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "tests")))
                     if f.endswith(".py") and f != os.path.basename(__file__)]
SECTION_REF = re.compile(r"DESIGN\.md\s*§")
# an absolute path into a machine's file system, a home directory, or a relative path that climbs
# out of the repository
OUTSIDE_PATH = re.compile(r"(?<![\w)\]}.*/])/(?:work|tmp|home|root|Users|mnt|opt|srv|scratch|data)/|~/|\.\./")


@pytest.mark.parametrize("rel", [pytest.param(f, id=f) for f in DOC_FILES])
def test_no_reference_to_a_design_section_or_outside_path(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        lines = f.read().splitlines()
    bad = [f"line {i}: {line.strip()}" for i, line in enumerate(lines, 1)
           if SECTION_REF.search(line) or OUTSIDE_PATH.search(line)]
    assert not bad, f"{rel} points to a design-document section or a path outside the repository:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------------------
# the checker itself
# ----------------------------------------------------------------------------------------------
def test_the_checker_reads_the_tree():
    assert "kernels/runtime.py" in FILES and "fusedpar/ops/comm/transport.py" in FILES
    assert module_name("kernels/runtime.py") == "fusedpar.kernels.runtime"
    assert module_name("fusedpar/ops/__init__.py") == "fusedpar.ops"
    assert module_name("benchmarks/_common.py") == "benchmarks._common"
    assert _resolve("fusedpar/ops/loss/api.py", ast.parse("from ...kernels.checks import check_int").body[0]) == "fusedpar.kernels.checks"
    assert _resolve("kernels/gemm.py", ast.parse("from .runtime import x").body[0]) == "fusedpar.kernels.runtime"
    assert _resolve("fusedpar/ops/__init__.py", ast.parse("from .loss import x").body[0]) == "fusedpar.ops.loss"
    assert _resolve("fusedpar/ops/loss/api.py", ast.parse("from .bodies import x").body[0]) == "fusedpar.ops.loss.bodies"
    assert is_private("_x") and not is_private("__init__") and not is_private("x")
    assert _private_module_crossing("benchmarks.tp", "benchmarks._common") is None
    assert _private_module_crossing("fusedpar.ops.moe", "benchmarks._common") == "_common"
    fn = ast.parse('def f():\n    """doc\n    more"""\n    return 1\n').body[0]
    assert function_lines(fn) == 2
    assert SECTION_REF.search("see DESIGN.md §3") and OUTSIDE_PATH.search("read /work/shared/x")
    assert not OUTSIDE_PATH.search("GB/s over seq/(sp*tp) and tokens/s")
    assert _family_of("fusedpar/ops/norm/api.py") == "norm" and _family_of("fusedpar/ops/comm/keys.py") is None
    assert _is_registration_module("fusedpar/ops/norm/custom_ops.py") and not _is_registration_module("fusedpar/ops/common.py")
    files = ["fusedpar/ops/common.py", "fusedpar/ops/norm/__init__.py", "fusedpar/ops/norm/api.py",
             "fusedpar/ops/norm/custom_ops.py", "fusedpar/ops/norm/bodies.py", "fusedpar/ops/loss/api.py",
             "fusedpar/ops/comm/keys.py", "fusedpar/ops/stray.py", "kernels/x.py"]
    assert op_families(files) == {"norm", "loss"}
    assert ops_layout_violations(files) == [
        "family loss: no fusedpar/ops/loss/__init__.py (" + FAMILY_ROLES["__init__"] + ")",
        "family loss: no fusedpar/ops/loss/custom_ops.py (" + FAMILY_ROLES["custom_ops"] + ")",
        "family loss: no fusedpar/ops/loss/bodies.py (" + FAMILY_ROLES["bodies"] + ")",
        "fusedpar/ops/stray.py: belongs to no op family and is not in OPS_SHARED"]


# ----------------------------------------------------------------------------------------------
# placements: every parameter a module creates is declared by a placements() method
# ----------------------------------------------------------------------------------------------
PLACEMENT_DIRS = ("fusedpar",)


def _creates_parameters(cls: ast.ClassDef) -> list[int]:
    """Lines where a method of ``cls`` assigns ``self.<name> = nn.Parameter(...)``."""
    lines = []
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                    and (_dotted(n.value.func) or "").split(".")[-1] == "Parameter"
                    and any(isinstance(t, ast.Attribute) and _dotted(t.value) == "self" for t in n.targets)):
                lines.append(n.lineno)
    return lines


def undeclared_parameters(p: Parsed) -> list[str]:
    """Classes that create parameters (``self.x = nn.Parameter(...)``) without a ``placements``
    method: nothing would tell checkpoints, the gradient sync or the HF export how they are split."""
    bad = []
    for cls in ast.walk(p.tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        lines = _creates_parameters(cls)
        declares = any(isinstance(f, ast.FunctionDef) and f.name == "placements" for f in cls.body)
        if lines and not declares:
            bad.append(f"class {cls.name} (line {lines[0]}) creates parameters but has no placements()")
    return bad


@pytest.mark.parametrize("rel", _case(lambda f: f.split("/")[0] in PLACEMENT_DIRS))
def test_modules_declare_the_placement_of_their_parameters(rel):
    bad = undeclared_parameters(parse(rel))
    assert not bad, f"{rel}:\n" + "\n".join(bad)


def test_every_parameter_of_a_full_model_has_a_placement():
    """A Transformer with every parameter-bearing option: each parameter's placement is declared
    by some module (parameter_placements raises naming any that is not)."""
    from fusedpar.nn import Transformer, TransformerConfig, parameter_placements

    config = TransformerConfig(vocab_size=16, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1,
                               ffn_hidden_size=8, num_experts=2, top_k=1, moe_every=2, qkv_bias=True, qk_norm=True,
                               shared_expert_ffn_hidden_size=8)
    for tied, layout, scope in ((False, "pre", "head"), (True, "sandwich", "projection"), (False, "post", "head")):
        config.tie_word_embeddings, config.norm_layout, config.qk_norm_scope = tied, layout, scope
        model = Transformer(config, device="meta")
        placements = parameter_placements(model)
        assert set(placements) == {n for n, _ in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# the design document's code map names every module
# ----------------------------------------------------------------------------------------------
def code_map(text: str) -> set[str]:
    """The paths the code map of ``docs/DESIGN.md`` names: the first fenced block of its section 1;
    a line ``dir/`` (unindented) opens a directory, an indented line's first word is a file in it,
    an unindented ``dir/file.py`` names a file."""
    section = text.split("## 1.", 1)[1]
    block = section.split("```", 2)[1]
    paths, current = set(), ""
    for line in block.splitlines():
        if not line.strip():
            continue
        word = line.split()[0]
        if not line.startswith(" "):
            current = word if word.endswith("/") else ""
            if word.endswith(".py"):
                paths.add(word)
        elif current and word.endswith(".py"):
            paths.add(current + word)
    return paths


def test_the_design_code_map_names_every_module():
    with open(os.path.join(ROOT, "docs", "DESIGN.md")) as f:
        named = code_map(f.read())
    modules = {f for f in FILES if f.split("/")[0] in ("kernels", "fusedpar") and not f.endswith("__init__.py")}
    assert not modules - named, f"modules missing from the code map of docs/DESIGN.md: {sorted(modules - named)}"
    assert not named - modules, f"the code map of docs/DESIGN.md names modules that do not exist: {sorted(named - modules)}"


SNIPPETS = [  # (file, code, which check, number of violations)
    ("fusedpar/nn/x.py", "from fusedpar.ops import comm\ncomm._straggle(1)\n", private_uses, 1),
    ("fusedpar/nn/x.py", "import fusedpar.ops.comm as c\nc._x\nc.public\n", private_uses, 1),
    ("fusedpar/nn/x.py", "import fusedpar.ops.comm\nfusedpar.ops.comm._x()\n", private_uses, 1),
    ("kernels/x.py", "from .gemm import _helper, matmul\n", private_uses, 1),
    ("fusedpar/ops/x.py", "from benchmarks._common import check_close\n", private_uses, 1),
    ("benchmarks/x.py", "from ._common import check_close\nimport torch._C\n", private_uses, 0),
    ("kernels/x.py", "import torch\ntorch.distributed.all_reduce(t)\n", layer_violations, 1),
    ("kernels/x.py", "from fusedpar.ops import comm\n", layer_violations, 1),
    ("kernels/x.py", "from ..ops.loss import attach_aux_loss\n", layer_violations, 1),
    ("fusedpar/ops/x.py", "def f():\n    from fusedpar.nn import RMSNorm\n", layer_violations, 1),
    ("fusedpar/nn/x.py", "import torch.distributed as dist\n", layer_violations, 1),
    ("fusedpar/nn/x.py", "from fusedpar.ops import rms_norm\nfrom fusedpar import parallel\n", layer_violations, 1),
    ("fusedpar/parallel.py", "import torch.distributed as dist\nfrom fusedpar.nn import RMSNorm\n",
     layer_violations, 0),
    ("fusedpar/nn/x.py", "import torch\nclass F(torch.autograd.Function):\n    pass\n", autograd_functions, 1),
    ("fusedpar/nn/x.py", "from torch.autograd import Function as Fn\nclass F(Fn):\n    pass\n",
     autograd_functions, 1),
    ("fusedpar/nn/x.py", "from torch import nn\nclass M(nn.Module):\n    pass\n", autograd_functions, 0),
    ("fusedpar/ops/norm/api.py", "import torch\ntorch.ops.fusedpar.rms_norm(x)\n", op_namespace_uses, 1),
    ("benchmarks/x.py", "from torch import ops\nops.fusedpar.flash_attention.default\n", op_namespace_uses, 1),
    ("fusedpar/ops/norm/custom_ops.py", "torch.ops.aten.add(x, y)\nrms_norm_op(x)\n", op_namespace_uses, 0),
    ("fusedpar/ops/norm/api.py", "import torch\n@torch.library.custom_op('fusedpar::f', mutates_args=())\n"
     "def f(x: torch.Tensor) -> torch.Tensor:\n    return x\n", op_definitions, 1),
    ("fusedpar/ops/norm/bodies.py", "f_op = custom_op('f')(f)\nf_op.register_autograd(b)\n", op_definitions, 2),
    ("kernels/x.py", "@f_op.register_fake\ndef _(x):\n    pass\n", op_definitions, 1),
    ("fusedpar/ops/norm/custom_ops.py", "f_op = custom_op('f')(f)\n@f_op.register_fake\ndef _(x):\n    pass\n"
     "f_op.register_autograd(b)\n", op_definitions, 0),
    ("fusedpar/ops/common.py", "def custom_op(name):\n    return torch.library.custom_op(name)\n", op_definitions, 0),
    ("fusedpar/ops/common.py", "x = custom_op('f')\n", op_definitions, 1),
    ("fusedpar/ops/norm/__init__.py", "from .api import rms_norm\nfrom .bodies import rms_norm_fwd\n__all__ = ['rms_norm']\n",
     internal_exports, 2),
    ("fusedpar/ops/norm/__init__.py", "from .api import rms_norm\n__all__ = ['rms_norm']\n", internal_exports, 0),
    ("fusedpar/nn/x.py", "class M:\n    def __init__(self):\n        self.w = nn.Parameter(t)\n",
     undeclared_parameters, 1),
    ("fusedpar/nn/x.py", "class M:\n    def __init__(self):\n        self.w = nn.Parameter(t)\n"
     "    def placements(self):\n        return {}\n", undeclared_parameters, 0),
    ("fusedpar/nn/x.py", "class M:\n    def f(self):\n        setattr(self, 'w', nn.Parameter(t))\n",
     undeclared_parameters, 0),
]


@pytest.mark.parametrize("rel,code,check,n", SNIPPETS, ids=[f"{c.__name__}-{i}" for i, (_, _, c, _) in
                                                           enumerate(SNIPPETS)])
def test_the_checker_finds_violations(rel, code, check, n):
    assert len(check(read_source(rel, code))) == n, check(read_source(rel, code))
