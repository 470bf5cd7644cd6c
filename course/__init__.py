"""The course package: what every lab imports.

    import course
    env = course.setup()                      # seeds, silence, device, Triton mode
    model = course.load_model()               # our from-scratch decoder, real SmolLM2 weights
    tokenizer = course.load_tokenizer()

It holds the parts no lab grades (models, measurement, widgets); never the answer to a graded cell.
"""
from course.environment import Environment, quick_mode, setup
from course.models import (
    DEFAULT_MODEL, Decoder, ModelConfig, ModelUnavailableError, load_hf_model, load_model, load_tokenizer,
)

__version__ = "0.1.0"
__all__ = [
    "setup", "Environment", "quick_mode", "DEFAULT_MODEL", "Decoder", "ModelConfig",
    "ModelUnavailableError", "load_model", "load_hf_model", "load_tokenizer",
]
