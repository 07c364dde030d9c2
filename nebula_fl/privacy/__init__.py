"""Differential privacy accounted across the whole run: ledgers, budgets, client-level DP maths.

- ``ledger``: ``PrivacyLedger``, a checkpointable wrapper over an Opacus accountant (RDP or PRV);
- ``budget``: ``default_delta``, ``steps_within_budget``, ``noise_for_target``, ``decide_round``;
- ``client_dp``: clip / noise a cluster's update, ``ServerDPAccountant`` for client-level DP;

The report of a run folder or a cluster's state folder, and its figure, live in ``nebula_fl.reports``.

Nothing is imported here. Opacus (and with it torch, ~5 s) is imported only when a ledger is built or
a σ searched for; clipping and noising need neither.
"""
