"""Datasets on disk and how they are split between the server and the clusters."""
