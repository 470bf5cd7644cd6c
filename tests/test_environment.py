"""course.setup() and course.timing: the first cell of every lab, and the clock every claim uses."""
import os
import subprocess
import sys

import pytest
import torch

import course
from course.environment import Environment
from course.timing import Timing, TokenTimer, benchmark, count_ops


def test_setup_seeds_every_rng_and_prints_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COURSE_QUICK", "1")
    env = course.setup(seed=7)
    a = torch.rand(3)
    line = capsys.readouterr().out.strip()
    env2 = course.setup(seed=7, verbose=False)
    assert torch.equal(a, torch.rand(3)), "same seed, same numbers"
    assert env == env2 and env.quick and env.device == "cpu" and env.triton_interpreted
    assert os.environ["TRITON_INTERPRET"] == "1", "no GPU: Triton kernels must run in the interpreter"
    assert len(line.splitlines()) == 1 and "torch" in line and "quick mode" in line and "seed 7" in line


def test_setup_puts_cudnn_attention_last_only_on_a_gpu_and_respects_a_choice(monkeypatch):
    from course.environment import CUDNN_SDPA_ENV, prefer_flash_attention

    monkeypatch.setenv(CUDNN_SDPA_ENV, "")        # so that monkeypatch restores the variable as it was
    monkeypatch.delenv(CUDNN_SDPA_ENV)
    course.setup(device="cpu", verbose=False)
    assert CUDNN_SDPA_ENV not in os.environ, "on a CPU setup() leaves PyTorch's attention order alone"
    prefer_flash_attention()                      # what setup() does on a GPU, before any attention call
    assert os.environ[CUDNN_SDPA_ENV] == "1"
    monkeypatch.setenv(CUDNN_SDPA_ENV, "0")       # a student who wants PyTorch's own order keeps it
    prefer_flash_attention()
    assert os.environ[CUDNN_SDPA_ENV] == "0"


def test_setup_warns_when_the_installed_triton_and_numpy_break_the_interpreter(capsys, monkeypatch):
    """Triton 3.4-3.6's interpreter fails with NumPy >= 2.4 (lab 06 on a CPU): setup() says so, on stdout,
    naming both versions and the fix; other pairs get no warning."""
    from importlib import metadata

    from course.environment import interpreter_problem

    said = interpreter_problem("3.6.0", "2.4.6")
    assert said and "Triton 3.6.0" in said and "NumPy 2.4.6" in said and 'numpy<2.4' in said and "3.7" in said
    assert interpreter_problem("3.4.0", "2.4.0rc1") and interpreter_problem("3.5.1", "3.0.0")
    for fine in (("3.7.0", "2.4.6"), ("3.7.1+git0abc", "2.4.6"), ("3.6.0", "2.3.5"), ("3.9.0", "1.26.4"), ("x", "2.4.6")):
        assert interpreter_problem(*fine) is None, fine
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: {"triton": "3.6.0", "numpy": "2.4.6"}.get(name) or real(name))
    course.setup(device="cpu", verbose=False)
    out = capsys.readouterr()
    assert "warning: Triton 3.6.0 cannot run kernels in its interpreter" in out.out and not out.err
    monkeypatch.setattr(metadata, "version", lambda name: {"triton": "3.7.1", "numpy": "2.4.6"}.get(name) or real(name))
    course.setup(device="cpu", verbose=False)
    assert capsys.readouterr().out == ""


def test_pick_sizes_demos_by_mode_and_device():
    cpu_full, cpu_quick = Environment("cpu", False, True, 0), Environment("cpu", True, True, 0)
    gpu = Environment("cuda", False, False, 0)
    assert cpu_full.pick(100, 10) == 100 and cpu_quick.pick(100, 10) == 10
    assert cpu_full.pick(100, 10, cpu=40) == 40 and gpu.pick(100, 10, cpu=40) == 100
    assert cpu_quick.pick(100, 10, cpu=40) == 10, "quick mode wins everywhere"


def test_setup_rejects_bad_arguments():
    with pytest.raises(ValueError, match="device must be"):
        course.setup(device="tpu", verbose=False)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        course.setup(device="cuda", verbose=False)
    with pytest.raises(TypeError, match="seed must be an int"):
        course.setup(seed="0", verbose=False)


def test_setup_keeps_library_warnings_off_stderr():
    """nbgrader scores a test cell 0 when anything reaches stderr: after setup(), warnings and
    transformers' logging must not."""
    code = ("import course, warnings, logging; course.setup(verbose=False); "
            "warnings.warn('deprecated thing'); logging.getLogger('transformers').warning('noise'); "
            "import transformers; transformers.logging.get_logger('transformers.generation').warning('more')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"stderr after setup(): {result.stderr!r}"


def test_benchmark_warms_up_then_takes_the_median():
    calls = []
    t = benchmark(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and len(t.runs) == 5 and t.median >= 0
    assert Timing([3.0, 1.0, 2.0]).median == 2.0
    with pytest.raises(ValueError, match="repeats"):
        benchmark(lambda: None, repeats=0)


def test_count_ops_counts_what_computes_and_not_views():
    x, w = torch.ones(2, 3, 4), torch.ones(5, 4)
    got = count_ops(lambda: (x.transpose(0, 1)[:, :1].reshape(-1, 4) * 2).sum())
    assert got == {"mul": 1, "sum": 1}, got
    got = count_ops(lambda: (x.add_(1), torch.nn.functional.linear(x, w)))
    assert got == {"add_": 1, "mm": 1}, f"in place counts, a matmul counts, its reshapes do not: {got}"
    assert count_ops(lambda: x.contiguous().view(6, 4)) == {}, "a contiguous tensor is not copied"


def test_token_timer_records_one_time_per_generated_token():
    timer = TokenTimer()
    timer.put(torch.tensor([[1, 2, 3]]))          # generate() first hands over the prompt
    for tok in (7, 8, 9):
        timer.put(torch.tensor([tok]))
    timer.end()
    assert timer.tokens == [7, 8, 9] and len(timer.times) == 3
    assert timer.times == sorted(timer.times) and timer.times[0] >= 0


@pytest.mark.xdist_group("probe")
def test_xdist_groups_are_honoured(request):
    """`make test` relies on `--dist loadgroup` to keep a lab's tests (and the class graded in
    test_grade.py) on one worker; pytest 9.2 silently broke that (pyproject pins 9.1)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("only meaningful under pytest -n N --dist loadgroup, as make test runs")
    assert request.node.nodeid.endswith("@probe"), f"xdist_group ignored: {request.node.nodeid}"
