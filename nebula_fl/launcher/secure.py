"""How the local federation's processes reach the SuperLink: plain HTTP, or TLS with SuperNode authentication.

``nebula-fl run --secure`` makes a CA, a SuperLink certificate for loopback (``localhost``,
``127.0.0.1``, ``::1``: SuperNodes behind the ``--wan`` proxies connect to ``127.0.0.1:<proxy port>``,
so TLS runs end to end through them) and one P-384 key per cluster in ``<run folder>/certs/``, once;
``--resume`` reuses them. The SuperLink then admits only registered SuperNodes, so each cluster's
public key is registered with ``flwr supernode register`` before its SuperNode starts. The SuperLink
keeps registrations in memory: every launch (a resume too) registers again, and a node id lasts as
long as its SuperLink. Within one SuperLink a key keeps its node id across SuperNode restarts, but a
SuperNode killed without deactivating stays "online" until its heartbeat lapses (up to 60 s in flwr
1.42), and its key is refused (exit code 305) until then.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_fl.errors import NebulaError
from nebula_fl.security.certs import CertificateSet, load_certificates, make_certificates

CERTS_FOLDER = "certs"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
CERT_DAYS = 365
REGISTER_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class Transport:
    """The flags and connection entry of one launch; ``certs=None`` is the plain-HTTP (``--insecure``) launch."""

    certs: CertificateSet | None = None

    @property
    def secure(self) -> bool:
        return self.certs is not None

    def superlink_args(self) -> list[str]:
        return ["--insecure"] if self.certs is None else self.certs.superlink_flags()

    def supernode_args(self, cluster: int) -> list[str]:
        return ["--insecure"] if self.certs is None else self.certs.supernode_flags(cluster)

    def connection(self, address: str) -> dict[str, Any]:
        """One ``[superlink.NAME]`` entry of ``$FLWR_HOME/config.toml`` for ``flwr run`` and ``flwr supernode``."""
        if self.certs is None:
            return {"address": address, "insecure": True}
        return {"address": address, "root-certificates": str(self.certs.ca_cert)}

    def register(self, cluster: int, *, flwr: str, connection: str, env: dict[str, str],
                 timeout: float = REGISTER_TIMEOUT_S) -> int | None:
        """Register ``cluster``'s public key with the SuperLink behind ``connection``; return its node id.

        Plain HTTP needs no registration (SuperNodes register themselves) and returns None.
        """
        if self.certs is None:
            return None
        self.certs.supernode_flags(cluster)  # a one-line error if the set has no key for this cluster
        public = self.certs.cluster_public_keys[cluster]
        argv = [flwr, "supernode", "register", str(public), connection, "--format", "json"]
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            raise NebulaError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s; is the SuperLink up?") from None
        reply = _json_reply(done.stdout)
        if done.returncode != 0 or not reply.get("success") or not isinstance(reply.get("node-id"), int):
            # with --format json, flwr 1.42 exits 0 on failure and says so in the JSON
            said = reply.get("error-message") or (done.stdout + done.stderr)
            tail = " | ".join(line.strip() for line in str(said).strip().splitlines()[-6:] if line.strip())
            status = f" (exit status {done.returncode})" if done.returncode else ""
            raise NebulaError(f"registering cluster {cluster}'s key failed: `{' '.join(argv)}`{status} said: "
                              f"{tail or '(nothing)'}")
        return int(reply["node-id"])


def _json_reply(stdout: str) -> dict[str, Any]:
    """The JSON object ``flwr ... --format json`` prints, or {} if there is none."""
    start = stdout.find("{")
    try:
        reply = json.loads(stdout[start:]) if start >= 0 else {}
    except ValueError:
        return {}
    return reply if isinstance(reply, dict) else {}


def transport_for(run_folder: Path, *, secure: bool, clusters: int) -> Transport:
    """The launch's transport: for ``secure``, the run folder's certificates, made on first use."""
    if not secure:
        return Transport()
    folder = Path(run_folder) / CERTS_FOLDER
    if (folder / "ca.crt").exists():
        certs = load_certificates(folder=folder)
        if len(certs.cluster_keys) < clusters:
            raise NebulaError(f"{folder} holds keys for {len(certs.cluster_keys)} cluster(s) but the run has {clusters}; "
                              "remove that folder to have them all made again")
        return Transport(certs=certs)
    # no ca.crt (written last): nothing there, or what an interrupted first launch left, which is replaced
    return Transport(certs=make_certificates(folder=folder, hosts=LOOPBACK_HOSTS, clusters=clusters, days=CERT_DAYS,
                                             force=True))
