"""The from-scratch decoder against transformers: tiny random models of both families, then the real one."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import course
from course.models import Decoder, ModelConfig, decoder_from_hf_state, init_weights
from course.tolerance import assert_orders_close, for_decoder, order_tol

VOCAB = 97


def tiny_llama(n_head=4, n_kv_head=2, tie=True):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=n_head, num_key_value_heads=n_kv_head, max_position_embeddings=64,
                      rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2():
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                     bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg).eval()


def _randomize(hf):
    """HF initializes norms to 1 and biases to 0: perturb everything so a wrong mapping shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


@pytest.mark.parametrize("make", [
    lambda: tiny_llama(4, 2), lambda: tiny_llama(4, 4), lambda: tiny_llama(4, 1),
    lambda: tiny_llama(4, 2, tie=False), tiny_gpt2,
], ids=["llama-gqa", "llama-mha", "llama-mqa", "llama-untied", "gpt2"])
def test_logits_match_transformers(make):
    hf = _randomize(make())
    ours = decoder_from_hf_state(ModelConfig.from_hf(hf.config), hf.state_dict())
    ids = torch.randint(0, VOCAB, (3, 19), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(19).expand(3, -1)
    with torch.no_grad():
        got, want = ours(ids, pos), hf(ids).logits
    # the same model written twice (other attention kernels, other op order): course/tolerance.py's budget
    assert_orders_close(got, want, **for_decoder(ours.cfg, context=19), what="logits vs transformers")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_in_half_precision_rounds_like_transformers(dtype):
    """One fused call on x as it is (no cast to float32 and back around it): PyTorch computes in
    float32 inside and rounds once, so the result is transformers' bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from course.models.decoder import RMSNorm

    theirs, ours = LlamaRMSNorm(64, eps=1e-5), RMSNorm(64, 1e-5)
    with torch.no_grad():
        w = 1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(2))
        theirs.weight.copy_(w)
        ours.weight.copy_(w)
    x = (3 * torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(3))).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours.to(dtype)(x), theirs.to(dtype)(x))


def test_positions_matter():
    """Position ids are really used. RoPE only sees distances between tokens, so a constant shift
    leaves Llama's output unchanged while learned absolute positions (GPT-2) change it; spreading
    the positions out changes both."""
    ids = torch.randint(0, VOCAB, (1, 8))
    base, shifted, spread = torch.arange(8)[None], torch.arange(8)[None] + 5, 2 * torch.arange(8)[None]
    for hf, shift_matters in ((_randomize(tiny_llama()), False), (_randomize(tiny_gpt2()), True)):
        ours = decoder_from_hf_state(ModelConfig.from_hf(hf.config), hf.state_dict())
        with torch.no_grad():
            a, b, c = ours(ids, base), ours(ids, shifted), ours(ids, spread)
        # RoPE at other angles rounds otherwise: equal within the budget of two orders; a real change is far larger
        tol = order_tol(a, **for_decoder(ours.cfg))
        assert (not torch.allclose(a, b, **tol)) == shift_matters
        assert not torch.allclose(a, c, **tol)


def test_causal():
    """Appending tokens never changes the logits of earlier positions."""
    hf = _randomize(tiny_llama())
    ours = decoder_from_hf_state(ModelConfig.from_hf(hf.config), hf.state_dict())
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        full = ours(ids, torch.arange(12)[None])
        prefix = ours(ids[:, :7], torch.arange(7)[None])
    assert_orders_close(full[:, :7], prefix, **for_decoder(ours.cfg), what="12 tokens vs their first 7")   # other shapes, other kernels


def test_bad_input_names_the_argument():
    model = init_weights(Decoder(ModelConfig.from_hf(tiny_llama().config)))
    ids = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match="input_ids must have shape"):
        model(ids, ids)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids[None], torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids must hold integers"):
        model(ids[None].float(), ids[None])
    with pytest.raises(ValueError, match="n_kv_head"):
        ModelConfig("llama", 10, 1, 4, 3, 64, 128, 32)
    with pytest.raises(ValueError, match="family"):
        ModelConfig("mamba", 10, 1, 4, 4, 64, 128, 32)


def test_offline_hub_model_names_the_default(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(course.ModelUnavailableError, match="SmolLM2-135M-Instruct"):
        course.load_model("gpt2")


@pytest.mark.slow
def test_real_model_matches_transformers():
    """SmolLM2-135M: our decoder and transformers agree on logits and on greedy text."""
    tok, ours, hf = course.load_tokenizer(), course.load_model(), course.load_hf_model()
    assert ours.num_parameters() == 134_515_008
    cfg = ours.cfg
    assert (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (30, 9, 3, 64)
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        got, want = ours(ids, torch.arange(ids.shape[1])[None]), hf(ids).logits
    assert_orders_close(got, want, **for_decoder(cfg), what="logits vs transformers")   # 30 layers: 1.2e-4 of the largest
    out = hf.generate(ids, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0]).startswith("The quick brown fox with a quick brown bear")


def test_tokenizer_always_has_a_pad_token():
    from course.models.loading import with_pad_token

    tok = course.load_tokenizer()
    assert tok.pad_token is not None and tok.pad_token_id == tok.eos_token_id, "the converted model's tokenizer has none"
    tok.pad_token = None                                   # a tokenizer that lacks one, whatever transformers did
    assert with_pad_token(tok).pad_token == tok.eos_token
    batch = tok(["a", "a longer prompt"], padding=True, return_tensors="pt")
    assert batch.input_ids.shape[0] == 2 and batch.attention_mask[0].sum() < batch.attention_mask[1].sum()
    tok.pad_token = tok.eos_token = None
    with pytest.raises(ValueError, match="pad"):
        with_pad_token(tok)


def test_convert_and_loading_do_not_import_each_other():
    """The model's name, its error and its cache location live in course.models.store; convert (makes
    the float32 copy) must not import loading (reads models), which calls convert lazily."""
    import ast
    from pathlib import Path
    import course.models as pkg

    root = Path(pkg.__file__).parent
    imports = {n.module for n in ast.walk(ast.parse((root / "convert.py").read_text()))
               if isinstance(n, ast.ImportFrom)}
    assert "course.models.loading" not in imports, "convert.py imports loading: the cycle is back"
