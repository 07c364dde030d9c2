"""Cluster side: the thin per-message ClientApp and the persistent trainer it talks to."""
