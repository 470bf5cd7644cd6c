"""Map a Hugging Face state dict onto our `Decoder`: same numbers, our names."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from course.models.config import ModelConfig
from course.models.decoder import Decoder


def _llama_names(cfg: ModelConfig) -> dict[str, str]:
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{ours}attn.{p}.weight"] = f"{theirs}self_attn.{p}.weight"
        for p in ("gate_proj", "up_proj", "down_proj"):
            names[f"{ours}mlp.{p}.weight"] = f"{theirs}mlp.{p}.weight"
        names[f"{ours}attn_norm.weight"] = f"{theirs}input_layernorm.weight"
        names[f"{ours}mlp_norm.weight"] = f"{theirs}post_attention_layernorm.weight"
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _gpt2_state(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2 stores q, k, v fused in one `c_attn` and uses Conv1D, whose weight is (in, out):
    split the fusion and transpose into nn.Linear's (out, in)."""
    pre = "transformer." if "transformer.wte.weight" in sd else ""
    out = {
        "embed.weight": sd[f"{pre}wte.weight"], "pos_embed.weight": sd[f"{pre}wpe.weight"],
        "norm.weight": sd[f"{pre}ln_f.weight"], "norm.bias": sd[f"{pre}ln_f.bias"],
    }
    for i in range(cfg.n_layer):
        h, b = f"{pre}h.{i}.", f"blocks.{i}."
        qkv_w = sd[f"{h}attn.c_attn.weight"].t()                 # (3C, C)
        qkv_b = sd[f"{h}attn.c_attn.bias"]                        # (3C,)
        for name, w, bias in zip(("q_proj", "k_proj", "v_proj"), qkv_w.chunk(3), qkv_b.chunk(3)):
            out[f"{b}attn.{name}.weight"], out[f"{b}attn.{name}.bias"] = w, bias
        out[f"{b}attn.o_proj.weight"] = sd[f"{h}attn.c_proj.weight"].t()
        out[f"{b}attn.o_proj.bias"] = sd[f"{h}attn.c_proj.bias"]
        out[f"{b}mlp.fc.weight"], out[f"{b}mlp.fc.bias"] = sd[f"{h}mlp.c_fc.weight"].t(), sd[f"{h}mlp.c_fc.bias"]
        out[f"{b}mlp.proj.weight"], out[f"{b}mlp.proj.bias"] = sd[f"{h}mlp.c_proj.weight"].t(), sd[f"{h}mlp.c_proj.bias"]
        for ln, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            out[f"{b}{ours}.weight"], out[f"{b}{ours}.bias"] = sd[f"{h}{ln}.weight"], sd[f"{h}{ln}.bias"]
    return out


def convert_state_dict(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameter names -> tensors, from a transformers Llama or GPT-2 state dict."""
    if cfg.family == "gpt2":
        return _gpt2_state(cfg, hf_state)
    names = _llama_names(cfg)
    missing = [theirs for theirs in names.values() if theirs not in hf_state]
    if missing:
        raise KeyError(f"the state dict lacks {len(missing)} Llama weights, e.g. {missing[:3]}")
    return {ours: hf_state[theirs] for ours, theirs in names.items()}


class _SkipInit(TorchFunctionMode):
    """Skips `torch.nn.init`'s random fills (a meta tensor's `normal_` imports torch._dynamo: ~1.5 s
    of every lab's start-up, for numbers nobody keeps)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def meta_model(cfg: ModelConfig, cls: type = Decoder) -> Decoder:
    """`cls(cfg)` on the meta device: every shape, no memory, no random init. The caller assigns
    every weight (`load_state_dict(..., assign=True)`)."""
    with torch.device("meta"), _SkipInit():
        return cls(cfg)


def decoder_from_hf_state(cfg: ModelConfig, hf_state: dict[str, torch.Tensor],
                          dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Decoder:
    """Build a `Decoder` and load HF weights into it (strict: every parameter must be filled)."""
    model = meta_model(cfg)
    state = {k: v.to(dtype) for k, v in convert_state_dict(cfg, hf_state).items()}
    if cfg.tie_embeddings:                     # one tensor, two names: the output layer reuses the embedding
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval()
