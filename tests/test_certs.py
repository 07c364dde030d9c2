"""The certificate set: a CA that really signs a server certificate for exactly the hosts given, P-384
SuperNode keys in the OpenSSH format Flower loads, private files 0600, nothing overwritten unasked."""

import ipaddress
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from nebula_fl.cli import main
from nebula_fl.errors import NebulaError
from nebula_fl.security import check_hosts, load_certificates, make_certificates

HOSTS = ["localhost", "127.0.0.1", "::1", "server.example.org"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(folder=tmp_path_factory.mktemp("c") / "certs", hosts=HOSTS, clusters=2, days=30)


def _load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_the_ca_signs_the_server_certificate_for_exactly_the_hosts_given(certs):
    ca, server = _load(certs.ca_cert), _load(certs.server_cert)
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = [str(n.value) for n in server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]
    assert sans == HOSTS
    assert isinstance(server.public_key(), ec.EllipticCurvePublicKey)
    days = (server.not_valid_after_utc - server.not_valid_before_utc).days
    assert 30 <= days <= 31

    # A verifier that trusts only this CA accepts each given name or address, and nothing else.
    verifier = PolicyBuilder().store(Store([ca]))
    for host in HOSTS:
        try:
            subject = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            subject = x509.DNSName(host)
        verifier.build_server_verifier(subject).verify(server, [])
    with pytest.raises(VerificationError):
        verifier.build_server_verifier(x509.DNSName("evil.example.org")).verify(server, [])
    with pytest.raises(VerificationError):
        verifier.build_server_verifier(x509.IPAddress(ipaddress.ip_address("10.0.0.1"))).verify(server, [])


def _handshake(certs, server_hostname: str) -> str:
    """A real TLS handshake on loopback: the server with our key and certificate, a client trusting our CA."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs.server_cert, certs.server_key)
    client_ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(tls.recv(5))
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with (socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
                  client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls):
                tls.sendall(b"hello")
                return tls.recv(5).decode()
        finally:
            thread.join(10)


def test_a_tls_client_trusting_the_ca_connects_and_checks_the_name(certs):
    assert _handshake(certs, "127.0.0.1") == "hello"
    assert _handshake(certs, "localhost") == "hello"
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(certs, "evil.example.org")


def test_cluster_keys_are_p384_openssh_pairs_and_private_files_are_0600(certs):
    assert [k.name for k in certs.cluster_keys] == ["cluster-0", "cluster-1"]
    publics = []
    for key_path, pub_path in zip(certs.cluster_keys, certs.cluster_public_keys, strict=True):
        key = load_ssh_private_key(key_path.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        public = load_ssh_public_key(pub_path.read_bytes())
        assert public == key.public_key()
        assert pub_path.read_text().startswith("ecdsa-sha2-nistp384 ")
        publics.append(public)
    assert publics[0] != publics[1]
    for private in (certs.ca_key, certs.server_key, *certs.cluster_keys):
        assert _mode(private) == 0o600, private
    for public in (certs.ca_cert, certs.server_cert, *certs.cluster_public_keys):
        assert _mode(public) == 0o644, public
    assert _mode(certs.folder) == 0o700
    assert sorted(p.name for p in certs.folder.iterdir()) == sorted(
        ["ca.crt", "ca.key", "server.crt", "server.key", "cluster-0", "cluster-0.pub", "cluster-1", "cluster-1.pub"]
    )  # no temp file left behind
    assert load_certificates(folder=certs.folder) == certs


def test_an_existing_set_is_never_overwritten_unless_forced(tmp_path):
    first = make_certificates(folder=tmp_path, hosts=["localhost"], clusters=3)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(NebulaError, match=r"already holds.*--force"):
        make_certificates(folder=tmp_path, hosts=["localhost"], clusters=3)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    second = make_certificates(folder=tmp_path, hosts=["127.0.0.1"], clusters=1, force=True)
    assert second.ca_cert == first.ca_cert and second.ca_cert.read_bytes() != before["ca.crt"]
    assert second.cluster_keys[0].read_bytes() != before["cluster-0"]
    assert not (tmp_path / "cluster-2").exists() and not (tmp_path / "cluster-1.pub").exists()  # stale keys gone
    assert load_certificates(folder=tmp_path).hosts == ("127.0.0.1",)


@pytest.mark.parametrize("bad", ["300.1.2.3", "server:8000", "https://server", "-bad.example.org", "a..b", "exa mple",
                                 "x" * 64 + ".org", "server_1.example.org"])
def test_a_bad_host_is_a_one_line_error_naming_it(tmp_path, bad):
    with pytest.raises(NebulaError) as err:
        make_certificates(folder=tmp_path / "c", hosts=["localhost", bad], clusters=1)
    assert repr(bad) in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "c").exists()  # nothing written


def test_hosts_are_checked_and_deduplicated_in_order():
    assert check_hosts(["localhost", " 127.0.0.1 ", "localhost", "fe80::1", "xn--bcher-kva.example"]) == (
        "localhost", "127.0.0.1", "fe80::1", "xn--bcher-kva.example")
    for bad in ([], "localhost"):
        with pytest.raises(NebulaError):
            check_hosts(bad)


@pytest.mark.parametrize("kwargs", [{"clusters": -1}, {"clusters": 1.5}, {"days": 0}, {"days": 100_000}])
def test_counts_out_of_range_are_refused(tmp_path, kwargs):
    with pytest.raises(NebulaError):
        make_certificates(**{"folder": tmp_path, "hosts": ["localhost"], "clusters": 1, **kwargs})


def test_the_certs_command_prints_files_and_flower_flags_then_refuses_to_overwrite(tmp_path, capsys):
    folder = tmp_path / "certs"
    assert main(["certs", str(folder), "--hosts", "localhost,127.0.0.1,server.example.org", "--clusters", "2"]) == 0
    out = capsys.readouterr().out
    for text in (f"--ssl-ca-certfile {folder}/ca.crt", f"--ssl-certfile {folder}/server.crt",
                 f"--ssl-keyfile {folder}/server.key", "--enable-supernode-auth",
                 f"flwr supernode register {folder}/cluster-1.pub remote", "--auth-supernode-private-key cluster-1",
                 "--root-certificates ca.crt", 'address = "server.example.org:8000"',
                 f'root-certificates = "{folder}/ca.crt"',
                 # reachable from the clusters' hosts (Flower binds 127.0.0.1 by default), registrations on disk
                 "--host 0.0.0.0 --port 8000 --database superlink.db"):
        assert text in out, text
    assert len(load_certificates(folder=folder).cluster_keys) == 2

    assert main(["certs", str(folder), "--hosts", "localhost"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nebula-fl: error:") and "--force" in err and "\n" not in err
    assert main(["certs", str(folder), "--hosts", "localhost", "--clusters", "1", "--force"]) == 0
    assert len(load_certificates(folder=folder).cluster_keys) == 1
    assert main(["certs", str(tmp_path / "other"), "--hosts", "localhost,10.0.0.256"]) == 2
    assert "'10.0.0.256'" in capsys.readouterr().err
