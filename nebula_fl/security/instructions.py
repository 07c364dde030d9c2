"""What `nebula-fl certs` prints: the files it wrote, and the exact Flower flags and config that use them."""

from __future__ import annotations

import shlex

from nebula_fl.security.certs import CertificateSet

FLOWER_PORT = 8000  # flower-superlink's default --port
LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def q(path: object) -> str:
    return shlex.quote(str(path))


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def instructions(certs: CertificateSet, *, port: int = FLOWER_PORT) -> str:
    """Lines for a terminal: each file and where it goes, then the commands of each host, copy-pastable."""
    public = [h for h in certs.hosts if h not in LOOPBACK] or list(certs.hosts)
    address = _address(public[0], port)
    lines = [f"wrote {certs.folder}:",
             f"  {certs.ca_cert.name:<26} CA certificate: copy to every cluster and to every host that runs flwr",
             f"  {certs.ca_key.name:<26} CA private key (0600): keep it on this host, or delete it",
             f"  {certs.server_cert.name:<26} SuperLink certificate for {', '.join(certs.hosts)}",
             f"  {certs.server_key.name:<26} SuperLink private key (0600): stays on the SuperLink host"]
    for i, (key, pub) in enumerate(zip(certs.cluster_keys, certs.cluster_public_keys, strict=True)):
        lines.append(f"  {key.name + ', ' + pub.name:<26} cluster {i}'s SuperNode key pair: copy the private key "
                     f"to cluster {i} only; register the .pub")
    lines += ["", "SuperLink host:",
              f"  flower-superlink --ssl-ca-certfile {q(certs.ca_cert)} --ssl-certfile {q(certs.server_cert)} \\",
              f"      --ssl-keyfile {q(certs.server_key)} --enable-supernode-auth --disable-runtime-dependency-installation \\",
              f"      --host 0.0.0.0 --port {port} --database superlink.db --log-file superlink.log"
              "   # every interface; registrations kept across restarts",
              "", "$FLWR_HOME/config.toml (~/.flwr by default) wherever flwr runs, with the path of ca.crt there:",
              '  [superlink]', '  default = "remote"', '  [superlink.remote]', f'  address = "{address}"',
              f'  root-certificates = "{certs.ca_cert}"']
    if certs.cluster_keys:
        lines += ["", "register each cluster before its SuperNode starts (once per SuperLink state):"]
        lines += [f"  flwr supernode register {q(pub)} remote" for pub in certs.cluster_public_keys]
        lines += ["", "each cluster, with ca.crt and its own private key copied there:"]
        lines += [f"  flower-supernode --superlink {address} --root-certificates {certs.ca_cert.name} "
                  f"--auth-supernode-private-key {key.name} ..." for key in certs.cluster_keys]
    lines += ["", f"SuperNodes and flwr must reach the SuperLink by one of: {', '.join(certs.hosts)}"]
    if "127.0.0.1" not in certs.hosts:
        lines.append("note: a SuperLink on --host 0.0.0.0 starts its ServerApp against 127.0.0.1 over TLS, which this "
                     "certificate does not cover; make it again with 127.0.0.1 in --hosts (and --force)")
    return "\n".join(lines)
