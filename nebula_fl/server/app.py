"""The ServerApp: validate the config, open the run folder, evaluate, drive the strategy, record it all.

Runs inside Flower's ``flwr-serverapp`` process, once per run, whether started by ``nebula-fl run``
or by a user's ``flwr run . <connection>`` against any SuperLink.
"""

from __future__ import annotations

import signal
import time
import uuid
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from nebula_fl.comm.adaptive import BandwidthTracker
from nebula_fl.components import resolve, settle
from nebula_fl.config import RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.reports.metric_plot import plot_metric_vs_bytes
from nebula_fl.server.evaluation import ServerEvaluator
from nebula_fl.server.log_routing import route_python_logging
from nebula_fl.server.outcome import outcome_line
from nebula_fl.server.tensorboard import TensorBoardLog
from nebula_fl.server.timeline import cluster_phases, round_timeline, utilisation_note
from nebula_fl.server.wan_counters import WanCounters
from nebula_fl.storage.run_folder import ADAPTER, MODEL, RunFolder, plot_name
from nebula_fl.strategies import make_strategy
from nebula_fl.strategies.adapter_strategy import to_numpy, to_record
from nebula_fl.strategies.base import NebulaStrategy, RoundFinishFailed, RoundOutcome
from nebula_fl.strategies.compression import CompressionWrapper
from nebula_fl.strategies.privacy import PrivacyWrapper
from nebula_fl.strategies.secure_aggregation import SecAggWrapper
from nebula_fl.strategies.staleness import stale_step_warning
from nebula_fl.wan.profile import parse_profile

# Keys that may differ between a run and its resumption; everything else must match.
TENSORBOARD = "tensorboard"  # the run folder's TensorBoard event files
RESUMABLE_CHANGES = {"resume", "out-dir", "num-server-rounds", "round-timeout", "connect-timeout", "comm.wan-control"}

app = ServerApp()


def build_strategy(cfg: RunConfig, *, initial: dict[str, np.ndarray] | None = None) -> NebulaStrategy:
    """The outer-optimizer strategy, wrapped by compression (which also packs every message into one blob),
    by secure aggregation when it is on, and by privacy (refusals and stopped clusters; the accountant under
    client-level DP)."""
    inner = make_strategy(cfg.outer, clusters_per_round=cfg.federation.clusters_per_round, seed=cfg.federation.seed,
                          options=cfg.strategy_options)
    profiles = [parse_profile(p.strip()) for p in cfg.comm.link_profiles.split(",") if p.strip()]
    # one profile is every cluster's link; several are clusters 0, 1, ... in order
    keyed = {"*": profiles[0]} if len(profiles) == 1 else {str(i): p for i, p in enumerate(profiles)}
    compressed = CompressionWrapper(
        inner,
        codec_up=cfg.comm.codec,
        codec_down=cfg.comm.down_spec(),
        seed=cfg.federation.seed,
        adaptive_target_s=cfg.comm.target_seconds if cfg.comm.adaptive else None,
        param_range=(cfg.comm.param_min, cfg.comm.param_max),
        bandwidth=BandwidthTracker(configured={k: p.up_bps for k, p in keyed.items()}),
        initial=initial,
    )
    secure = None
    if cfg.secagg.enabled:  # masks what compression encodes; the server unmasks only sums
        secure = SecAggWrapper(compressed, cfg=cfg.secagg, codec=cfg.comm.codec,
                               client_clip=cfg.privacy.max_grad_norm)
    # always present: with privacy off too, a cluster's own policy may refuse rounds, and the wrapper stops
    # sampling a cluster that refuses
    strategy = PrivacyWrapper(secure or compressed, cfg=cfg.privacy, num_rounds=cfg.federation.num_server_rounds,
                              clusters=cfg.federation.min_clusters)
    if secure is not None:
        secure.client_sigma = strategy.sigma  # client-level DP: each cluster adds its share of this σ
    strategy.set_min_updates(cfg.federation.min_clusters)
    return strategy


class Interrupted(BaseException):
    """SIGTERM or SIGINT reached the ServerApp."""


@app.main()
def main(grid: Grid, context: Context) -> None:
    route_python_logging()  # a plug-in's logging lines reach the server log (logs/server.log)
    run = None
    try:
        run = ServerRun(RunConfig.from_flat(dict(context.run_config)))
        run.run(grid)
    except Exception as err:  # _finish said how a started run ended; a run that never started says it here
        if not getattr(run, "outcome_logged", False):
            log(INFO, "%s", outcome_line(status="failed", rounds_completed=0, rounds_aggregated=0,
                                         error=f"{type(err).__name__}: {err}", run_folder=None))
        raise


def wait_for_clusters(grid: Grid, *, minimum: int, wanted: int, timeout: float) -> list[int]:
    """Wait up to `timeout` for `wanted` clusters; then go on with `minimum` or more, else fail."""
    wanted = max(minimum, wanted)
    deadline = time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < wanted:
        if time.monotonic() > deadline:
            if len(nodes) >= minimum:
                log(WARNING, "%d of the %d clusters waited for connected within %.0f s; starting with them",
                    len(nodes), wanted, timeout)
                return nodes
            raise NebulaError(
                f"only {len(nodes)} of {minimum} clusters connected within {timeout:.0f} s; start more "
                "SuperNodes (each with its trainer) or lower min-clusters"
            )
        time.sleep(0.5)
    return nodes


class ServerRun:
    def __init__(self, cfg: RunConfig) -> None:
        self.components = resolve(cfg)  # before the run folder is touched: a bad plug-in or option loses nothing
        self.cfg = cfg = settle(cfg)  # what the run folder records and every round's message carries
        out = cfg.federation.out_dir or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        self.folder = RunFolder(out)
        self.started = time.monotonic()
        self.wall_before = 0.0
        self.initial: dict[str, float] | None = None
        self.tensorboard: TensorBoardLog | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def _open(self) -> tuple[int, dict[str, np.ndarray] | None, dict[str, Any] | None]:
        """Prepare the folder; returns (first round, checkpointed adapter, checkpointed state)."""
        flat = self.components.flat(self.cfg)  # every plug-in option recorded, defaults included
        existing = self.folder.read_config() if (self.folder.path / "config.json").exists() else {}
        summary = self.folder.read_summary()
        if self.cfg.federation.resume:
            stored = existing.get("run_config")
            if not stored:
                raise NebulaError(f"cannot resume '{self.folder.path}': it holds no run (no config.json)")
            stored = {**stored, **settle(RunConfig.from_flat(stored)).to_flat()}  # "auto" as this task reads it
            changed = sorted(k for k in set(stored) | set(flat) if k not in RESUMABLE_CHANGES and stored.get(k) != flat.get(k))
            if changed:
                raise NebulaError(
                    f"cannot resume '{self.folder.path}' with a different config ({', '.join(changed)}); "
                    "resume with the run's own config.json"
                )
            self.federation_id = existing.get("federation_id") or uuid.uuid4().hex[:12]
        else:
            if (summary.get("status") and summary.get("status") != "running") or self.folder.load_checkpoint():
                raise NebulaError(
                    f"run folder '{self.folder.path}' already holds a run; pass a new --out, or --resume it"
                )
            self.federation_id = uuid.uuid4().hex[:12]
        self.folder.write_config({**existing, "run_config": flat, "federation_id": self.federation_id})
        ckpt = self.folder.load_checkpoint() if self.cfg.federation.resume else None
        if ckpt is None:
            self.folder.truncate_rounds(0)
            self.folder.update_summary(status="running", rounds_completed=0, federation_id=self.federation_id,
                                       num_server_rounds=self.cfg.federation.num_server_rounds, error=None)
            return 1, None, None
        done, adapter, state = ckpt
        self.folder.truncate_rounds(done)
        recorded = self.folder.rounds()
        line = state.get("line")
        if isinstance(line, dict) and line.get("round") == done and (not recorded or recorded[-1]["round"] < done):
            self.folder.append_round(line)  # the run stopped between the checkpoint and its record
        self.wall_before = float(state.get("wall_seconds", 0.0))
        self.initial = state.get("initial_evaluation")
        self.folder.update_summary(status="running", rounds_completed=done, error=None,
                                   num_server_rounds=self.cfg.federation.num_server_rounds)
        log(INFO, "resuming %s after round %d", self.folder.path, done)
        return done + 1, adapter, state

    def run(self, grid: Grid) -> None:
        self.folder.path.mkdir(parents=True, exist_ok=True)
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        stopped_by: list[str] = []  # the signal, even where its exception turns into another on the way up

        def _interrupt(signum, _frame):
            stopped_by.append(signal.Signals(signum).name)
            raise Interrupted(stopped_by[0])

        for s in previous:
            signal.signal(s, _interrupt)
        try:
            # A folder this run may not use (another run's, or a resume with another config) is left untouched.
            first_round, adapter, state = self._open()
        except BaseException:
            for s, handler in previous.items():
                signal.signal(s, handler)
            raise
        try:
            self._run_rounds(grid, first_round, adapter, state)
        except BaseException as err:
            # Raised inside a lock's bookkeeping (a queue, a condition), Interrupted can surface as another error
            # ("release unlocked lock"): the signal is still why the run stopped.
            if stopped_by:
                self._finish("interrupted", error=f"stopped by {stopped_by[0]}")
                raise SystemExit(130) from None
            self._finish("failed", error=f"{type(err).__name__}: {err}")
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _run_rounds(self, grid: Grid, first_round: int, adapter, state) -> None:
        cfg = self.cfg
        log(INFO, "run folder: %s", self.folder.path)
        evaluator = ServerEvaluator(cfg)
        log(INFO, "server evaluation on %s", evaluator.device)
        if (records := evaluator.records()) is not None:
            for name, report in records.items():
                log(INFO, "%s records at max-seq-len %d: %s", name.replace("_", "-"), cfg.model.max_seq_len,
                    report["said"])
            self.folder.update_summary(records=records)
        if warning := stale_step_warning(outer=cfg.outer.outer_optimizer, overlap=cfg.train.round_overlap,
                                         secure=cfg.secagg.enabled):
            log(WARNING, "%s", warning)
        self.metric = evaluator.task.metric
        self.higher_is_better = evaluator.task.higher_is_better
        initial = evaluator.initial_adapter()
        self.strategy = build_strategy(cfg, initial=initial)
        self.wan = WanCounters.from_config(cfg.comm.wan_control)
        if state is not None:
            self.strategy.load_state_dict(state["strategy"])
        arrays = adapter if adapter is not None else initial
        wait_for_clusters(grid, minimum=cfg.federation.min_clusters, wanted=cfg.federation.wait_for_clusters,
                          timeout=cfg.federation.connect_timeout)
        train_config = ConfigRecord(
            {**cfg.train.to_flat(), **cfg.model.to_flat(), **cfg.privacy.to_flat(), **cfg.task.to_flat(),
             **cfg.task_options, "labels": list(evaluator.labels),
             "federation-id": self.federation_id, "seed": cfg.federation.seed,
             "frozen-fingerprint": evaluator.frozen_fingerprint(), "num-server-rounds": cfg.federation.num_server_rounds}
        )

        def evaluate_fn(server_round: int, record: ArrayRecord) -> MetricRecord:
            metrics = evaluator(server_round, record)
            if server_round == 0:
                self.initial = dict(metrics)
                self.folder.update_summary(initial_evaluation=self.initial)
                log(INFO, "round 0 (initial model): %s %.4f", evaluator.task.metric, metrics[evaluator.task.metric])
            return metrics

        self.strategy.start(
            grid,
            to_record(arrays),
            num_rounds=cfg.federation.num_server_rounds,
            timeout=cfg.federation.round_timeout,
            train_config=train_config,
            evaluate_fn=evaluate_fn,
            first_round=first_round,
            evaluate_initial=cfg.federation.eval_initial,
            on_round_end=self._record_round,
            overlap_evaluation=cfg.federation.eval_overlap,
            on_round_aggregated=self._measure_round,
        )
        rounds = self.folder.rounds()
        if not any(_aggregated(line) for line in rounds):
            raise NebulaError(self._nothing_aggregated(rounds))
        final = self.folder.load_checkpoint()
        if final is not None and evaluator.task.exchange == "full":  # the whole model, the exchanged weights set
            self.folder.save_adapter(evaluator.whole_model(final[1]), name=MODEL)
        elif final is not None:
            self.folder.save_adapter(final[1], name=ADAPTER)
            if self.folder.save_peft_adapter(lambda folder: evaluator.save_peft(final[1], folder)) is None:
                log(WARNING, "no PEFT adapter folder: the task's model is not a PeftModel (adapter.safetensors holds "
                    "the exchanged tensors)")
        if self.strategy.stop_reason:
            self.folder.update_summary(stopped_early=self.strategy.stop_reason)
        self._finish("completed")

    def _nothing_aggregated(self, rounds: list[dict[str, Any]]) -> str:
        """Why the run failed though its loop ended cleanly: no round changed the global adapter."""
        why = [self.strategy.stop_reason] if self.strategy.stop_reason else []
        last = rounds[-1] if rounds else {}
        for cid, cluster in sorted((last.get("clusters") or {}).items()):
            if cluster.get("privacy_refused"):
                why.append(f"cluster {cid} refused: {cluster.get('privacy_reason') or 'its privacy policy'}")
        why += [f"cluster {cid}: {reason}" for cid, reason in sorted((last.get("rejected") or {}).items())]
        if last.get("skipped") and not why:
            why.append(str(last["skipped"]))
        return (f"no round was aggregated in {len(rounds)} round(s), so the run produced no adapter "
                f"({'; '.join(why) or 'no cluster sent a usable update'}); check the clusters' logs and privacy "
                f"policies, then start a new run")

    # -- per round -------------------------------------------------------------------------------
    def _measure_round(self, outcome: RoundOutcome) -> None:
        """Read the WAN proxies' counters when the round ends (its record may be written during the next one)."""
        outcome.measured["wan"] = self.wan.read_round() if self.wan else {}
        # when the round's global adapter existed (its evaluation, record and checkpoint may come later): the time
        # the adapter reached its accuracy, apart from how long measuring it took
        outcome.measured["aggregated_seconds"] = self.wall_before + time.monotonic() - self.started

    def _record_round(self, outcome: RoundOutcome) -> None:
        previous = self.folder.rounds()
        cum_up = previous[-1]["cumulative_bytes_up"] if previous else 0
        cum_down = previous[-1]["cumulative_bytes_down"] if previous else 0
        clusters: dict[str, dict[str, Any]] = {}
        rejected: dict[str, str] = {}
        cluster_of: dict[int, str] = {}
        for node_id, traffic in outcome.nodes.items():
            known = traffic.metrics.get("cluster-id")
            cid = cluster_of[node_id] = str(int(known)) if isinstance(known, int | float) else (
                self.strategy.directory.get(node_id) or f"node-{node_id}")
            clusters[cid] = {"node_id": node_id, "bytes_up": traffic.bytes_up, "bytes_down": traffic.bytes_down,
                             **{k.replace("-", "_"): v for k, v in traffic.metrics.items() if k != "cluster-id"}}
            reason = outcome.rejected.get(node_id) or traffic.error
            if reason:
                rejected[cid] = reason
        for cid, note in outcome.notes.items():
            clusters.setdefault(cid, {}).update(note)
        wan = outcome.measured.get("wan", {})
        for cid, counted in wan.items():
            clusters.setdefault(cid, {"bytes_up": 0, "bytes_down": 0}).update(counted)
        up = sum(c.get("bytes_up", 0) for c in clusters.values())
        down = sum(c.get("bytes_down", 0) for c in clusters.values())
        evals = dict(outcome.eval_metrics or {})
        train = dict(outcome.train_metrics or {})
        elapsed = self.wall_before + time.monotonic() - self.started
        line = {
            "round": outcome.round,
            "accuracy": evals.get("accuracy"),
            "macro_f1": evals.get("macro_f1"),
            "loss": evals.get("loss"),
            "train_loss": train.get("train-loss"),
            "clusters_aggregated": train.get("clusters"),  # updates in the aggregate (a strategy may drop some)
            "clusters_usable": train.get("clusters-usable", train.get("clusters")),  # updates that passed validation
            "update_norm": train.get("update-norm"),
            **({"steps_normalized": True, "tau_eff": train["tau-eff"]} if train.get("steps-normalized") else {}),
            "bytes_up": up,
            "bytes_down": down,
            "cumulative_bytes_up": cum_up + up,
            "cumulative_bytes_down": cum_down + down,
            "cumulative_bytes": cum_up + up + cum_down + down,
            **self._wan_totals(previous, wan),
            "seconds": outcome.seconds,
            "elapsed_seconds": elapsed,
            **({"aggregated_seconds": outcome.measured["aggregated_seconds"]}
               if "aggregated_seconds" in outcome.measured else {}),
            "clusters": clusters,
            "rejected": rejected,
            "skipped": outcome.skipped,
            **outcome.extras,
        }
        for key, value in evals.items():  # the task's other metrics (perplexity, rmse, ...)
            line.setdefault(key, value)
        if evals:
            line["eval_metrics"] = list(evals)  # which keys are the evaluation's, in the task's order (the report's columns)
        timed = {}
        for node_id, traffic in outcome.nodes.items():
            cid = cluster_of[node_id]
            if clusters[cid].get("node_id") == node_id and traffic.error is None:  # the node its record names
                timed[cid] = cluster_phases(pushed_at=traffic.pushed_at, arrived_at=traffic.arrived_at,
                                            metrics=traffic.metrics, wire_s=wan.get(cid, {}).get("wan_wire_seconds"))
        if not outcome.trained:  # a flush after the loop: it applies what a round held, no cluster trained
            line["trained"] = False
        # The checkpoint holds this line, so a crash between the two never loses the record of a checkpointed round.
        checkpointing = time.monotonic()
        try:
            self.folder.save_checkpoint(
                round=outcome.round,
                adapter=to_numpy(outcome.arrays),
                state={"strategy": outcome.strategy_state if outcome.strategy_state is not None
                       else self.strategy.state_dict(), "federation_id": self.federation_id,
                       "wall_seconds": elapsed, "initial_evaluation": self.initial, "line": line},
            )
        except Exception as err:
            raise RoundFinishFailed(outcome.round, "checkpoint", err) from err
        phases = {**outcome.phases, "checkpoint_s": time.monotonic() - checkpointing}
        line["timeline"] = round_timeline(seconds=outcome.seconds, phases=phases, clusters=timed)
        self.folder.append_round(line)
        self.folder.update_summary(rounds_completed=outcome.round, wall_seconds=elapsed)
        try:
            if self.tensorboard is None:
                self.tensorboard = TensorBoardLog(folder=self.folder.path / TENSORBOARD)
            self.tensorboard.write(line)
        except Exception as err:  # curves are a view of metrics.jsonl: never a reason to fail a round
            log(WARNING, "could not write round %d to TensorBoard: %s", outcome.round, err)
        log(INFO, "round %d: %s %.4f, loss %.4f, %d B up, %d B down, %.1f s, %s", outcome.round, self.metric,
            line.get(self.metric) or 0.0, line["loss"] or 0.0, up, down, outcome.seconds,
            utilisation_note(line["timeline"]))

    def _best(self, rounds: list[dict[str, Any]]) -> float | None:
        """The best headline metric of any round, by the task's own direction (lowest RMSE, highest accuracy)."""
        metric = getattr(self, "metric", "accuracy")
        seen = [r[metric] for r in rounds if isinstance(r.get(metric), int | float)]
        if not seen:
            return None
        return max(seen) if getattr(self, "higher_is_better", True) else min(seen)

    @staticmethod
    def _wan_totals(previous: list[dict[str, Any]], wan: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Proxy-counted bytes of this round and so far (only when the WAN is emulated)."""
        if not wan:
            return {}
        up = sum(c["wan_bytes_up"] for c in wan.values())
        down = sum(c["wan_bytes_down"] for c in wan.values())
        before = previous[-1].get("cumulative_wan_bytes", 0) if previous else 0
        return {"wan_bytes_up": up, "wan_bytes_down": down,
                "wan_requests": sum(c["wan_requests"] for c in wan.values()),
                "cumulative_wan_bytes": before + up + down}

    def _finish(self, status: str, *, error: str | None = None) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        rounds = self.folder.rounds()
        done = rounds[-1]["round"] if rounds else 0
        final = rounds[-1] if rounds else {}
        cluster_rounds = [c for line in rounds for c in line["clusters"].values()]
        if rounds:
            try:
                metric = getattr(self, "metric", "accuracy")
                plot_metric_vs_bytes(rounds, self.folder.path / plot_name(metric), metric=metric,
                                     initial=(self.initial or {}).get(metric))
            except Exception as err:  # a plot must never turn a finished run into a failed one
                log(INFO, "could not draw %s: %s", plot_name(metric), err)
        summary = self.folder.update_summary(
            status=status,
            error=error,
            rounds_completed=done,
            num_server_rounds=self.cfg.federation.num_server_rounds,
            final_accuracy=final.get("accuracy"),
            final_macro_f1=final.get("macro_f1"),
            final_loss=final.get("loss"),
            task=self.cfg.task.name,
            metric=getattr(self, "metric", "accuracy"),
            final_metric=final.get(getattr(self, "metric", "accuracy")),
            best_accuracy=max((r["accuracy"] for r in rounds if r.get("accuracy") is not None), default=None),
            best_metric=self._best(rounds),
            initial_evaluation=self.initial,
            bytes_up_total=final.get("cumulative_bytes_up", 0),
            bytes_down_total=final.get("cumulative_bytes_down", 0),
            wan_bytes_total=final.get("cumulative_wan_bytes"),
            bytes_up_per_round_per_cluster=_mean(c["bytes_up"] for c in cluster_rounds),
            bytes_down_per_round_per_cluster=_mean(c["bytes_down"] for c in cluster_rounds),
            wall_seconds=self.wall_before + time.monotonic() - self.started,
            federation_id=getattr(self, "federation_id", None),
        )
        summary = self.folder.update_summary(
            rounds_not_applied=_not_applied(rounds, status=status),
            skipped_rounds=[r["round"] for r in rounds if r.get("skipped")],
            drops=[{"round": r["round"], "cluster": cid, "reason": why} for r in rounds
                   for cid, why in (r.get("rejected") or {}).items()],
        )
        strategy = getattr(self, "strategy", None)
        if isinstance(strategy, PrivacyWrapper) and (self.cfg.privacy.mode != "off" or strategy.exhausted):
            summary = self.folder.update_summary(privacy=strategy.report())
        log(INFO, "run %s: %s after %d round(s)", self.folder.path, summary["status"], done)
        log(INFO, "%s", outcome_line(status=summary["status"], rounds_completed=done,
                                     rounds_aggregated=sum(1 for line in rounds if _aggregated(line)),
                                     error=summary.get("error"), run_folder=str(self.folder.path)))
        self.outcome_logged = True


def _aggregated(line: dict[str, Any]) -> bool:
    """Whether a round's record changed the global adapter (not skipped, not pending, not refused by every cluster)."""
    return not line.get("skipped") and (line.get("clusters_aggregated") or 0) > 0


def _not_applied(rounds: list[dict[str, Any]], *, status: str) -> list[dict[str, Any]]:
    """Rounds whose masked uploads never reached the global adapter, with the reason and the record that says so;
    in a run that did not complete, also the round its last checkpoint still holds (a resume applies it)."""
    out = [{**entry, "recorded_in": line["round"]} for line in rounds
           for entry in (line.get("secagg") or {}).get("not_applied", [])]
    held = (rounds[-1].get("secagg") or {}).get("held") if rounds else None
    if held is not None and status != "completed":
        out.append({"round": held, "reason": f"the run stopped ({status}) while its sum was held for the next round; "
                    "`nebula-fl run --resume` unmasks it", "recorded_in": rounds[-1]["round"]})
    return out


def _mean(values) -> float | None:
    values = list(values)
    return float(np.mean(values)) if values else None
