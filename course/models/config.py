"""The handful of numbers that describe a decoder-only transformer, for both families we cover."""
from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("llama", "gpt2")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a decoder. `family` picks the block style:

    llama: RoPE positions, RMSNorm, SwiGLU MLP, no biases, grouped-query attention (GQA)
    gpt2:  learned position embeddings, LayerNorm, GELU MLP, biases, multi-head attention (MHA)
    """

    family: str
    vocab_size: int
    n_layer: int
    n_head: int            # query heads
    n_kv_head: int         # key/value heads: == n_head is MHA, 1 is MQA, in between is GQA
    d_model: int
    d_ff: int              # hidden width of the MLP
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head (1 for MHA)."""
        return self.n_head // self.n_kv_head

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Read a transformers `LlamaConfig` or `GPT2Config` (or their dict form)."""
        get = (lambda k, d=None: hf.get(k, d)) if isinstance(hf, dict) else (lambda k, d=None: getattr(hf, k, d))
        model_type = get("model_type")
        eos = get("eos_token_id")
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        if model_type == "llama":
            rope = get("rope_parameters") or {}
            theta = rope.get("rope_theta", get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") not in ("default", None):
                raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported; only 'default' RoPE")
            n_head = get("num_attention_heads")
            d_model = get("hidden_size")
            if (get("head_dim") or d_model // n_head) != d_model // n_head:
                raise ValueError("head_dim != hidden_size / num_attention_heads is not supported")
            return cls(
                family="llama", vocab_size=get("vocab_size"), n_layer=get("num_hidden_layers"),
                n_head=n_head, n_kv_head=get("num_key_value_heads") or n_head, d_model=d_model,
                d_ff=get("intermediate_size"), max_seq_len=get("max_position_embeddings"),
                norm_eps=get("rms_norm_eps"), rope_theta=float(theta),
                tie_embeddings=bool(get("tie_word_embeddings", False)),
                bos_token_id=get("bos_token_id"), eos_token_id=eos,
            )
        if model_type == "gpt2":
            d_model = get("n_embd")
            return cls(
                family="gpt2", vocab_size=get("vocab_size"), n_layer=get("n_layer"),
                n_head=get("n_head"), n_kv_head=get("n_head"), d_model=d_model,
                d_ff=get("n_inner") or 4 * d_model, max_seq_len=get("n_positions"),
                norm_eps=get("layer_norm_epsilon"), tie_embeddings=True,
                bos_token_id=get("bos_token_id"), eos_token_id=eos,
            )
        raise ValueError(f"model_type {model_type!r} is not supported; expected 'llama' or 'gpt2'")
