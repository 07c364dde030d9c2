"""Turn `nebula-fl run` flags into a checked launch plan, before any process starts.

Precedence, lowest first: the defaults (``[tool.flwr.app.config]``), the preset, the dedicated flags,
then ``--run-config`` (parsed by Flower's own parser, so it means exactly what it means to
``flwr run``). Every check that can fail fails here, with one sentence, and nothing is written.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.common.config import parse_config_args

from nebula_fl.clients.protocol import key_path
from nebula_fl.components import resolve, settle
from nebula_fl.config import PRESETS, RunConfig, check_known_keys
from nebula_fl.data.datasets import plan_partition, resolve_dataset_path, train_test_split
from nebula_fl.devices import PRECISIONS, check_visible, resolve_precision, server_device, visible_gpus, worker_devices
from nebula_fl.errors import NebulaError
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.storage.run_folder import RunFolder
from nebula_fl.tasks import TaskSetup, make_task, task_class
from nebula_fl.tasks.first_records import try_examples

FLAG_KEYS = {
    "rounds": "num-server-rounds",
    "local_steps": "local-steps",
    "round_overlap": "round-overlap",
    "outer_optimizer": "outer-optimizer",
    "partition": "partition",
    "seed": "seed",
    "codec": "comm.codec",
    "secure_aggregation": "secagg.enabled",
    "task": "task.name",
}
RESUME_FLAGS = {"rounds", "port", "device", "precision"}  # hardware may change on resume; the run's config not


@dataclass(kw_only=True)
class LaunchPlan:
    config: RunConfig
    out: Path
    clusters: int
    workers: list[int]
    devices: list[str]
    port: int
    resume: bool
    wan: list[str] | None = None  # one emulated-link profile per cluster, or no emulated WAN
    secure: bool = False  # TLS and SuperNode authentication (launcher/secure.py)
    rewind: bool = False  # move damaged newest checkpoints aside before resuming (RunFolder.rewind_checkpoints)
    cluster_policies: dict[int, dict[str, Any]] | None = None  # an operator's own policy fields, over the run's
    threads_per_cluster: list[int] | None = None  # --threads-per-cluster: torch threads per worker, per cluster
    slowdown_per_cluster: list[float] | None = None  # --slowdown-per-cluster: emulated slower sites on one box
    precisions: list[str] | None = None  # --precision: auto, fp32 or bf16 per cluster (None: every cluster's auto)
    parallel: list[str] | None = None  # --parallel: "ddp" or "fsdp" per cluster (None: ddp everywhere)
    rank_host: Path | None = None  # --rank-host: a running rank host's socket (None: this launch starts its own)

    @property
    def threads(self) -> list[int]:
        """Torch threads per worker: --threads-per-cluster's, else the machine's cores shared evenly by every
        worker of every cluster."""
        if self.threads_per_cluster:
            return list(self.threads_per_cluster)
        cores = os.cpu_count() or 1
        per = max(1, cores // max(1, sum(self.workers)))
        return [per] * self.clusters

    def launcher_record(self) -> dict[str, Any]:
        return {"clusters": self.clusters, "workers": self.workers, "devices": self.devices, "port": self.port,
                "wan": self.wan, "secure": self.secure, "threads_per_cluster": self.threads_per_cluster,
                "slowdown_per_cluster": self.slowdown_per_cluster, "precisions": self.precisions,
                "parallel": self.parallel,
                "cluster_policies": {str(k): v for k, v in (self.cluster_policies or {}).items()}}


MAX_RUN_CONFIG_CHARS = 65_536  # Flower's parser slows down quadratically on long input


def parse_run_config(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    if len(text) > MAX_RUN_CONFIG_CHARS:
        raise NebulaError(f"--run-config is {len(text)} characters long; keep it under {MAX_RUN_CONFIG_CHARS} "
                          "(put long values such as link profiles in the app's pyproject.toml instead)")
    try:
        overrides = parse_config_args([text])
    except Exception as err:  # flwr raises click's exception type with its own sentence
        raise NebulaError(f"--run-config '{text}' cannot be parsed: {getattr(err, 'message', err)}") from None
    check_known_keys(overrides)
    return overrides


def _per_cluster(text: str, clusters: int, flag: str, cast) -> list:
    values = [cast(v.strip()) for v in str(text).split(",") if v.strip()]
    if len(values) == 1:
        values = values * clusters
    if len(values) != clusters:
        raise NebulaError(f"{flag} lists {len(values)} values for {clusters} clusters; give one value or one per cluster")
    return values


def _wan_profiles(text: str | None, clusters: int) -> list[str] | None:
    """One emulated-link profile per cluster from --wan, checked; None without --wan."""
    if not text:
        return None
    from nebula_fl.wan.profile import parse_profile

    specs = _per_cluster(text, clusters, "--wan", str)
    for spec in specs:
        try:
            parse_profile(spec)
        except ValueError as err:
            raise NebulaError(f"--wan: {err}") from None
    return specs


def _positive_int(text: str, flag: str = "--workers-per-cluster", what: str = "workers") -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise NebulaError(f"{flag} has '{text}'; each cluster needs 1 or more {what}")
    return value


def _threads(text: str) -> int:
    value = _positive_int(text, "--threads-per-cluster", "torch threads per worker")
    if value > 1024:
        raise NebulaError(f"--threads-per-cluster has '{text}'; use at most 1024 torch threads per worker")
    return value


def _slowdown(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value <= 1000.0:
        raise NebulaError(f"--slowdown-per-cluster has '{text}'; use a factor from 1 (none) to 1000 per cluster, "
                          "e.g. 1,4")
    return value


def _precision(text: str) -> str:
    if text not in PRECISIONS:
        raise NebulaError(f"--precision has '{text}'; use auto (bf16 on GPU, fp32 on CPU), fp32 or bf16, one value "
                          "or one per cluster")
    return text


def _parallel(text: str) -> str:
    from nebula_fl.devices import check_parallel

    return check_parallel(text, per_cluster=True)


def port_free(port: int) -> bool:
    """Whether the SuperLink could listen on `port`: it binds with SO_REUSEADDR (as uvicorn does), so a
    connection of an earlier run lingering in TIME_WAIT does not make the port busy; a listener does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_plan(args: Any) -> LaunchPlan:
    if args.resume:
        return _resume_plan(args)
    if getattr(args, "rewind", False):
        raise NebulaError("--rewind only goes with --resume DIR: it rewinds that run to its newest intact checkpoint")
    clusters = 2 if args.clusters is None else args.clusters
    preset = args.preset or "demo"
    if clusters < 1:
        raise NebulaError(f"--clusters is {clusters}; a federation needs at least 1 cluster")
    given = parse_run_config(args.run_config)
    task = getattr(args, "task", None) or str(given.get("task.name", "classify"))
    # the generic preset, then the task's own (a pre-training smoke run needs a tiny encoder, not MiniLM)
    flat: dict[str, Any] = {**PRESETS[preset], **task_class(task).presets.get(preset, {})}
    for attr, key in FLAG_KEYS.items():
        if getattr(args, attr, None) is not None:
            flat[key] = getattr(args, attr)
    # wait for every cluster before round 1; go on with at least half of them when some fail later
    flat["wait-for-clusters"] = clusters
    flat["min-clusters"] = (clusters + 1) // 2
    flat.update(given)
    out = Path(args.out).expanduser().resolve() if args.out else _default_out(preset)
    flat["out-dir"] = str(out)
    flat["resume"] = False
    config = RunConfig().replace(flat)
    folder = RunFolder(out)
    if (out / "config.json").exists() or folder.has_checkpoint():
        raise NebulaError(f"run folder '{out}' already holds a run; pass a new --out, or --resume {out}")
    workers = _per_cluster(args.workers_per_cluster or "1", clusters, "--workers-per-cluster", _positive_int)
    devices = _per_cluster(args.device or "cpu", clusters, "--device", str)
    precision = getattr(args, "precision", None)
    threads = getattr(args, "threads_per_cluster", None)
    slowdown = getattr(args, "slowdown_per_cluster", None)
    plan = LaunchPlan(config=config, out=out, clusters=clusters, workers=workers, devices=devices,
                      port=args.port, resume=False, wan=_wan_profiles(args.wan, clusters),
                      secure=bool(getattr(args, "secure", None)),
                      threads_per_cluster=_per_cluster(threads, clusters, "--threads-per-cluster", _threads)
                      if threads else None,
                      slowdown_per_cluster=_per_cluster(slowdown, clusters, "--slowdown-per-cluster", _slowdown)
                      if slowdown else None,
                      cluster_policies=_cluster_policies(getattr(args, "cluster_policy", None), clusters),
                      precisions=_per_cluster(precision, clusters, "--precision", _precision) if precision else None,
                      parallel=_per_cluster(getattr(args, "parallel", None) or "ddp", clusters, "--parallel", _parallel),
                      rank_host=_rank_host(getattr(args, "rank_host", None)))
    _check(plan)
    return plan


def _resume_plan(args: Any) -> LaunchPlan:
    given = [name for name in ("clusters", "local_steps", "round_overlap", "outer_optimizer", "partition", "seed", "out", "run_config",
                               "workers_per_cluster", "preset", "codec", "wan", "secure", "secure_aggregation",
                               "task", "cluster_policy", "threads_per_cluster",
                               "slowdown_per_cluster", "parallel")
             if getattr(args, name, None) is not None]
    if given:
        raise NebulaError(
            f"--resume continues a run with its own config; drop --{given[0].replace('_', '-')} "
            "(only --rounds, --port, --device and --precision may change)"
        )
    folder = RunFolder(args.resume)
    stored = folder.read_config()
    if "run_config" not in stored or "launcher" not in stored:
        raise NebulaError(f"'{folder.path}' was not started by `nebula-fl run`; resume it with flwr run and resume=true")
    flat = dict(stored["run_config"])
    flat.update({"resume": True, "out-dir": str(folder.path)})
    if args.rounds is not None:
        flat["num-server-rounds"] = args.rounds
    config = RunConfig.from_flat(flat)
    rewind = bool(getattr(args, "rewind", False))
    if rewind:  # the damaged ones are moved aside by Federation.run, once every check here has passed
        done = folder.rewind_plan()[0] or 0
    else:
        ckpt = folder.load_checkpoint()  # a damaged checkpoint stops the resume here, with what to do
        done = ckpt[0] if ckpt else 0
    if done >= config.federation.num_server_rounds:
        raise NebulaError(
            f"run '{folder.path}' already completed {done} of {config.federation.num_server_rounds} rounds; "
            "pass --rounds N with N larger to extend it"
        )
    launcher = stored["launcher"]
    clusters = int(launcher["clusters"])
    # another machine, or GPUs freed: a cluster's snapshots load onto any device (not bit-exactly across kinds)
    devices = _per_cluster(args.device, clusters, "--device", str) if getattr(args, "device", None) else list(
        launcher["devices"])
    precision = getattr(args, "precision", None)
    precisions = (_per_cluster(precision, clusters, "--precision", _precision) if precision
                  else launcher.get("precisions"))
    plan = LaunchPlan(config=config, out=folder.path, clusters=clusters,
                      workers=list(launcher["workers"]), devices=devices,
                      port=args.port, resume=True, wan=launcher.get("wan"), secure=bool(launcher.get("secure")),
                      rewind=rewind, threads_per_cluster=launcher.get("threads_per_cluster"),
                      slowdown_per_cluster=launcher.get("slowdown_per_cluster"), precisions=precisions,
                      parallel=launcher.get("parallel"),
                      cluster_policies={int(k): v for k, v in (launcher.get("cluster_policies") or {}).items()},
                      rank_host=_rank_host(getattr(args, "rank_host", None)))
    _check(plan)
    return plan


def _rank_host(given: str | None) -> Path | None:
    """--rank-host SOCKET: a rank host this user started (`python -m nebula_fl.clients.rank_host --socket SOCKET`)
    that every cluster of this launch forks its ranks from, so that runs in a row pay torch's imports once."""
    if given is None:
        return None
    path = Path(given).expanduser().resolve()
    if not path.is_socket() or not key_path(path).is_file():
        raise NebulaError(f"--rank-host '{given}': no rank host serves there; start one with `python -m "
                          f"nebula_fl.clients.rank_host --socket {path}`, or drop --rank-host to start one per launch")
    return path


def _cluster_policies(given: list[str] | None, clusters: int) -> dict[int, dict[str, Any]]:
    """--cluster-policy N=FILE: cluster N's operator's own policy fields (checked), applied over the run's."""
    import json

    from nebula_fl.privacy.policy import PrivacyPolicy

    out: dict[int, dict[str, Any]] = {}
    for item in given or []:
        index, sep, path = item.partition("=")
        if not sep or not index.strip().isdigit() or not 0 <= int(index) < clusters:
            raise NebulaError(f"--cluster-policy '{item}' is not N=FILE with N a cluster (0..{clusters - 1})")
        try:
            fields = json.loads(Path(path).expanduser().read_text())
        except OSError as err:
            raise NebulaError(f"--cluster-policy: cannot read '{path}' ({err.strerror}); pass an existing JSON file") from None
        except ValueError as err:
            raise NebulaError(f"--cluster-policy: '{path}' is not valid JSON ({err}); fix the file") from None
        if isinstance(fields, dict) and isinstance(fields.get("secagg_peers"), str):  # beside the policy file
            fields["secagg_peers"] = str(Path(path).expanduser().resolve().parent / fields["secagg_peers"])
        # one clear line for a bad field; the roster is this launcher's unless the file names one, or takes the
        # server's word for the members instead (secagg_trust_server_membership)
        roster = isinstance(fields, dict) and not fields.get("secagg_trust_server_membership")
        checked = {"secagg_peers": "launcher-roster", **fields} if roster else fields
        PrivacyPolicy.from_dict(checked, where=f"--cluster-policy '{path}'")
        out[int(index)] = fields
    return out


def _default_out(preset: str) -> Path:
    import time

    return (Path("runs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def _check(plan: LaunchPlan) -> None:
    """Refuse the plan before anything starts, and settle its config's task-dependent "auto" keys."""
    task = resolve(plan.config).task  # the task, the strategy and their options: refused here, before anything starts
    plan.config = cfg = settle(plan.config)  # the run folder records the task's numbers, not "auto"
    model_path = resolve_model_path(cfg.model.model)
    resolve_dataset_path(cfg.data.dataset)
    train, _ = train_test_split(cfg.data, seed=cfg.federation.seed, targets=task.targets)
    parts = plan_partition(cfg.data, seed=cfg.federation.seed, num_clusters=plan.clusters, targets=task.targets,
                           train=train)
    for i, (part, workers) in enumerate(zip(parts, plan.workers, strict=True)):
        if len(part) < workers:
            raise NebulaError(
                f"cluster {i} gets {len(part)} examples with partition '{cfg.data.partition}' over "
                f"{plan.clusters} clusters ({workers} worker(s) need at least {workers}); raise the Dirichlet "
                "alpha, use fewer clusters, or use 'iid'"
            )
    try_examples(make_task(cfg.task.name, cfg.task_options), setup=TaskSetup(
        model=cfg.model, labels=list(train.label_names), seed=cfg.federation.seed, path=model_path,
        privacy_mode=cfg.privacy.mode), texts=train.texts, labels=train.labels)
    if plan.port and not port_free(plan.port):
        raise NebulaError(f"port {plan.port} on 127.0.0.1 is in use; pass --port N (or --port 0 to pick a free one)")
    per_cluster = [worker_devices(spec, workers=w, where=f"--device (cluster {i})")
                   for i, (spec, w) in enumerate(zip(plan.devices, plan.workers, strict=True))]
    if any(d != "cpu" for ds in per_cluster for d in ds):
        visible = visible_gpus()
        for i, ds in enumerate(per_cluster):
            check_visible(ds, visible=visible, where=f"--device (cluster {i})")
    mode = cfg.privacy.mode
    for i, ds in enumerate(per_cluster):
        policy_mode = (plan.cluster_policies or {}).get(i, {}).get("mode", mode)
        resolve_precision(plan.precisions[i] if plan.precisions else "auto", device_kind=ds[0].split(":")[0],
                          privacy_mode=policy_mode, where=f"--precision (cluster {i})")
    if cfg.federation.server_device != "auto" or any(d != "cpu" for ds in per_cluster for d in ds):
        server_device(cfg.federation.server_device, visible=visible_gpus())
