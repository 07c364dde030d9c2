"""`nebula-fl site --config site.toml`: one cluster's three services, supervised.

The trainer (``nebula-fl trainer``: the cluster's ranks and its privacy policy), the SuperNode (``flower-supernode``
in process isolation, TLS and node authentication unless the config says insecure) and its ClientApp runner
(``nebula-fl clientapp``: only nebula-fl's own ClientApp runs here, whatever bundle a run brings). They start in
that order and stop in the reverse one; the SuperNode's "refused" exit (Flower's 305) is waited out and retried
(``deploy/supervisor.py``). All three run as the user that starts the site; the split into a trainer user and a
SuperNode user stays the three-unit recipe of examples/across_machines (docs: Across machines, Deploying a cluster).
"""

from __future__ import annotations

import os
import sys

from nebula_fl.deploy.site_config import SiteConfig
from nebula_fl.deploy.supervisor import Service
from nebula_fl.launcher.federation import _bin, child_env, superexec_secret

# flwr's SUPERNODE_CONNECTION_ERROR: the SuperNode exits with status 1 and says this in its log
SUPERNODE_REFUSED = "Exit Code: 305"
REFUSED_RETRY_S = 10.0
REFUSED_WHY = ("the SuperLink refused this SuperNode: its last session is still marked online (until about a "
               "minute after a restart), or its key is not registered there (flwr supernode register)")


def site_services(cfg: SiteConfig) -> list[Service]:
    """The site's services, in start order; makes its private run folder (socket, SuperExec secret, FLWR_HOME)."""
    run = cfg.state_dir / "run"
    run.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(run, 0o700)
    sock = run / "trainer.sock"
    secret = superexec_secret(run / "superexec.secret")  # new at every start: only this site's runner holds it
    env = child_env(cfg.state_dir / "flwr")
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # the ranks pick it: loopback on one machine, else the route to node 0
        env.pop("GLOO_SOCKET_IFNAME", None)
    tls = (["--insecure"] if cfg.insecure else
           ["--root-certificates", str(cfg.ca), "--auth-supernode-private-key", str(cfg.node_key)])
    trainer = Service(
        name="trainer", env=env, cwd=cfg.state_dir,
        argv=[sys.executable, "-m", "nebula_fl", "trainer", *(["--socket", str(sock)] if cfg.node_rank == 0 else []),
              "--cluster-id", str(cfg.cluster_id), "--state-dir", str(cfg.state_dir / "trainer"), *cfg.trainer_flags],
    )
    if cfg.node_rank > 0:  # another machine of a cluster: its ranks only; node 0's SuperNode serves the cluster
        return [trainer]
    supernode = Service(
        name="supernode", env=env, cwd=cfg.state_dir, retry={SUPERNODE_REFUSED: (REFUSED_RETRY_S, REFUSED_WHY)},
        argv=[_bin("flower-supernode"), "--superlink", cfg.superlink, *tls, "--isolation", "process",
              "--superexec-auth-secret-file", str(secret), "--port", str(cfg.runtime_port),
              "--node-config", f'trainer="{sock}" cluster-id={cfg.cluster_id}'],
    )
    runner = Service(
        name="clientapp", env=env, cwd=cfg.state_dir,
        argv=[sys.executable, "-m", "nebula_fl", "clientapp", "--runtime-api-address",
              f"127.0.0.1:{cfg.runtime_port}", "--superexec-auth-secret-file", str(secret)],
    )
    return [trainer, supernode, runner]


def describe(cfg: SiteConfig) -> str:
    if cfg.node_rank > 0:
        return f"site: cluster {cfg.cluster_id}, node {cfg.node_rank} (its trainer only); state {cfg.state_dir}"
    link = "insecure (plain HTTP)" if cfg.insecure else f"TLS (CA {cfg.ca}), node key {cfg.node_key}"
    return (f"site: cluster {cfg.cluster_id} -> SuperLink {cfg.superlink}, {link}; state {cfg.state_dir}, logs "
            f"{cfg.log_dir}" + (f", health http://{cfg.health}/health" if cfg.health else ""))
