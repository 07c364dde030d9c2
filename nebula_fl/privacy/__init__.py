"""Differential privacy accounted across the whole run: ledgers, budgets, client-level DP maths, the report.

- ``ledger``: ``PrivacyLedger``, a checkpointable wrapper over an Opacus accountant (RDP or PRV);
- ``budget``: ``default_delta``, ``steps_within_budget``, ``noise_for_target``, ``decide_round``;
- ``client_dp``: clip / noise a cluster's update, ``ServerDPAccountant`` for client-level DP;
- ``report``: ``privacy.json`` / ``privacy.png`` / the table of a run folder;
- ``cluster_report``: the same files and table for one cluster's state folder, from its own ledger;
- ``plot``: the privacy figure both draw (matplotlib, imported when a figure is drawn).

Nothing is imported here. Opacus (and with it torch, ~5 s) is imported only when a ledger is built or
a σ searched for; clipping, noising and the report need neither.
"""
