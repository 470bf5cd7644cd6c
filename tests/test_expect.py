"""course.expect: the checks every graded test runs on an answer before comparing it."""
import numpy as np
import pytest
import torch

from course.expect import (expect_bool, expect_float, expect_floats, expect_int, expect_ints, expect_tensor, graded_alone,
                           expect_tuple, expect_type)


class Yes:
    """The hostile answer: every attribute is itself, every comparison and truth test says yes, and
    torch functions called on it answer through it."""

    def __getattr__(self, name):
        return self

    def __call__(self, *a, **k):
        return self

    def __eq__(self, other):
        return True

    def __bool__(self):
        return True

    def __len__(self):
        return 1

    def __iter__(self):
        return iter([self])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True


class Sub(torch.Tensor):
    """A tensor subclass: it could rewrite torch.equal for itself."""


def test_a_look_alike_passes_naive_comparisons_but_not_the_checks():
    fake = Yes()
    assert fake.shape == (1, 5) and torch.equal(fake, torch.zeros(1, 5)), "the attack must work on a naive test"
    for check in (lambda: expect_tensor(fake, "f()"), lambda: expect_int(fake, "f()"), lambda: expect_ints(fake, "f()"),
                  lambda: expect_float(fake, "f()"), lambda: expect_bool(fake, "f()"), lambda: expect_tuple(fake, "f()", 2),
                  lambda: expect_type(fake, "f()", dict), lambda: expect_ints([fake], "f()")):
        with pytest.raises(AssertionError, match=r"f\(\)"):
            check()


def test_a_tensor_subclass_is_refused_with_a_reason():
    with pytest.raises(AssertionError, match="subclass of torch.Tensor"):
        expect_tensor(torch.zeros(3).as_subclass(Sub), "out")


def test_dtype_shape_device_and_finite():
    x = torch.zeros(2, 3, dtype=torch.long)
    assert expect_tensor(x, "x", dtype=torch.long, shape=(2, None), ndim=2, device="cpu") is x
    with pytest.raises(AssertionError, match=r"dtype torch.int64.*got torch.float32"):
        expect_tensor(x.float(), "x", dtype=torch.long)
    with pytest.raises(AssertionError, match=r"shape \(2, 4\), got \(2, 3\)"):
        expect_tensor(x, "x", shape=(2, 4))
    with pytest.raises(AssertionError, match=r"shape \(6,\), got \(2, 3\)"):
        expect_tensor(x, "x", shape=(6,))
    with pytest.raises(AssertionError, match="must be on cuda"):
        expect_tensor(x, "x", device="cuda")
    with pytest.raises(AssertionError, match="NaN or inf"):
        expect_tensor(torch.tensor([1.0, float("nan")]), "x", finite=True)
    assert expect_tensor(torch.zeros(1, dtype=torch.float16), "x", dtype=(torch.float16, torch.bfloat16)) is not None


def test_scalars_and_lists_want_plain_python_values():
    assert expect_int(3, "n", min=0) == 3
    for bad, hint in ((True, "bool"), (np.int64(3), "int\\(\\.\\.\\.\\)"), (torch.tensor(3), "int\\(\\.\\.\\.\\)"), (3.0, "float")):
        with pytest.raises(AssertionError, match=hint):
            expect_int(bad, "n")
    with pytest.raises(AssertionError, match="at least 0"):
        expect_int(-1, "n", min=0)
    assert expect_float(2, "x") == 2.0 and type(expect_float(2, "x")) is float
    with pytest.raises(AssertionError, match="item"):
        expect_float(torch.tensor(0.5), "x")
    with pytest.raises(AssertionError, match="finite"):
        expect_float(float("nan"), "x")
    assert expect_ints([1, 2], "ids", length=2) == [1, 2]
    with pytest.raises(AssertionError, match=r"ids\[1\].*tolist"):
        expect_ints([1, torch.tensor(2)], "ids")
    with pytest.raises(AssertionError, match="a list of Python ints, got tuple"):
        expect_ints((1, 2), "ids")
    assert expect_ints((1, 2), "ids", container=(list, tuple)) == [1, 2]
    with pytest.raises(AssertionError, match="3 items, got 2"):
        expect_ints([1, 2], "ids", length=3)
    assert expect_floats([1, 0.5], "p") == [1.0, 0.5]
    assert expect_bool(False, "ok") is False
    with pytest.raises(AssertionError, match="None"):
        expect_tuple(None, "kv", 2)
    assert expect_type({}, "d", dict) == {}


def test_graded_alone_runs_a_subclass_on_the_reference_base_and_puts_it_back():
    class Broken:
        def f(self):
            return -1

    class Ref:
        def f(self):
            return 1

    class Mine(Broken):
        def g(self):
            return super().f() + 1

    with graded_alone(Mine, Ref):
        assert Mine().g() == 2
    assert Mine.__bases__ == (Broken,) and Mine().g() == 0
    with pytest.raises(AssertionError, match="must be a class"):
        with graded_alone(lambda: 0, Ref):
            pass


def test_substituted_binds_references_for_one_test_and_puts_the_students_back():
    from course.expect import substituted

    ns = {"f": lambda: "student"}
    exec("def g():\n    return f()", ns)
    with substituted(ns, f=lambda: "course", h=1):
        assert ns["g"]() == "course" and ns["h"] == 1
    assert ns["g"]() == "student" and "h" not in ns
