"""The round loop under faults, against a scripted grid: skipped rounds, replaced SuperNodes, identify queries."""

import threading
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Metadata, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from nebula_fl.config import OuterConfig
from nebula_fl.errors import NebulaError
from nebula_fl.strategies import make_strategy
from nebula_fl.strategies.adapter_strategy import to_numpy
from nebula_fl.strategies.base import RoundFinishFailed
from tests.conftest import as_installed

GLOBAL = {"w": np.zeros(3, np.float32)}


class ScriptedGrid:
    """Nodes answer by a script: node -> cluster id, or None (never answers), or "error"."""

    def __init__(self, script, *, late_nodes=None):
        self.script = dict(script)
        self.late_nodes = dict(late_nodes or {})  # node -> (appears after s, cluster it serves)
        self.started = time.monotonic()
        self.outbox, self.sent = {}, []

    def get_node_ids(self):
        now = time.monotonic() - self.started
        return sorted(list(self.script) + [n for n, (after, _) in self.late_nodes.items() if now >= after])

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = f"m{len(self.sent)}"
            m.metadata.__dict__["_message_id"] = mid
            self.sent.append(m)
            ids.append(mid)
            self.outbox[mid] = as_installed(self._answer(m, mid))
        return ids

    def _answer(self, message, mid):
        node = message.metadata.dst_node_id
        cluster = self.script.get(node, self.late_nodes.get(node, (0, None))[1])
        if cluster == "lost-once":  # the SuperNode died holding it and came back under the same node id
            self.script[node] = str(node)
            return None
        meta = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id=mid,
                        group_id="1", created_at=0.0, ttl=100.0, message_type=message.metadata.message_type)
        if cluster is None:
            return None
        if cluster == "error":
            return make_message(metadata=meta, error=Error(code=1, reason="the trainer is gone"))
        metrics = {"cluster-id": int(cluster), "num-examples": 10, "train-loss": 1.0}
        if message.metadata.message_type == "query":
            return make_message(metadata=meta, content=RecordDict({"metrics": MetricRecord(metrics)}))
        update = ArrayRecord({"w": Array(np.ones(3, np.float32))})
        return make_message(metadata=meta, content=RecordDict({"update": update, "metrics": MetricRecord(metrics)}))

    def pull_messages(self, ids):
        replies = [self.outbox.get(mid) for mid in list(ids)]
        for reply in replies:
            if reply is not None:
                del self.outbox[reply.metadata.reply_to_message_id]
        return [r for r in replies if r is not None]

    def kinds(self):
        return [(m.metadata.message_type, m.metadata.dst_node_id) for m in self.sent]


def run(strategy, grid, rounds, timeout=600.0):
    outcomes = []
    result = strategy.start(grid, ArrayRecord({"w": Array(GLOBAL["w"])}), num_rounds=rounds, timeout=timeout,
                            train_config=ConfigRecord({}), evaluate_fn=None, evaluate_initial=False,
                            on_round_end=outcomes.append, poll_interval=0.05)
    return result, outcomes


def test_a_round_with_too_few_updates_is_skipped_and_the_adapter_stays():
    strategy = make_strategy(OuterConfig())
    strategy.set_min_updates(2)
    result, outcomes = run(strategy, ScriptedGrid({1: "0", 2: "error"}), rounds=2)
    assert [o.skipped is not None for o in outcomes] == [True, True]
    assert "fewer than the 2 a round needs" in outcomes[0].skipped and "the trainer is gone" in outcomes[0].skipped
    np.testing.assert_array_equal(to_numpy(result.arrays)["w"], GLOBAL["w"])
    # with a quorum of one the same grid moves the adapter by node 1's update
    strategy = make_strategy(OuterConfig())
    result, outcomes = run(strategy, ScriptedGrid({1: "0", 2: "error"}), rounds=1)
    assert outcomes[0].skipped is None and "the trainer is gone" in outcomes[0].nodes[2].error
    np.testing.assert_array_equal(to_numpy(result.arrays)["w"], np.ones(3))


def test_too_many_skipped_rounds_in_a_row_end_the_run_with_the_reasons():
    strategy = make_strategy(OuterConfig())
    strategy.set_min_updates(2)
    with pytest.raises(NebulaError, match=r"3 rounds in a row had too few usable updates .*the trainer is gone"):
        run(strategy, ScriptedGrid({1: "0", 2: "error"}), rounds=5)


def test_a_supernode_replaced_mid_round_is_dropped_at_once_not_at_the_timeout():
    strategy = make_strategy(OuterConfig())
    grid = ScriptedGrid({1: "0", 2: "1"})
    run(strategy, grid, rounds=1)
    assert strategy.directory.clusters == {1: "0", 2: "1"}
    # node 2's SuperNode dies holding round 2's message; it comes back as node 3, serving cluster 1
    grid.script[2] = None
    grid.late_nodes = {3: (time.monotonic() - grid.started + 0.5, "1")}
    started = time.monotonic()
    _, outcomes = run(strategy, grid, rounds=1, timeout=600.0)
    assert time.monotonic() - started < 15
    (outcome,) = outcomes
    assert "replaced by node 3" in outcome.nodes[2].error and outcome.skipped is None
    assert ("query", 3) in grid.kinds() and strategy.directory.clusters == {1: "0", 3: "1"}
    assert strategy.directory.get(2) == "1"  # the drop is still recorded under its cluster
    # the replaced node may still be listed as connected (until its heartbeat expires): it is never sent a round
    before = len(grid.sent)
    _, outcomes = run(strategy, grid, rounds=1)
    assert sorted(n for kind, n in grid.kinds()[before:]) == [1, 3] and outcomes[0].skipped is None


def test_nodes_are_identified_before_a_round_when_per_cluster_state_depends_on_it():
    strategy = make_strategy(OuterConfig())
    strategy.needs_identity = lambda: True
    grid = ScriptedGrid({7: "4", 8: "5"})
    run(strategy, grid, rounds=1)
    kinds = grid.kinds()
    assert kinds[:2] == [("query", 7), ("query", 8)] and ("train", 7) in kinds[2:]
    assert strategy.directory.clusters == {7: "4", 8: "5"}
    before = len(grid.sent)
    run(strategy, grid, rounds=1)  # every node known now: no query again
    assert all(kind == "train" for kind, _ in grid.kinds()[before:])


def test_a_node_silent_long_after_the_others_is_sent_the_round_once_more(monkeypatch):
    import nebula_fl.strategies.base as base

    monkeypatch.setattr(base, "RESEND_AFTER_S", 0.3)
    strategy = make_strategy(OuterConfig())
    strategy.set_min_updates(2)
    grid = ScriptedGrid({1: "1", 2: "lost-once"})
    started = time.monotonic()
    result, outcomes = run(strategy, grid, rounds=1)
    assert time.monotonic() - started < 10
    assert [n for kind, n in grid.kinds() if kind == "train"] == [1, 2, 2]  # one copy, to the silent node only
    (outcome,) = outcomes
    assert outcome.skipped is None and outcome.nodes[2].error is None
    assert outcome.nodes[2].bytes_down > outcome.nodes[1].bytes_down  # the copy's bytes are counted
    np.testing.assert_array_equal(to_numpy(result.arrays)["w"], np.ones(3))


def test_the_server_waits_for_every_cluster_asked_then_goes_on_with_a_quorum():
    from nebula_fl.server.app import wait_for_clusters

    grid = ScriptedGrid({1: "0"}, late_nodes={2: (0.6, "1")})
    assert wait_for_clusters(grid, minimum=1, wanted=2, timeout=5) == [1, 2]  # waited for the late one
    started = time.monotonic()
    assert wait_for_clusters(ScriptedGrid({1: "0"}), minimum=1, wanted=2, timeout=0.5) == [1]
    assert time.monotonic() - started < 3
    with pytest.raises(NebulaError, match="only 1 of 2 clusters connected"):
        wait_for_clusters(ScriptedGrid({1: "0"}), minimum=2, wanted=3, timeout=0.5)


# -- a round's finish (evaluation, record, checkpoint) that fails while the next round runs -------------------------
class GatedGrid(ScriptedGrid):
    """Calls `on_round(n)` when the n-th train message is pushed, before the round goes on."""

    def __init__(self, script, *, on_round):
        super().__init__(script)
        self.on_round = on_round

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        self.on_round(sum(kind == "train" for kind, _ in self.kinds()))
        return ids

    def trained(self):
        return sum(kind == "train" for kind, _ in self.kinds())


def _slow_failure(error):
    """(a finish step for round 1 that fails only once round 2 runs, the grid's hook that holds round 2 until then)."""
    round_two, raised = threading.Event(), threading.Event()

    def fail_round_one(rnd, *_):
        if rnd == 1:
            assert round_two.wait(10), "round 2 never started"
            raised.set()
            raise error

    def on_round(n):
        if n == 2:
            round_two.set()
            assert raised.wait(10), "round 1's finish never failed"
            time.sleep(0.3)  # the failure is kept before round 2 ends

    return fail_round_one, on_round


def test_an_overlapped_evaluation_failing_while_the_next_round_runs_ends_the_run_and_records_nothing_after_it():
    fail_round_one, on_round = _slow_failure(RuntimeError("the evaluation of round 1 broke"))
    grid, recorded = GatedGrid({1: "0"}, on_round=on_round), []
    with pytest.raises(RoundFinishFailed, match="round 1's evaluation failed: RuntimeError: the evaluation of round 1 broke"):
        make_strategy(OuterConfig()).start(
            grid, ArrayRecord({"w": Array(GLOBAL["w"])}), num_rounds=4, timeout=60.0, train_config=ConfigRecord({}),
            evaluate_fn=fail_round_one, evaluate_initial=False, on_round_end=lambda o: recorded.append(o.round),
            poll_interval=0.01, overlap_evaluation=True)
    assert recorded == []  # round 2 finished training, but is not recorded behind the missing round 1
    assert grid.trained() == 2  # the loop stopped at the round boundary after the failure


def test_a_record_failing_while_the_next_round_runs_ends_the_run_and_records_nothing_after_it():
    fail_round_one, on_round = _slow_failure(OSError(28, "No space left on device"))
    grid, recorded = GatedGrid({1: "0"}, on_round=on_round), []

    def on_round_end(outcome):
        recorded.append(outcome.round)
        fail_round_one(outcome.round)

    with pytest.raises(RoundFinishFailed, match=r"round 1's record failed: OSError: .*No space left"):
        make_strategy(OuterConfig()).start(
            grid, ArrayRecord({"w": Array(GLOBAL["w"])}), num_rounds=4, timeout=60.0, train_config=ConfigRecord({}),
            evaluate_fn=None, evaluate_initial=False, on_round_end=on_round_end, poll_interval=0.01)
    assert recorded == [1] and grid.trained() == 2


def test_a_record_failing_while_the_last_round_runs_fails_the_run_instead_of_completing_it():
    fail_round_one, on_round = _slow_failure(OSError(28, "No space left on device"))
    recorded = []

    def on_round_end(outcome):
        recorded.append(outcome.round)
        fail_round_one(outcome.round)

    with pytest.raises(RoundFinishFailed, match="No space left") as info:
        make_strategy(OuterConfig()).start(
            GatedGrid({1: "0"}, on_round=on_round), ArrayRecord({"w": Array(GLOBAL["w"])}), num_rounds=2,
            timeout=60.0, train_config=ConfigRecord({}), evaluate_fn=None, evaluate_initial=False,
            on_round_end=on_round_end, poll_interval=0.01)
    assert recorded == [1]
    assert info.value.round == 1 and info.value.step == "record" and isinstance(info.value.__cause__, OSError)


def test_training_runs_at_most_one_round_ahead_of_the_records():
    recorded: list[int] = []
    behind: list[tuple[int, int]] = []  # (round being sent, rounds recorded by then)

    def slow_record(outcome):
        time.sleep(0.15)
        recorded.append(outcome.round)

    def on_round(n):
        behind.append((n, len(recorded)))

    make_strategy(OuterConfig()).start(
        GatedGrid({1: "0"}, on_round=on_round), ArrayRecord({"w": Array(GLOBAL["w"])}), num_rounds=6, timeout=60.0,
        train_config=ConfigRecord({}), evaluate_fn=None, evaluate_initial=False, on_round_end=slow_record,
        poll_interval=0.01)
    assert recorded == [1, 2, 3, 4, 5, 6]
    assert all(done >= n - 2 for n, done in behind), behind  # round r starts once round r-2 is recorded


def test_a_slow_record_that_fails_stops_training_within_two_rounds_and_names_its_round_and_step():
    def failing_record(outcome):
        time.sleep(0.3)
        if outcome.round == 1:
            raise OSError(28, "No space left on device")

    grid = GatedGrid({1: "0"}, on_round=lambda n: None)
    with pytest.raises(RoundFinishFailed, match=r"^round 1's record failed: OSError: .*No space left") as info:
        make_strategy(OuterConfig()).start(
            grid, ArrayRecord({"w": Array(GLOBAL["w"])}), num_rounds=50, timeout=60.0, train_config=ConfigRecord({}),
            evaluate_fn=None, evaluate_initial=False, on_round_end=failing_record, poll_interval=0.01)
    assert grid.trained() == 2  # round 3 waited for round 1's record, and the run ended there
    assert (info.value.round, info.value.step) == (1, "record")


class MixedInstalls(ScriptedGrid):
    """Node 2 runs another nebula-fl: its replies name protocol 2, or (`said=None`) no install at all."""

    def __init__(self, script, *, said):
        super().__init__(script)
        self.said = said

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for mid in ids:
            reply = self.outbox.get(mid)
            if reply is not None and reply.metadata.src_node_id == 2:
                if self.said is None:
                    del reply.content["nebula"]
                else:
                    reply.content["nebula"] = ConfigRecord(self.said)
        return ids


@pytest.mark.parametrize("said", [{"version": "9.0.0", "protocol": 2}, None])
def test_a_cluster_of_another_protocol_is_refused_before_its_reply_is_read(said, caplog):
    strategy = make_strategy(OuterConfig())
    strategy.needs_identity = lambda: True  # its identify answer is refused too: node 2 is never matched
    grid = MixedInstalls({1: "0", 2: "1"}, said=said)
    result, outcomes = run(strategy, grid, rounds=2)
    theirs = "nebula-fl 9.0.0 (protocol 2)" if said else "names no protocol version"
    for outcome in outcomes:
        why = outcome.nodes[2].error
        assert why.startswith("node 2 runs ") and theirs in why and "this server runs nebula-fl 0.1.0 (protocol 1)" in why
        assert outcome.skipped is None and outcome.nodes[1].error is None
    # only node 1's update moved the adapter: ScriptedGrid's update is all ones, the mean of one, in each round
    np.testing.assert_array_equal(to_numpy(result.arrays)["w"], GLOBAL["w"] + 2)
    assert strategy.directory.clusters == {1: "0"}
    assert sum("node 2 runs" in r.getMessage() for r in caplog.records) <= 1  # said once, not every round
