"""Tokenise once, pad per batch: shapes follow the batch's longest example, not max-seq-len."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class TokenizedTexts:
    """A dataset's token ids, truncated to `max_len`, ready to be cut into padded batches."""

    def __init__(self, tokenizer, texts: Sequence[str], labels: np.ndarray, *, max_len: int) -> None:
        encoded = tokenizer(list(texts), truncation=True, max_length=max_len, padding=False)
        self.ids = [np.asarray(x, dtype=np.int64) for x in encoded["input_ids"]]
        self.labels = np.asarray(labels, dtype=np.int64)
        self.pad_id = int(tokenizer.pad_token_id or 0)

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, indices: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        rows = [self.ids[i] for i in indices]
        width = max(len(r) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for j, row in enumerate(rows):
            input_ids[j, : len(row)] = row
            mask[j, : len(row)] = 1
        return {
            "input_ids": torch.from_numpy(input_ids).to(device),
            "attention_mask": torch.from_numpy(mask).to(device),
            "labels": torch.from_numpy(self.labels[np.asarray(indices)]).to(device),
        }
