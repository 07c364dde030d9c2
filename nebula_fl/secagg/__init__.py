"""Secure aggregation (SecAgg+, Bell et al. 2020, with Bonawitz et al. 2017's consistency check) as pure functions.

Field encoding, masks, the neighbour graph, shares, identities and the roster, the evidence a holder needs
(receipts, certified views), the reveal rules and the threat model they hold under (`reveal.py`), and the
server's reading of replies. The stateful pieces live elsewhere: the server's wrapper
(``strategies/secure_aggregation.py``) and the cluster's stage (``clients/secagg_stage.py``). Everything here
is deterministic given its inputs and keys, so both sides and the tests compute the same thing.
"""
