"""Lab 10's parts that no problem grades: the held-out text and perplexity, a paged KV pool in 8
bits, linear layers that dequantize then multiply, and the bytes of the model's GGUF file.

    ids = heldout_ids(tokenizer)                        # the course's held-out text, tokenized
    ppl = perplexity(token_nll(model, ids, attn_mask=mask))
    pool = QuantKVPool(cfg, n_blocks, block_size, storage=torch.int8, scales="head")
    qmodel = quantize_linears(model, quantize, dequantize)
    t = gguf_tensor("blk.0.attn_v.weight"); d, m, qs = split_q4_1(t.raw_tensor())

How to quantize (int8, float8, 4-bit groups) is the lab's to write; these only store, read and measure.
"""
from pathlib import Path

from course.quant.gguf_blocks import (
    Q4_1_BYTES, Q4_1_GROUP, Q8_0_BYTES, GGUFTensor, dequantize_reference, gguf_tensor, join_q4_1, model_param,
    read_gguf, split_q4_1,
)
from course.quant.kv import QuantKVPool, dequantize, fp8_native
from course.quant.linear import (
    QuantLinear, block_linears, linear_bytes, linear_params, max_weight_change, quantize_linears,
)
from course.quant.perplexity import attention_to_first, forward_logits, perplexity, rolling_mean, token_nll

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "heldout.txt"   # ships in the wheel (package data)


def heldout_text() -> str:
    """The course's held-out text: original English prose written for the course (see course/data/README_heldout.md)."""
    if not HELDOUT.is_file():
        raise FileNotFoundError(f"the held-out text is missing: expected {HELDOUT} (reinstall the course)")
    return HELDOUT.read_text(encoding="utf-8")


def heldout_ids(tokenizer, n_tokens: int | None = None) -> list[int]:
    """Token ids of the held-out text (its first n_tokens, or all), with no special tokens added."""
    ids = tokenizer(heldout_text(), add_special_tokens=False).input_ids
    if n_tokens is not None:
        if type(n_tokens) is not int or not 2 <= n_tokens <= len(ids):
            raise ValueError(f"n_tokens must be an int from 2 to {len(ids)} (the text's length), got {n_tokens!r}")
        ids = ids[:n_tokens]
    return ids


__all__ = [
    "GGUFTensor", "HELDOUT", "Q4_1_BYTES", "Q4_1_GROUP", "Q8_0_BYTES", "QuantKVPool", "QuantLinear",
    "attention_to_first", "block_linears", "dequantize", "dequantize_reference", "forward_logits", "fp8_native",
    "gguf_tensor", "heldout_ids", "heldout_text", "join_q4_1", "linear_bytes", "linear_params",
    "max_weight_change", "model_param", "perplexity", "quantize_linears", "read_gguf", "rolling_mean",
    "split_q4_1", "token_nll",
]
