"""Make what a TLS-secured, node-authenticated Flower federation needs, with ``cryptography`` alone.

In one folder: a CA (``ca.key``, ``ca.crt``), the SuperLink's certificate signed by it for the given
host names and addresses (``server.crt``, ``server.key``), and per cluster a NIST P-384 key pair in
OpenSSH format (``cluster-<i>``, ``cluster-<i>.pub``): what flwr 1.42's ``flower-superlink
--ssl-*``, ``flower-supernode --root-certificates / --auth-supernode-private-key`` and ``flwr supernode
register KEY.pub`` take. Private keys are written mode 0600 and every file atomically (temp file +
rename), so an interrupted run never leaves half a key; an existing set is never overwritten unless
asked. The CA key signs nothing after this; keep it on the server host (or delete it).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nebula_fl.errors import NebulaError

CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.crt", "server.key"
CLUSTER_KEY = "cluster-{}"  # the private key; the public one is the same name + ".pub"
CURVE = ec.SECP384R1  # NIST P-384: what Flower suggests for SuperNode keys; used for the CA and server too
CLOCK_SKEW = dt.timedelta(minutes=5)  # certificates are valid from a little before now
MAX_DAYS = 3650
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True, kw_only=True)
class CertificateSet:
    """Where one set's files are (all absolute paths) and which hosts the server certificate covers."""

    folder: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    cluster_keys: tuple[Path, ...]  # private keys, OpenSSH format; the public key is ``<key>.pub``
    hosts: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("ca_cert", "ca_key", "server_cert", "server_key"):
            if not getattr(self, name).is_absolute():
                raise ValueError(f"CertificateSet.{name} must be an absolute path, got {getattr(self, name)}")

    @property
    def cluster_public_keys(self) -> tuple[Path, ...]:
        return tuple(key.with_name(key.name + ".pub") for key in self.cluster_keys)

    def superlink_flags(self) -> list[str]:
        """``flower-superlink`` flags: TLS with this set, and only registered SuperNodes admitted."""
        return ["--ssl-ca-certfile", str(self.ca_cert), "--ssl-certfile", str(self.server_cert),
                "--ssl-keyfile", str(self.server_key), "--enable-supernode-auth"]

    def supernode_flags(self, cluster: int) -> list[str]:
        """``flower-supernode`` flags of one cluster: trust this CA, sign every request with its key."""
        if not 0 <= cluster < len(self.cluster_keys):
            raise NebulaError(f"the certificates in {self.folder} hold keys for {len(self.cluster_keys)} cluster(s), "
                              f"not cluster {cluster}; make a set with --clusters {cluster + 1} or more")
        return ["--root-certificates", str(self.ca_cert), "--auth-supernode-private-key", str(self.cluster_keys[cluster])]


def check_hosts(hosts: Iterable[str]) -> tuple[str, ...]:
    """The hosts as given (duplicates dropped), each a valid IP address or DNS name; else a one-line error."""
    if isinstance(hosts, str):
        raise NebulaError(f"hosts must be a list of names and addresses, got the string {hosts!r}; "
                          "split it, e.g. 'localhost,127.0.0.1'.split(',')")
    out: list[str] = []
    for raw in hosts:
        host = str(raw).strip()
        if not _is_ip(host) and not _is_dns_name(host):
            raise NebulaError(f"host {raw!r} is neither an IP address nor a DNS name; give names like "
                              "server.example.org and addresses like 10.0.0.5 or ::1 (no port, no scheme)")
        if host not in out:
            out.append(host)
    if not out:
        raise NebulaError("no hosts given for the SuperLink certificate; pass the names and addresses the "
                          "SuperNodes connect to, e.g. --hosts localhost,127.0.0.1,server.example.org")
    return tuple(out)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_dns_name(host: str) -> bool:
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        return False
    return not all(label.isdigit() for label in labels)  # 300.1.1.1 is a broken address, not a name


def _san(host: str) -> x509.GeneralName:
    if _is_ip(host):
        return x509.IPAddress(ipaddress.ip_address(host))
    return x509.DNSName(host)


def _files(folder: Path, clusters: int) -> list[Path]:
    names = [CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY]
    for i in range(clusters):
        names += [CLUSTER_KEY.format(i), CLUSTER_KEY.format(i) + ".pub"]
    return [folder / name for name in names]


def _existing(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    fixed = {CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY}
    return sorted(p for p in folder.iterdir() if p.name in fixed or re.fullmatch(r"cluster-\d+(\.pub)?", p.name))


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Write ``data`` to ``path`` whole or not at all; a private file is 0600 from its first byte."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600 if private else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nebula-fl"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificates(*, folder: str | Path, hosts: Sequence[str], clusters: int, days: int = 365,
                      force: bool = False) -> CertificateSet:
    """Create a CA, a SuperLink certificate for ``hosts`` and ``clusters`` P-384 SuperNode key pairs in ``folder``.

    Refuses (one-line NebulaError) if ``folder`` already holds a set, unless ``force``, which replaces it
    (and removes cluster keys beyond ``clusters``). Returns the paths written.
    """
    names = check_hosts(hosts)
    if isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 0:
        raise NebulaError(f"clusters is {clusters!r}; pass how many SuperNode key pairs to make (0 or more)")
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_DAYS:
        raise NebulaError(f"days is {days!r}; certificates need a validity of 1 to {MAX_DAYS} days")
    root = Path(folder).expanduser().resolve()
    if root.exists() and not root.is_dir():
        raise NebulaError(f"{root} is a file, not a folder; pass a folder for the certificates")
    present = _existing(root)
    if present and not force:
        raise NebulaError(f"{root} already holds certificates or keys ({present[0].name}, ...); "
                          "pass --force (force=True) to replace them, or choose another folder")
    if not root.exists():
        root.mkdir(parents=True, mode=0o700)  # a new folder is private; an existing one keeps its mode
    wanted = set(_files(root, clusters))
    for stale in present:
        if stale not in wanted:
            stale.unlink()

    now = dt.datetime.now(dt.UTC)
    start, end = now - CLOCK_SKEW, now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(CURVE())
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("nebula-fl federation CA")).issuer_name(_name("nebula-fl federation CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = ec.generate_private_key(CURVE())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0])).issuer_name(ca_cert.subject)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    _write(root / CA_KEY, _pem_key(ca_key), private=True)
    _write(root / SERVER_KEY, _pem_key(server_key), private=True)
    _write(root / SERVER_CERT, server_cert.public_bytes(serialization.Encoding.PEM), private=False)
    keys = []
    for i in range(clusters):
        key = ec.generate_private_key(CURVE())
        path = root / CLUSTER_KEY.format(i)
        _write(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()), private=True)
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        _write(path.with_name(path.name + ".pub"), public + f" nebula-fl-cluster-{i}\n".encode(), private=False)
        keys.append(path)
    # last: a folder with ca.crt holds a whole set (what `nebula-fl run --secure` checks before reusing one)
    _write(root / CA_CERT, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    return CertificateSet(folder=root, ca_cert=root / CA_CERT, ca_key=root / CA_KEY, server_cert=root / SERVER_CERT,
                          server_key=root / SERVER_KEY, cluster_keys=tuple(keys), hosts=names)


def load_certificates(*, folder: str | Path) -> CertificateSet:
    """The set ``make_certificates`` wrote in ``folder`` (its hosts read back from the server certificate)."""
    root = Path(folder).expanduser().resolve()
    missing = [p.name for p in _files(root, 0) if not p.is_file()]
    if missing:
        raise NebulaError(f"{root} lacks {missing[0]}; make the set with `nebula-fl certs {root} --hosts ...`")
    keys = []
    while (root / CLUSTER_KEY.format(len(keys))).is_file():
        path = root / CLUSTER_KEY.format(len(keys))
        if not path.with_name(path.name + ".pub").is_file():
            raise NebulaError(f"{path} has no public key {path.name}.pub beside it; remake the set with --force")
        keys.append(path)
    try:
        cert = x509.load_pem_x509_certificate((root / SERVER_CERT).read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as err:
        raise NebulaError(f"{root / SERVER_CERT} is not a server certificate made by nebula-fl ({err}); "
                          "remake the set with --force") from None
    hosts = tuple(str(name.value) for name in sans)
    return CertificateSet(folder=root, ca_cert=root / CA_CERT, ca_key=root / CA_KEY, server_cert=root / SERVER_CERT,
                          server_key=root / SERVER_KEY, cluster_keys=tuple(keys), hosts=hosts)
