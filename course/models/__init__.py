"""Models: the from-scratch decoder, its config, and loading real weights offline or from the hub."""
from course.models.config import ModelConfig
from course.models.decoder import Decoder, init_weights
from course.models.loading import (
    DEFAULT_MODEL, HUB_MODELS, ModelUnavailableError, load_hf_model, load_model, load_tokenizer,
)
from course.models.weights import decoder_from_hf_state

__all__ = [
    "ModelConfig", "Decoder", "init_weights", "decoder_from_hf_state", "DEFAULT_MODEL", "HUB_MODELS",
    "ModelUnavailableError", "load_hf_model", "load_model", "load_tokenizer",
]
