"""A sequence classifier on a sentence encoder: mean pooling, then one linear head.

MiniLM-L6 (all-MiniLM-L6-v2) was trained for mean-pooled sentence embeddings, so its CLS token and
pooler are weak features: classifying from the mean pool gets a frozen-encoder head most of the way
in a few dozen steps, and leaves LoRA the refinement.
"""

from __future__ import annotations

import torch
from torch import nn


class SequenceClassifier(nn.Module):
    def __init__(self, encoder: nn.Module, *, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(hidden_size, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)
