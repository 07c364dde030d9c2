"""Transport security for federations: TLS certificates and SuperNode authentication keys."""

from nebula_fl.security.certs import CertificateSet, check_hosts, load_certificates, make_certificates

__all__ = ["CertificateSet", "check_hosts", "load_certificates", "make_certificates"]
