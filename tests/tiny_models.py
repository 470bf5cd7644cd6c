"""Tiny random decoders for the engine tests: a Llama with GQA and a GPT-2, two layers each."""
from course.models import ModelConfig


def tiny_configs(vocab_size: int, max_seq_len: int, llama_d_ff: int = 64) -> dict[str, ModelConfig]:
    """{"llama-gqa", "gpt2"}: 4 query heads (2 KV heads for Llama), d_model 32."""
    return {
        "llama-gqa": ModelConfig(family="llama", vocab_size=vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                                 d_ff=llama_d_ff, max_seq_len=max_seq_len),
        "gpt2": ModelConfig(family="gpt2", vocab_size=vocab_size, n_layer=2, n_head=4, n_kv_head=4, d_model=32, d_ff=64,
                            max_seq_len=max_seq_len),
    }


def tiny_llama(vocab_size: int, max_seq_len: int = 4096):
    """The serving tests' model: tiny_configs' Llama with random weights (std 0.5, seed 0), in eval mode."""
    from course.models import Decoder, init_weights

    return init_weights(Decoder(tiny_configs(vocab_size, max_seq_len)["llama-gqa"]), std=0.5, seed=0).eval()
