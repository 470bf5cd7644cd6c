"""What a test checks first: that student code returned the kind of value the problem asks for.

A test that compares an answer with `==`, `torch.equal` or `torch.allclose` lets the answer take
part in the comparison. An object whose every attribute and comparison answers "yes", or a tensor
subclass that rewrites torch functions, would pass it. So every graded test first checks the
answer's exact type (no subclass, no look-alike), then its dtype, shape and device, and only then
compares values. Each check raises AssertionError with a message that tells an honest student what
was expected, and returns the value so a test can check and bind in one line:

    from course.expect import expect_tensor, expect_int, expect_ints
    out = expect_tensor(generate(ids, 8), "generate(ids, 8)", dtype=torch.long, shape=(1, 12), device=env.device)
    n = expect_int(kv_cache_bytes(cfg, 100), "kv_cache_bytes(cfg, 100)", min=0)
    toks = expect_ints(greedy(prompt, 5), "greedy(prompt, 5)", length=5)

Nothing here calls a method of the value before its type is known to be the real one: the messages
name `type(x)`, which no object can fake.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["expect_tensor", "expect_int", "expect_float", "expect_bool", "expect_ints", "expect_floats",
           "expect_type", "expect_tuple", "kind", "graded_alone", "substituted", "Cases"]


def kind(x: object) -> str:
    """How a message names what was returned: the exact type, and a hint for the usual mix-ups."""
    t = type(x)
    name = t.__qualname__ if t.__module__ in ("builtins", "__main__") else f"{t.__module__}.{t.__qualname__}"
    if t is not torch.Tensor and isinstance(x, torch.Tensor):
        return f"{name} (a subclass of torch.Tensor; return a plain tensor)"
    if t is torch.Tensor:
        return f"a tensor of shape {tuple(x.shape)}, {x.dtype}, on {x.device}"
    if x is None:
        return "None (did the function forget to return?)"
    return name


def _fail(what: str, wanted: str, x: object, hint: str = "") -> AssertionError:
    return AssertionError(f"{what} must be {wanted}, got {kind(x)}" + (f": {hint}" if hint else ""))


def _same_device(got: torch.device, want: torch.device) -> bool:
    """'cuda' and 'cuda:0' name the same device when 0 is the current one."""
    if got.type != want.type:
        return False
    if got.index is None or want.index is None:
        current = torch.cuda.current_device() if got.type == "cuda" and torch.cuda.is_available() else 0
        return (got.index if got.index is not None else current) == (want.index if want.index is not None else current)
    return got.index == want.index


def _dtypes(dtype) -> tuple[torch.dtype, ...]:
    return tuple(dtype) if isinstance(dtype, (tuple, list, set, frozenset)) else (dtype,)


def expect_tensor(x: object, what: str, *, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                  shape: Sequence[int | None] | None = None, ndim: int | None = None,
                  device: str | torch.device | None = None, finite: bool = False) -> torch.Tensor:
    """`x` is a plain torch.Tensor with this dtype (or one of these), shape (None = any size on that
    axis), number of dimensions and device; with `finite`, it holds no NaN or inf. Returns `x`."""
    if type(x) is not torch.Tensor:
        raise _fail(what, "a torch.Tensor", x)
    if dtype is not None and x.dtype not in _dtypes(dtype):
        names = " or ".join(str(d) for d in _dtypes(dtype))
        raise AssertionError(f"{what} must have dtype {names}, got {x.dtype}"
                             + (" (token ids are integers: torch.long)" if torch.long in _dtypes(dtype) else ""))
    if ndim is not None and x.dim() != ndim:
        raise AssertionError(f"{what} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None:
        shape = tuple(shape)
        if x.dim() != len(shape) or any(w is not None and g != w for g, w in zip(x.shape, shape)):
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
            raise AssertionError(f"{what} must have shape {want}, got {tuple(x.shape)}")
    if device is not None and not _same_device(x.device, torch.device(device)):
        raise AssertionError(f"{what} must be on {torch.device(device)} (where its inputs are), got {x.device}")
    if finite and x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise AssertionError(f"{what} holds NaN or inf (a masked lane or a division by zero?)")
    return x


def expect_int(x: object, what: str, *, min: int | None = None, max: int | None = None) -> int:
    """`x` is a Python int (not a bool, NumPy scalar or tensor), within [min, max]. Returns it."""
    if type(x) is not int:
        hint = "convert with int(...)" if isinstance(x, torch.Tensor) or type(x).__module__ == "numpy" else ""
        raise _fail(what, "a Python int", x, hint)
    if min is not None and x < min:
        raise AssertionError(f"{what} must be at least {min}, got {x}")
    if max is not None and x > max:
        raise AssertionError(f"{what} must be at most {max}, got {x}")
    return x


def expect_float(x: object, what: str, *, finite: bool = True) -> float:
    """`x` is a Python float or int (not a bool or tensor; finite unless told). Returns it as a float."""
    if type(x) not in (float, int):
        hint = "convert with float(...) or .item()" if isinstance(x, torch.Tensor) or type(x).__module__ == "numpy" else ""
        raise _fail(what, "a Python float", x, hint)
    if finite and not (-float("inf") < x < float("inf")):
        raise AssertionError(f"{what} must be a finite number, got {x}")
    return float(x)


def expect_bool(x: object, what: str) -> bool:
    """`x` is True or False (not a tensor or a truthy object). Returns it."""
    if type(x) is not bool:
        raise _fail(what, "True or False", x, "convert with bool(...)" if isinstance(x, torch.Tensor) else "")
    return x


def _sequence(x: object, what: str, item: type | tuple[type, ...], item_name: str, length: int | None,
              container: type | tuple[type, ...]) -> list:
    containers = container if isinstance(container, tuple) else (container,)
    if type(x) not in containers:
        raise _fail(what, f"a {' or '.join(c.__name__ for c in containers)} of {item_name}", x)
    items = item if isinstance(item, tuple) else (item,)
    for i, v in enumerate(x):
        if type(v) not in items:
            hint = "convert with .tolist()" if isinstance(v, torch.Tensor) else ""
            raise AssertionError(f"{what}[{i}] must be {item_name[:-1] if item_name.endswith('s') else item_name}, "
                                 f"got {kind(v)}" + (f": {hint}" if hint else ""))
    if length is not None and len(x) != length:
        raise AssertionError(f"{what} must hold {length} items, got {len(x)}")
    return list(x)


def expect_ints(x: object, what: str, *, length: int | None = None, container=list) -> list[int]:
    """`x` is a list (or `container`) of Python ints, of `length` items when given. Returns it as a list."""
    return _sequence(x, what, int, "Python ints", length, container)


def expect_floats(x: object, what: str, *, length: int | None = None, container=list) -> list[float]:
    """`x` is a list (or `container`) of Python floats or ints. Returns them as a list of floats."""
    return [float(v) for v in _sequence(x, what, (float, int), "Python floats", length, container)]


def expect_type(x: object, what: str, *types: type) -> object:
    """`type(x)` is exactly one of `types` (a subclass is not enough: it could fake comparisons). Returns `x`."""
    if not types:
        raise TypeError("expect_type needs at least one type")
    if type(x) not in types:
        raise _fail(what, " or ".join(f"a {t.__qualname__}" for t in types), x)
    return x


def expect_tuple(x: object, what: str, length: int) -> tuple:
    """`x` is a tuple (or a list) of `length` items, for answers such as `(k, v)`. Returns it as a tuple."""
    if type(x) not in (tuple, list):
        raise _fail(what, f"a tuple of {length} items", x)
    if len(x) != length:
        raise AssertionError(f"{what} must hold {length} items, got {len(x)}")
    return tuple(x)


@contextmanager
def graded_alone(cls: type, base: type) -> Iterator[type]:
    """Run `cls` (a problem's class built on an earlier problem's class) on `base` instead, the
    course's reference for the earlier problem, for the length of a test: a mistake in the earlier
    problem then costs only that problem's points.

        with graded_alone(SharedBlockAllocator, ReferenceAllocator):
            a = SharedBlockAllocator(8, 4)     # your fork and copy-on-write, the course's Problem 1
    """
    if type(cls) is not type or type(base) is not type:
        raise AssertionError(f"{getattr(cls, '__name__', cls)!r} must be a class (a plain `class ...:` statement), "
                             f"got {kind(cls)}")
    saved = cls.__bases__
    try:
        cls.__bases__ = (base,)
    except TypeError as e:
        raise AssertionError(f"{cls.__name__} cannot be graded on its own ({e}): define it as a plain class "
                             f"that inherits from the earlier problem's class") from None
    try:
        yield cls
    finally:
        cls.__bases__ = saved


@contextmanager
def substituted(namespace: dict, **references) -> Iterator[None]:
    """Bind `references` (the course's answers to earlier problems) in `namespace` (a notebook's
    `globals()`) for the length of a test, so a later problem that calls earlier answers by name is
    graded on its own; the student's own functions come back afterwards.

        with substituted(globals(), top_k=course_top_k, top_p=course_top_p):
            tokens = sample(logits, params, generators)      # your sampler, the course's filters
    """
    if type(namespace) is not dict:
        raise TypeError(f"namespace must be a dict such as globals(), got {type(namespace).__name__}")
    missing = object()
    saved = {name: namespace.get(name, missing) for name in references}
    namespace.update(references)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                namespace.pop(name, None)
            else:
                namespace[name] = value


class Cases:
    """Partial credit for a test cell that checks many independent cases (request checks, a sampler's
    settings, allocator scenarios): each case that fails costs its share of the points, and the cell
    says which failed. nbgrader takes a test cell's numeric last value as its score, so the cell ends
    with `cases.score()`:

        cases = Cases(points=4)
        for body in BAD_BODIES:
            with cases(f"{body} is refused"):
                assert refused(body), "a 400 with a message that names the field"
        cases.score()

    A case fails on any exception (AssertionError or an error in the student's code); a timeout's
    interrupt is not caught. A cell with one property to check stays all or nothing: no Cases there.
    """

    MARK = "  \u2717 "          # how a failed case's line starts (the feedback page picks these lines)
    SHOWN = 12                 # failed cases listed; the rest are counted

    def __init__(self, points: float):
        if not points > 0:
            raise ValueError(f"points must be > 0, got {points!r}")
        self.points = float(points)
        self.passed: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self._name: str | None = None

    def __call__(self, name: str) -> "Cases":
        self._name = str(name)
        return self

    def __enter__(self) -> None:
        if self._name is None:
            raise TypeError("use `with cases(name):`, naming the case")

    def __exit__(self, etype, error, tb) -> bool:
        name, self._name = self._name, None
        if etype is None:
            self.passed.append(name)
            return False
        if not issubclass(etype, Exception):      # KeyboardInterrupt (the grader's timeout), SystemExit
            return False
        message = str(error) if etype is AssertionError and str(error) else f"{etype.__name__}: {error}"
        self.failed.append((name, message.splitlines()[0][:300] if message else etype.__name__))
        return True

    def score(self) -> float:
        """The points earned, in proportion to the cases passed; prints the cases that failed."""
        total = len(self.passed) + len(self.failed)
        if total == 0:
            raise AssertionError("no case ran: the test cell is broken")
        earned = round(self.points * len(self.passed) / total, 2)
        if self.failed:
            print(f"{len(self.failed)} of {total} cases failed ({earned:g} of {self.points:g} points):")
            for name, message in self.failed[:self.SHOWN]:
                print(f"{self.MARK}{name}: {message}")
            if len(self.failed) > self.SHOWN:
                print(f"  ... and {len(self.failed) - self.SHOWN} more")
        return earned
