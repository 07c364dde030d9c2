"""The cluster's ledger: append-only on disk, for the data's whole life, ε by Opacus's own accountant."""

import json

import pytest
from opacus.accountants import RDPAccountant

from nebula_fl.privacy.cluster_ledger import ClusterLedger, LedgerError


def opacus_epsilon(history, delta):
    """Independent reference: a fresh Opacus RDP accountant stepped release by release."""
    accountant = RDPAccountant()
    for sigma, q, steps in history:
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant.get_epsilon(delta=delta)


def test_releases_survive_reopening_and_compose_across_federations(tmp_path):
    path = tmp_path / "privacy-ledger.jsonl"
    ledger = ClusterLedger(path=path, accountant="rdp")
    ledger.record(federation="a", round=1, mode="sample", noise_multiplier=1.0, sample_rate=0.05, steps=20, delta=1e-5)
    ledger.record(federation="b", round=1, mode="sample", noise_multiplier=1.5, sample_rate=0.05, steps=30, delta=1e-5)
    ledger.record(federation="b", round=1, mode="client", noise_multiplier=2.0, sample_rate=1.0, steps=1, delta=1e-5)
    again = ClusterLedger(path=path, accountant="rdp")  # a restarted trainer
    expected = opacus_epsilon([(1.0, 0.05, 20), (1.5, 0.05, 30)], 1e-5)
    assert again.epsilon(mode="sample", delta=1e-5) == pytest.approx(expected, rel=1e-9)
    assert again.epsilon(mode="sample", delta=1e-5, federation="a") == pytest.approx(
        opacus_epsilon([(1.0, 0.05, 20)], 1e-5), rel=1e-9)
    assert again.epsilon(mode="client", delta=1e-5) == pytest.approx(opacus_epsilon([(2.0, 1.0, 1)], 1e-5), rel=1e-9)
    assert again.steps(mode="sample") == 50
    after = again.epsilon_after(mode="sample", delta=1e-5, noise_multiplier=1.0, sample_rate=0.05, steps=10)
    assert after == pytest.approx(opacus_epsilon([(1.0, 0.05, 20), (1.5, 0.05, 30), (1.0, 0.05, 10)], 1e-5), rel=1e-9)
    assert again.steps(mode="sample") == 50  # asking records nothing
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_the_file_is_only_ever_appended_to_and_never_rolled_back(tmp_path):
    path = tmp_path / "privacy-ledger.jsonl"
    ledger = ClusterLedger(path=path)
    ledger.record(federation="a", round=1, mode="sample", noise_multiplier=1.0, sample_rate=0.1, steps=5, delta=1e-5)
    first = path.read_bytes()
    snapshot = ledger.state_dict()
    ledger.record(federation="a", round=2, mode="sample", noise_multiplier=1.0, sample_rate=0.1, steps=5, delta=1e-5)
    assert path.read_bytes().startswith(first)
    with pytest.raises(LedgerError, match="never rolled back"):
        ledger.load_state_dict({"entries": [{"forged": 1}]})
    ledger.load_state_dict(snapshot)  # an older state is a prefix: it confirms, it does not lower
    assert ledger.steps(mode="sample") == 10


def test_a_line_torn_by_a_crash_is_ignored_but_damage_elsewhere_stops_everything(tmp_path):
    path = tmp_path / "privacy-ledger.jsonl"
    ledger = ClusterLedger(path=path)
    ledger.record(federation="a", round=1, mode="sample", noise_multiplier=1.0, sample_rate=0.1, steps=5, delta=1e-5)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"v": 1, "federation": "a", "rou')  # the process died mid-write: never released
    assert ClusterLedger(path=path).steps(mode="sample") == 5
    path.write_bytes(b'{"garbage": true}\n' + whole)
    with pytest.raises(LedgerError, match="damaged at line 1"):
        ClusterLedger(path=path)
    bad = json.loads(whole)
    bad["noise_multiplier"] = 0.0
    path.write_bytes((json.dumps(bad) + "\n").encode())
    with pytest.raises(LedgerError, match="restore it from a backup"):
        ClusterLedger(path=path)


def record(ledger, rnd, **extra):
    return ledger.record(federation="a", round=rnd, mode="sample", noise_multiplier=1.0, sample_rate=0.1, steps=5,
                         delta=1e-5, **extra)


def test_an_append_after_a_torn_line_cuts_it_and_a_whole_last_entry_is_kept(tmp_path):
    path = tmp_path / "privacy-ledger.jsonl"
    record(ClusterLedger(path=path), 1)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"v": 1, "federation": "a", "rou')  # the process died mid-append: never released
    record(ClusterLedger(path=path), 2)
    assert [e["round"] for e in ClusterLedger(path=path).entries()] == [1, 2]  # not glued to the torn line
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # restored by hand without its last line end: it counts
    assert ClusterLedger(path=path).steps(mode="sample") == 10
    record(ClusterLedger(path=path), 3)
    assert [e["round"] for e in ClusterLedger(path=path).entries()] == [1, 2, 3]


def test_a_failed_append_leaves_the_file_as_it_was_and_says_so(tmp_path, monkeypatch):
    import os
    import types

    from nebula_fl.privacy import cluster_ledger

    path = tmp_path / "privacy-ledger.jsonl"
    ledger = ClusterLedger(path=path)
    record(ledger, 1)
    before = path.read_bytes()

    def fsync(_fd):
        raise OSError(5, "Input/output error")

    names = {name: getattr(os, name) for name in dir(os) if not name.startswith("__")}
    monkeypatch.setattr(cluster_ledger, "os", types.SimpleNamespace(**{**names, "fsync": fsync}))
    with pytest.raises(LedgerError, match=r"^could not append to the privacy ledger '.*' \(Input/output error\); "
                                          r"nothing was recorded: free disk space"):
        record(ledger, 2)
    assert path.read_bytes() == before and ledger.steps(mode="sample") == 5  # neither the file nor the count moved
    monkeypatch.undo()
    record(ledger, 2)
    assert [e["round"] for e in ClusterLedger(path=path).entries()] == [1, 2]


def test_a_release_made_with_no_budget_says_so_in_the_ledger(tmp_path):
    path = tmp_path / "privacy-ledger.jsonl"
    ledger = ClusterLedger(path=path)
    assert record(ledger, 1, no_budget=True)["no_budget"] is True
    assert "no_budget" not in record(ledger, 2)
    assert [e.get("no_budget", False) for e in ClusterLedger(path=path).entries()] == [True, False]
