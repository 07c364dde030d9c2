"""The base model, its LoRA adapter, and the tensors that cross the WAN."""
