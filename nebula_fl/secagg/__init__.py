"""Secure aggregation (SecAgg+, Bell et al. 2020) as pure functions: field encoding, masks, graph, shares.

The stateful pieces live elsewhere: the server's wrapper (``strategies/secure_aggregation.py``) and
the cluster's stage (``clients/secagg_stage.py``). Everything here is deterministic given its inputs
and keys, so both sides and the tests compute the same thing.
"""
