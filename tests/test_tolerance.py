"""course.tolerance: the budget for two computation orders admits what CPU kernels do and refuses what bugs do."""
import pytest
import torch

from course.models import ModelConfig
from course.tolerance import ULPS, assert_orders_close, for_decoder, order_tol
from tiny_models import tiny_configs

TINY = tiny_configs(vocab_size=64, max_seq_len=64)["llama-gqa"]
SMOLLM2 = ModelConfig(family="llama", vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_ff=1536,
                      max_seq_len=8192)


def test_budget_grows_with_terms_stages_and_scale():
    want = torch.tensor([10.0, -3.0])
    tol = order_tol(want, terms=64, stages=3)
    assert tol["rtol"] == 0.0
    assert tol["atol"] == pytest.approx(ULPS * torch.finfo(torch.float32).eps * 7 * 3 ** 0.5 * 10.0)
    assert order_tol(want, terms=8192, stages=3)["atol"] == pytest.approx(2 * tol["atol"]), "log2(2 terms)"
    assert order_tol(want, terms=64, stages=12)["atol"] == pytest.approx(2 * tol["atol"]), "sqrt(stages)"
    assert order_tol(2 * want, terms=64, stages=3)["atol"] == pytest.approx(2 * tol["atol"])
    assert order_tol(want.double(), terms=64, stages=3)["atol"] < 1e-10, "float64 ulps are 2^29 times smaller"
    assert for_decoder(TINY) == {"terms": 64, "stages": 3}
    assert for_decoder(TINY, context=100) == {"terms": 100, "stages": 3}


def test_what_avx512_kernels_do_passes_and_what_a_bug_does_fails():
    want = torch.linspace(-10.05, 10.05, 64)
    # the AVX-512 run that started this: logits up to 10.05 off by 1.645e-5 in a 2-layer tiny Llama
    assert_orders_close(want + 1.645e-5, want, **for_decoder(TINY))
    for bug in (1e-1, 1e-2, 1e-3):                      # a wrong position, mask or scale: 1e-1 and more
        with pytest.raises(AssertionError, match="decode step"):
            assert_orders_close(want + bug, want, **for_decoder(TINY), what="decode step")
    real = torch.linspace(-20.0, 20.0, 64)              # SmolLM2-135M, 30 layers: 1.2e-4 of the largest logit
    assert_orders_close(real + 1e-3, real, **for_decoder(SMOLLM2))
    with pytest.raises(AssertionError):
        assert_orders_close(real + 1e-1, real, **for_decoder(SMOLLM2))


def test_bad_input():
    with pytest.raises(ValueError, match="float32 or float64"):
        order_tol(torch.ones(2, dtype=torch.bfloat16), terms=8)
    with pytest.raises(ValueError, match="float32 or float64"):
        order_tol([1.0], terms=8)
    with pytest.raises(ValueError, match="terms and stages"):
        order_tol(torch.ones(2), terms=0)
    with pytest.raises(ValueError, match="terms and stages"):
        order_tol(torch.ones(2), terms=8, stages=1.5)
