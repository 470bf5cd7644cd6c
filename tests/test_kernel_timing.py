"""`course.kernels.timing`: how many input copies outrun the L2 cache, the copies themselves, and the
errors `bench_replayed` gives off a GPU. The timing itself runs in lab 06 on a GPU (the GPU proof)."""
import pytest
import torch

from course.kernels import bench_replayed, copies_to_outrun_l2
from course.kernels.timing import input_copies

MB = 1 << 20


def test_copies_fill_the_cache_twice_before_a_copy_comes_back():
    for nbytes, l2 in ((25 * MB, 50 * MB), (50 * MB, 50 * MB), (3 * MB, 50 * MB), (200 * MB, 50 * MB), (1, 0)):
        n = copies_to_outrun_l2(nbytes, l2)
        assert n >= 2, "a copy must never be reread at once"
        assert (n - 1) * nbytes >= 2 * l2, "the other copies must fill the L2 cache twice"
        assert n == 2 or (n - 2) * nbytes < 2 * l2, "no more copies than that"
    assert copies_to_outrun_l2(25 * MB, 50 * MB) == 5
    for bad in ((0, MB), (-1, MB)):
        with pytest.raises(ValueError, match="nbytes"):
            copies_to_outrun_l2(*bad)
    with pytest.raises(ValueError, match="l2_bytes"):
        copies_to_outrun_l2(MB, -1)


def test_input_copies_clone_tensors_and_share_the_rest():
    q, k = torch.randn(4, 64), torch.randn(16, 64)   # 1 KiB + 4 KiB of float32
    sets = input_copies((q, k, 0.125), l2_bytes=10 * 1024)
    assert len(sets) == copies_to_outrun_l2(5 * 1024, 10 * 1024) == 5
    assert sets[0][0] is q and sets[0][1] is k, "the first set is the caller's own arguments"
    for qc, kc, scale in sets[1:]:
        assert scale == 0.125
        assert torch.equal(qc, q) and torch.equal(kc, k), "a copy holds the same values"
        assert qc.data_ptr() != q.data_ptr() and kc.data_ptr() != k.data_ptr(), "in memory of its own"
    assert len({s[1].data_ptr() for s in sets}) == len(sets)
    with pytest.raises(ValueError, match="tensor argument"):
        input_copies((1, 2.0), l2_bytes=MB)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error off a GPU")
def test_bench_replayed_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA device"):
        bench_replayed(torch.add, torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match="fn must be"):
        bench_replayed("not a function", torch.ones(2))
    with pytest.raises(ValueError, match="tensor argument"):
        bench_replayed(lambda: None)
