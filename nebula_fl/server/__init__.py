"""Server side: the ServerApp, server-side evaluation, and the run folder with its checkpoints."""
