"""course.quant (lab 10's given parts) on small data: the GGUF tensor index against gguf's own
reader and writer, Q4_1 bytes cut and glued, perplexity under masks and KV transforms against the
plain decoder, the 8-bit KV pool against dense attention, and dequantize-then-matmul layers.

The quantizers here are written in the tests (the lab's answers are not in the package)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from course.engine import PagedKVCache, paged_attention, write_kv
from course.models import Decoder, ModelConfig, init_weights
from course.quant import (
    HELDOUT, QuantKVPool, QuantLinear, attention_to_first, block_linears, dequantize, dequantize_reference, forward_logits,
    fp8_native, gguf_tensor, heldout_text, join_q4_1, linear_bytes, linear_params, max_weight_change, model_param,
    perplexity, quantize_linears, read_gguf, rolling_mean, split_q4_1, token_nll,
)
from course.tolerance import assert_orders_close, for_decoder

CFG = ModelConfig(family="llama", vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, max_seq_len=64)


@pytest.fixture(scope="module")
def tiny():
    return init_weights(Decoder(CFG), std=0.2, seed=3).eval()


def int8_head(x):
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (x / s).round().clamp(-127, 127).to(torch.int8), s


def fp8_head(x):
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


# --- GGUF ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A GGUF file written by gguf's own writer: string and array metadata, then F32, Q4_1 and Q8_0 tensors."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    w.add_uint32("llama.block_count", 1)
    tensors = {"norm.weight": (rng.standard_normal(8).astype(np.float32), gguf.GGMLQuantizationType.F32),
               "blk.0.attn_v.weight": (rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1),
               "token_embd.weight": (rng.standard_normal((3, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)}
    for name, (x, kind) in tensors.items():
        data = x if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(x, kind)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tensors


def test_tensor_index_matches_gguf_reader_on_a_written_file(small_gguf):
    import gguf

    path, made = small_gguf
    mine = read_gguf(path)
    theirs = gguf.GGUFReader(path).tensors
    assert [t.name for t in mine] == [t.name for t in theirs] == list(made)
    for a, b in zip(mine, theirs):
        assert a.kind == b.tensor_type.name and a.shape == tuple(reversed(b.shape.tolist()))
        assert np.array_equal(a.raw, np.asarray(b.data)) and a.raw.dtype == np.asarray(b.data).dtype
    v = next(t for t in mine if t.name == "blk.0.attn_v.weight")
    assert v.shape == (4, 64) and v.raw.shape == (4, 40) and v.bits_per_weight == 5.0
    back = dequantize_reference(v)
    x = made["blk.0.attn_v.weight"][0]
    assert back.shape == (4, 64) and back.dtype == torch.float32
    assert float((back - torch.from_numpy(x)).abs().max()) < 0.2      # 4 bits: within half a step


def test_split_and_join_q4_1_are_inverse(small_gguf):
    path, _ = small_gguf
    raw = gguf_tensor("blk.0.attn_v.weight", path).raw_tensor()
    d, m, qs = split_q4_1(raw)
    assert d.dtype == m.dtype == torch.float16 and qs.dtype == torch.uint8
    assert d.shape == m.shape == (4, 2) and qs.shape == (4, 2, 16)
    assert torch.equal(join_q4_1(d, m, qs), raw)
    codes = torch.cat([qs & 15, qs >> 4], -1).float()                # the format: low nibbles first
    w = (codes * d.float()[..., None] + m.float()[..., None]).reshape(4, 64)
    assert torch.equal(w, dequantize_reference(gguf_tensor("blk.0.attn_v.weight", path)))
    d2, m2, qs2 = split_q4_1(torch.zeros(2, 3 * 36, dtype=torch.uint8), group_size=64)
    assert qs2.shape == (2, 3, 32)


def test_q4_1_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="uint8 tensor"):
        split_q4_1(torch.zeros(2, 21, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8 tensor"):
        split_q4_1(torch.zeros(2, 20))
    with pytest.raises(ValueError, match="float16"):
        join_q4_1(torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.float16), torch.zeros(1, 1, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(rows, G\)"):
        join_q4_1(torch.zeros(1, 2, dtype=torch.float16), torch.zeros(1, 2, dtype=torch.float16),
                  torch.zeros(1, 3, 16, dtype=torch.uint8))


def test_gguf_errors_name_the_problem(tmp_path, small_gguf):
    path, _ = small_gguf
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        gguf_tensor("nope", path)
    with pytest.raises(FileNotFoundError, match="must be a GGUF file"):
        read_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(bad)


def test_model_param_names():
    assert model_param("blk.3.ffn_up.weight") == "blocks.3.mlp.up_proj.weight"
    assert model_param("blk.0.attn_output.weight") == "blocks.0.attn.o_proj.weight"
    assert model_param("token_embd.weight") == "embed.weight" and model_param("output_norm.weight") == "norm.weight"
    with pytest.raises(KeyError):
        model_param("blk.0.unknown.weight")


@pytest.mark.slow
def test_the_course_models_file():
    """The real file: 272 tensors; Q4_1 decodes to the converted model's weights (v_proj is not permuted)."""
    import course

    tensors = read_gguf()
    assert len(tensors) == 272 and {t.kind for t in tensors} == {"Q4_1", "Q8_0", "F32"}
    t = gguf_tensor("blk.0.attn_v.weight")
    w = dequantize_reference(t)
    model = course.load_model()
    assert torch.equal(w, model.blocks[0].attn.v_proj.weight)
    d, m, qs = split_q4_1(t.raw_tensor())
    codes = torch.cat([qs & 15, qs >> 4], -1).float()
    assert torch.equal((codes * d.float()[..., None] + m.float()[..., None]).reshape(t.shape), w)


# --- perplexity -----------------------------------------------------------------------------------

def test_forward_logits_is_the_models_forward(tiny):
    ids = torch.randint(0, 61, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny(ids[None], torch.arange(20)[None])[0]
    # the decoder's own forward vs forward_logits' SDPA calls (is_causal, a bool mask): sums in other orders
    assert_orders_close(forward_logits(tiny, ids), want, **for_decoder(CFG))
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    assert_orders_close(forward_logits(tiny, ids.tolist(), attn_mask=causal), want, **for_decoder(CFG), what="bool mask")
    assert_orders_close(forward_logits(tiny, ids, kv_transform=lambda x: x.clone()), want, **for_decoder(CFG),
                        what="kv_transform")


def test_a_window_mask_changes_only_the_rows_it_hides_something_from(tiny):
    """A window of 3: the first 3 queries see everything (the model's logits on those tokens); the last does not."""
    ids = torch.randint(0, 61, (12,), generator=torch.Generator().manual_seed(1))
    window = torch.ones(12, 12, dtype=torch.bool).tril() & ~torch.ones(12, 12, dtype=torch.bool).tril(-3)
    got = forward_logits(tiny, ids, attn_mask=window)
    assert_orders_close(got[:3], forward_logits(tiny, ids[:3]), **for_decoder(CFG))   # the first 3 rows see everything
    assert not torch.allclose(got[-1], forward_logits(tiny, ids)[-1], atol=1e-3)      # 15x the budget above: hid something


def test_token_nll_and_perplexity(tiny):
    ids = torch.randint(0, 61, (16,), generator=torch.Generator().manual_seed(2))
    nll = token_nll(tiny, ids)
    assert nll.shape == (15,) and nll.device.type == "cpu" and nll.dtype == torch.float32
    logits = forward_logits(tiny, ids)
    assert torch.allclose(nll, F.cross_entropy(logits[:-1], ids[1:], reduction="none"), atol=1e-6)
    assert perplexity(nll) == pytest.approx(math.exp(nll.double().mean()))
    assert perplexity(nll, 10) == pytest.approx(math.exp(nll[10:].double().mean()))
    assert torch.allclose(rolling_mean(torch.arange(6.0), 3), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    quantized = token_nll(tiny, ids, kv_transform=lambda x: dequantize(*int8_head(x)))
    assert (quantized - nll).abs().max() < 0.05


def test_attention_to_first(tiny):
    ids = list(range(10))
    shares = attention_to_first(tiny, ids, n_first=1, from_pos=5)
    assert len(shares) == CFG.n_layer and all(0 < s < 1 for s in shares)
    assert attention_to_first(tiny, ids, n_first=5, from_pos=5)[0] > shares[0]


@pytest.mark.parametrize("call, message", [
    (lambda m: token_nll(m, [3]), "at least 2 tokens"),
    (lambda m: token_nll(m, torch.zeros(2, 4, dtype=torch.long)), r"\(T,\) or \(1, T\)"),
    (lambda m: token_nll(m, torch.zeros(5)), "long tensor"),
    (lambda m: forward_logits(m, [1, 2, 3], attn_mask=torch.ones(3, 3)), "bool tensor"),
    (lambda m: forward_logits(m, [1, 2, 3], attn_mask=torch.ones(2, 2, dtype=torch.bool)), r"bool tensor \(3, 3\)"),
    (lambda m: forward_logits(m, [1, 2, 3], attn_mask=torch.zeros(3, 3, dtype=torch.bool)), "see itself"),
    (lambda m: forward_logits(m, [1, 2, 3], kv_transform=lambda x: x[:1]), "kv_transform must return"),
    (lambda m: perplexity(torch.zeros(3), 3), "start within it"),
    (lambda m: rolling_mean(torch.zeros(3), 4), "between 1 and"),
    (lambda m: attention_to_first(m, [1, 2, 3, 4], n_first=3, from_pos=2), "n_first <= from_pos"),
])
def test_perplexity_helpers_reject_bad_input(tiny, call, message):
    with pytest.raises(ValueError, match=message):
        call(tiny)


def test_heldout_text_ships_with_the_course():
    text = heldout_text()
    assert HELDOUT.is_file() and (HELDOUT.parent / "README_heldout.md").is_file()
    assert 15_000 < len(text) < 60_000 and "Gull Point" in text and text.isascii()


# --- the 8-bit KV pool ----------------------------------------------------------------------------

def _dense(q, k, v, scale):
    """q (B, H, D), k, v (B, L, Hkv, D): plain softmax attention in float64."""
    g = q.shape[1] // k.shape[2]
    kk, vv = k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bhd,blhd->bhl", q.double(), kk) * scale
    return torch.einsum("bhl,blhd->bhd", s.softmax(-1), vv)


@pytest.mark.parametrize("storage, quantize, scales, tol", [
    (torch.int8, int8_head, "head", 0.02),
    (torch.float8_e4m3fn, fp8_head, "head", 0.15),
    (torch.int8, lambda x: (lambda a: ((x / a).round().clamp(-127, 127).to(torch.int8), a))(
        x.abs().amax((-2, -1), keepdim=True) / 127), "token", 0.02),
])
def test_quant_pool_attention_matches_dense_attention(storage, quantize, scales, tol):
    g = torch.Generator().manual_seed(4)
    bs, lens = 4, [5, 9]
    pool = QuantKVPool(CFG, n_blocks=8, block_size=bs, storage=storage, scales=scales)
    tables = [[6, 1], [0, 3, 7]]
    ks, vs = [], []
    for t, L in zip(tables, lens):
        k, v = torch.randn(L, 2, 8, generator=g), torch.randn(L, 2, 8, generator=g)
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(L)])
        pool.write(1, k, v, slots, quantize)
        ks.append(k); vs.append(v)
    q = torch.randn(2, 4, 8, generator=g)
    bt = torch.tensor([[6, 1, 0], [0, 3, 7]], dtype=torch.int32)
    out = pool.attention(1, q, bt, torch.tensor(lens), 1 / math.sqrt(8))
    assert out.shape == (2, 4, 8) and out.dtype == torch.float32
    for b in range(2):
        want = _dense(q[b:b + 1], ks[b][None], vs[b][None], 1 / math.sqrt(8))[0]
        assert (out[b].double() - want).abs().max() < tol
    assert pool.bytes_per_token() == 2 * CFG.n_layer * (2 * 8 + (2 if scales == "head" else 1) * 4)
    assert pool.k.dtype == storage and pool.bytes_reserved() == pool.k.nbytes * 2 + pool.k_scale.nbytes * 2


def test_quant_pool_with_one_scale_per_layer_and_skipped_slots():
    pool = QuantKVPool(CFG, n_blocks=2, block_size=4, storage=torch.float8_e4m3fn, scales="tensor")
    x = torch.randn(3, 2, 8)
    pool.write(0, x, x, torch.tensor([0, -1, 5]), lambda x: (x.to(torch.float8_e4m3fn), torch.ones(())))
    assert pool.bytes_per_token() == 2 * CFG.n_layer * 16
    k, _ = pool.gather(0, torch.tensor([[0, 1]], dtype=torch.int32))
    assert torch.equal(k[0, 0], x[0].to(torch.float8_e4m3fn).float()) and torch.equal(k[0, 5], x[2].to(torch.float8_e4m3fn).float())
    assert not k[0, 1].any(), "slot -1 is skipped"
    with pytest.raises(ValueError, match="one scale"):
        pool.write(0, x, x, torch.tensor([0, 1, 2]), lambda x: (x.to(torch.float8_e4m3fn), torch.rand(3, 1, 1) + 1))


def test_quant_pool_rejects_bad_input():
    with pytest.raises(ValueError, match="storage"):
        QuantKVPool(CFG, 2, 4, storage=torch.float16)
    with pytest.raises(ValueError, match="scales"):
        QuantKVPool(CFG, 2, 4, scales="row")
    with pytest.raises(ValueError, match="positive int"):
        QuantKVPool(CFG, 0, 4)
    with pytest.raises(TypeError, match="ModelConfig"):
        QuantKVPool("cfg", 2, 4)
    pool = QuantKVPool(CFG, 2, 4)
    x = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="codes"):
        pool.write(0, x, x, torch.tensor([0, 1]), lambda x: (x, torch.ones(2, 2, 1)))
    with pytest.raises(ValueError, match="scales of shape"):
        pool.write(0, x, x, torch.tensor([0, 1]), lambda x: (x.to(torch.int8), torch.ones(2, 1, 1)))
    with pytest.raises(ValueError, match=r"\(N, 2, 8\)"):
        pool.write(0, x, x[:, :1], torch.tensor([0, 1]), int8_head)


def test_dequantize_and_fp8_native():
    q, s = int8_head(torch.tensor([[[0.0, 1.0, -2.0]]]))
    assert torch.allclose(dequantize(q, s), torch.tensor([[[0.0, 1.0, -2.0]]]), atol=1e-2)
    assert dequantize(q, s, torch.bfloat16).dtype == torch.bfloat16
    assert fp8_native("cpu") is False
    with pytest.raises(TypeError):
        dequantize([1], s)


def test_quant_pool_agrees_with_the_float_pool_on_what_it_stores():
    """Written through a quantizer that is exact for these values, the pool reads what lab 05's pool reads."""
    g = torch.Generator().manual_seed(5)
    k = torch.randint(-127, 128, (8, 2, 8), generator=g).float() / 4
    v = torch.randint(-127, 128, (8, 2, 8), generator=g).float() / 4
    plain = PagedKVCache(CFG, 4, 4)
    write_kv(*plain.layer(0), k, v, torch.arange(8))
    pool = QuantKVPool(CFG, 4, 4)
    pool.write(0, k, v, torch.arange(8), lambda x: ((x * 4).to(torch.int8), torch.full((x.shape[0], 2, 1), 0.25)))
    q = torch.randn(1, 4, 8, generator=g)
    bt, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([7])
    # the same einsums on the same values: equal up to the last bit, whatever the CPU
    assert torch.allclose(pool.attention(0, q, bt, lens, 0.3), paged_attention(q, *plain.layer(0), bt, lens, 0.3), atol=1e-6)


# --- dequantize-then-matmul -----------------------------------------------------------------------

def test_quantize_linears_identity_changes_nothing(tiny):
    ids = torch.randint(0, 61, (10,), generator=torch.Generator().manual_seed(6))
    same = quantize_linears(tiny, lambda w: (w.clone(),), lambda w: w)
    # QuantLinear runs q, k, v as three matmuls where nn.Linear's are stacked into one: sums in other orders
    assert_orders_close(forward_logits(same, ids), forward_logits(tiny, ids), **for_decoder(CFG))
    assert isinstance(same.blocks[0].attn.q_proj, QuantLinear) and isinstance(tiny.blocks[0].attn.q_proj, torch.nn.Linear)
    assert same.embed.weight is tiny.embed.weight, "the copy shares what it does not quantize"
    assert linear_bytes(same) == linear_bytes(tiny) == 4 * linear_params(tiny)
    assert max_weight_change(tiny, same) == 0.0
    assert "stores" in repr(same.blocks[0].attn.q_proj)


def test_quantize_linears_int8_per_channel(tiny):
    q8 = quantize_linears(tiny, lambda w: int8_head(w), dequantize)
    n = linear_params(tiny)
    rows = sum(m.out_features for _, m in block_linears(tiny))
    assert linear_bytes(q8) == n + 4 * rows
    assert 0 < max_weight_change(tiny, q8) < 0.2 * 4 / 127
    ids = torch.randint(0, 61, (10,), generator=torch.Generator().manual_seed(7))
    assert (forward_logits(q8, ids) - forward_logits(tiny, ids)).abs().max() < 0.1


def test_quantize_linears_rejects_bad_input(tiny):
    with pytest.raises(TypeError, match="course Decoder"):
        quantize_linears(torch.nn.Linear(2, 2), lambda w: (w,), lambda w: w)
    with pytest.raises(ValueError, match="rebuild a weight"):
        quantize_linears(tiny, lambda w: (w,), lambda w: w.T)
    q = quantize_linears(tiny, lambda w: (w,), lambda w: w)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_linears(q, lambda w: (w,), lambda w: w)
    with pytest.raises(TypeError, match="tuple of tensors"):
        QuantLinear((), lambda: None, 2, 2)
