"""Tamper defenses, grader side: what the tests rely on, and a static scan of student code. The
in-kernel guard is guard.py; worker.py (`_guard_flags`) turns its reports into flags and zeroes.

The threat: student code runs in the same kernel as the hidden tests, before them, and can replace
what they call (`builtins.abs = ...`, `torch.allclose = lambda *a, **k: True`, a test helper,
IPython's `run_cell`), or return objects that fake comparisons. No in-process check can be
complete against code written by someone who has read this grader, so there are three layers:

1. Sandbox (sandbox.py): hidden material, the gradebook and other students are not there to read
   or write; limits stop loops and bombs. Nothing in the kernel can change that.
2. Runtime guard (guard.py, driven by execute.py): before each locked and test cell, everything
   snapshotted at kernel start (builtins, torch, numpy, course, ..., test helpers, the source's
   import aliases, IPython's machinery) is put back, so tests run on pristine objects; what had
   to be put back is flagged `patched` (review: the score is what the student's own code earned).
   After each test cell, anything replaced DURING it, or written and undone again (module write
   log), zeroes that cell (`tampered`). A guard that stops answering, or answers with a wrong
   signature or sequence number, zeroes the rest (`guard-broken`).
3. Static scan (`scan`): the tools such tampering needs, in code the student wrote or edited:
   assignments into modules, `__builtins__`, `sys.modules`, `gc`, `ctypes`, `exec`/`eval`,
   `get_ipython`, `__dict__`, classes that define `__eq__`/`__torch_function__`, ... -> `suspicious`
   (review). It is what catches the attacks layer 2 cannot see, such as writes through
   `module.__dict__` that undo themselves, or a guard replaced by code that found its key.

A fourth scan is not about tampering: the `course` package holds labs' answers as later labs'
given code, so an answer cell can call the package's copy of the very function it should write
(`package_answers` -> `package-answer`, review: the tests pass on the package's code).

Limits, stated: an object returned by student code that lies about equality passes a test that
compares with `==` (the scan flags classes defining `__eq__`); a patch that undoes itself through
`__dict__` within one test cell is caught only by the scan.
"""
from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass

from IPython.core.inputtransformer2 import TransformerManager

GUARDED_ROOTS = {"builtins", "math", "operator", "inspect", "functools", "itertools", "collections",
                 "dataclasses", "copy", "numpy", "torch", "course", "sys", "IPython"}
SUSPICIOUS_NAMES = {
    "__builtins__": "touches __builtins__",
    "exec": "runs code from a string (exec)",
    "eval": "runs code from a string (eval)",
    "compile": "compiles code from a string",
    "__import__": "imports by name (__import__)",
    "get_ipython": "reaches into IPython (get_ipython)",
    "globals": "edits the namespace through globals()",
    "vars": "edits a namespace through vars()",
}
SUSPICIOUS_MODULES = {"builtins", "gc", "ctypes", "importlib", "signal", "atexit", "multiprocessing",
                      "subprocess", "socket"}
SUSPICIOUS_ATTRS = {"__dict__", "__closure__", "__code__", "__globals__", "__builtins__", "__subclasses__", "__module__",
                    "_getframe", "f_locals", "f_globals", "f_back"}
SUSPICIOUS_CALLS = {"sys": {"modules", "settrace", "setprofile", "addaudithook", "_getframe"},
                    "os": {"system", "fork", "forkpty", "kill", "killpg", "popen", "execv", "execve", "execvp",
                           "spawnv", "posix_spawn", "_exit"}}
FAKE_DUNDERS = {"__eq__", "__ne__", "__bool__", "__torch_function__", "__array_function__", "__array_ufunc__",
                "__instancecheck__", "__subclasscheck__", "__getattribute__"}


@functools.lru_cache(maxsize=4096)
def parse(source: str) -> ast.Module | None:
    """A cell's AST after IPython's transforms (magics, `!cmd`), or None when it does not parse.
    Code that is valid Python already is parsed as it is: IPython's transforms change only syntax
    Python rejects (and drop leading blank lines: line numbers here count from the cell's first line,
    as the student sees it), and running them costs 10x the parse. Cached:
    grading parses each cell several times (scan, aliases, checkpoints); callers only read the tree."""
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        pass
    try:
        return ast.parse(TransformerManager().transform_cell(source))
    except (SyntaxError, ValueError):
        return None


class _Bound(ast.NodeVisitor):
    """Top-level names a cell binds (not inside functions or classes)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def _target(self, node: ast.AST) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                self.names.add(n.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._target(t)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target)

    def visit_For(self, node: ast.For) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            if item.optional_vars is not None:
                self._target(item.optional_vars)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.names.add(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.names.add(node.name)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.names.add(a.asname or a.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            if a.name != "*":
                self.names.add(a.asname or a.name)


def bound_names(source: str) -> set[str]:
    tree = parse(source)
    if tree is None:
        return set()
    visitor = _Bound()
    visitor.visit(tree)
    return visitor.names


class _Reads(ast.NodeVisitor):
    """The names a cell reads before it binds them itself: what it needs from earlier cells. Visits in
    the order Python runs the code; a function's body counts as run where it is defined."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.free: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.bound.add(node.id)
        elif node.id not in self.bound:
            self.free.add(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name) and node.target.id not in self.bound:
            self.free.add(node.target.id)
        self.visit(node.value)
        self.visit(node.target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self.visit(node.target)
        for child in node.body + node.orelse:
            self.visit(child)

    visit_AsyncFor = visit_For

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bound.add(node.name)
        for child in node.body:
            self.visit(child)

    def _scope(self, body: list[ast.AST], local: set[str]) -> None:
        """A function, class or comprehension body: its own parameters and assignments are not reads."""
        saved = set(self.bound)
        self.bound |= local | {n.id for b in body for n in ast.walk(b) if isinstance(n, ast.Name)
                               and isinstance(n.ctx, ast.Store)}
        for child in body:
            self.visit(child)
        self.bound = saved

    def _function(self, node) -> None:
        a = node.args
        for default in a.defaults + [d for d in a.kw_defaults if d is not None]:
            self.visit(default)
        params = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p is not None}
        if isinstance(node, ast.Lambda):
            self._scope([node.body], params)
            return
        for decorator in node.decorator_list:
            self.visit(decorator)
        self._scope(node.body, params)
        self.bound.add(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for child in node.decorator_list + node.bases + [k.value for k in node.keywords]:
            self.visit(child)
        self._scope(node.body, set())
        self.bound.add(node.name)

    def _comprehension(self, node) -> None:
        saved = set(self.bound)
        for gen in node.generators:
            self.visit(gen.iter)
            self.visit(gen.target)
            for cond in gen.ifs:
                self.visit(cond)
        for part in ("elt", "key", "value"):
            if hasattr(node, part):
                self.visit(getattr(node, part))
        self.bound = saved

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def visit_Import(self, node: ast.Import) -> None:
        self.bound |= {a.asname or a.name.split(".")[0] for a in node.names}

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.bound |= {a.asname or a.name for a in node.names if a.name != "*"}


def reads(source: str) -> set[str]:
    """The names code `source` reads before binding them (every identifier, if it does not parse)."""
    tree = parse(source)
    if tree is None:
        return set(re.findall(r"[A-Za-z_]\w*", source))
    visitor = _Reads()
    visitor.visit(tree)
    return visitor.free


def given_objects(source_nb) -> set[str]:
    """Names the lab's own given and locked code cells bind (model, hf_model, tokenizer, ...):
    student code that assigns into their attributes is patching what tests use."""
    from autograder.grade.repair import cell_kind

    names: set[str] = set()
    for cell in source_nb.cells:
        if cell.cell_type == "code" and cell_kind(cell) in {"plain", "locked"}:
            names |= bound_names(cell.source)
    return names


def import_aliases(sources: list[str]) -> dict[str, tuple[str, str | None]]:
    """Names the source notebook's imports bind: {'np': ('numpy', None), 'F': ('torch.nn', 'functional'),
    'benchmark': ('course.timing', 'benchmark')}. Names bound differently by two imports are left out."""
    found: dict[str, tuple[str, str | None]] = {}
    clash: set[str] = set()
    for source in sources:
        tree = parse(source)
        for node in ast.walk(tree) if tree else []:
            pairs = []
            if isinstance(node, ast.Import):
                pairs = [(a.asname or a.name.split(".")[0], (a.name if a.asname else a.name.split(".")[0], None))
                         for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                pairs = [(a.asname or a.name, (node.module, a.name)) for a in node.names if a.name != "*"]
            for name, target in pairs:
                if found.get(name, target) != target:
                    clash.add(name)
                found[name] = target
    return {k: v for k, v in found.items() if k not in clash}


@dataclass(frozen=True)
class Finding:
    line: int
    what: str


def graded_answers(source_nb) -> set[str]:
    """The functions and classes the lab's solution cells define: its graded answers."""
    from autograder.grade.repair import cell_kind

    names: set[str] = set()
    for cell in source_nb.cells:
        if cell.cell_type == "code" and cell_kind(cell) == "solution":
            tree = parse(cell.source)
            names |= {n.name for n in (tree.body if tree else [])
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return names


def _course_object(path: str):
    """The object at the dotted `path` inside the `course` package, or None (imports only course modules)."""
    import importlib

    parts = path.split(".")
    if parts[0] != "course":
        return None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - not a module (or one that cannot load here): try the shorter path
            continue
        for part in parts[i:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def package_answers(source: str, answers: set[str], aliases: dict[str, tuple[str, str | None]]) -> list[Finding]:
    """Uses, in one student cell, of the `course` package's own copy of one of this lab's graded
    answers: `from course.serve import AsyncEngine`, `course.engine.sampler.sample(...)`, or
    `sampler.sample` after `from course.engine import sampler`. The package holds earlier labs'
    answers as later labs' given code, so a student can call them instead of writing their own.
    `aliases`: the submission's import aliases. A hit is an object of that name defined in `course`."""
    tree = parse(source)
    if tree is None or not answers:
        return []
    found: list[Finding] = []

    def check(node: ast.AST, path: str, name: str) -> None:
        obj = _course_object(path)
        if getattr(obj, "__name__", None) == name and str(getattr(obj, "__module__", "")).startswith("course"):
            found.append(Finding(getattr(node, "lineno", 0), f"uses {path}, the package's copy of the graded {name}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "course":
            for a in node.names:
                if a.name in answers:
                    check(node, f"{node.module}.{a.name}", a.name)
        elif isinstance(node, ast.Attribute) and node.attr in answers:
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                module, attr = aliases[base.id]
                prefix = f"{module}.{attr}" if attr else module
                if prefix.split(".")[0] == "course":
                    check(node, ".".join([prefix, *reversed(chain)]), node.attr)
    return sorted(set(found), key=lambda f: (f.line, f.what))


def _root(node: ast.AST) -> str | None:
    """The first name of an attribute chain: `torch` in `torch.nn.functional.softmax`."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def scan(source: str, module_names: set[str], objects: set[str] = frozenset()) -> list[Finding]:
    """Suspicious constructs in one student-written cell. `module_names`: names that are modules in the
    lab (its import aliases, e.g. torch, np, F): assigning into them is patching. `objects`: what the
    lab's given cells define (model, hf_model): setting their attributes is patching too."""
    tree = parse(source)
    if tree is None:
        return []
    mods = module_names | GUARDED_ROOTS
    found: list[Finding] = []

    def add(node: ast.AST, what: str) -> None:
        found.append(Finding(getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) in mods:
                    add(node, f"assigns into {ast.unparse(t)}")
                elif isinstance(t, ast.Attribute) and _root(t) in objects:
                    add(node, f"replaces {ast.unparse(t)}, which the lab gave you")
                elif isinstance(t, ast.Attribute) and t.attr == "__class__":
                    add(node, f"assigns {ast.unparse(t)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in {"setattr", "delattr"} and node.args and _root(node.args[0]) in mods | {"type"}:
                add(node, f"{node.func.id}() on {ast.unparse(node.args[0])}")
            elif node.func.id in SUSPICIOUS_NAMES:
                add(node, SUSPICIOUS_NAMES[node.func.id])
        elif isinstance(node, ast.Name) and node.id == "__builtins__":
            add(node, SUSPICIOUS_NAMES["__builtins__"])
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for n in names:
                if n.split(".")[0] in SUSPICIOUS_MODULES:
                    add(node, f"imports {n}")
        elif isinstance(node, ast.Attribute) and node.attr in SUSPICIOUS_ATTRS:
            add(node, f"uses .{node.attr}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.attr in SUSPICIOUS_CALLS.get(node.value.id, ()):
            add(node, f"uses {node.value.id}.{node.attr}")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in FAKE_DUNDERS:
                    add(item, f"class {node.name} defines {item.name} (can fake comparisons)")
    return sorted(set(found), key=lambda f: (f.line, f.what))
