"""A tiny BERT for tests and overhead benchmarks: real code paths, negligible compute."""

from __future__ import annotations

from pathlib import Path


def build_tiny_model(out: Path, *, hidden: int = 32, layers: int = 1, seed: int = 0) -> Path:
    """A 1-layer BERT whose word embeddings are a random projection of MiniLM's.

    The projection keeps most of the geometry of the pretrained embeddings (Johnson-Lindenstrauss),
    so mean-pooled features separate topics from step 0 and a few LoRA/head steps learn something,
    while the model stays ~1M parameters and loads in milliseconds.
    """
    import numpy as np
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer, BertConfig, BertModel

    from nebula_fl.model.locate import resolve_model_path

    src = resolve_model_path("minilm")
    with safe_open(str(src / "model.safetensors"), "np") as f:
        words = f.get_tensor("embeddings.word_embeddings.weight")
    rng = np.random.default_rng(seed)
    projection = rng.standard_normal((words.shape[1], hidden)) / np.sqrt(hidden)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=words.shape[0], hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=128)
    model = BertModel(config)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.copy_(torch.from_numpy((words @ projection).astype(np.float32)))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
    return out
