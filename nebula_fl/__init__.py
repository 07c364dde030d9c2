"""nebula-fl: federated LoRA fine-tuning across remote clusters joined by slow links, on Flower."""

__version__ = "0.1.0"
