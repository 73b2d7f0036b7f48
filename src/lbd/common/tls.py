"""TLS with vLLM's flag names (``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``,
``--ssl-cert-reqs``): the context a server listens with, and the verifying context a client (router,
supervisor) talks to an ``https://`` upstream with."""

from __future__ import annotations

import argparse
import ssl
from typing import Any


def add_tls_arguments(parser: argparse.ArgumentParser | Any) -> None:
    g = parser.add_argument_group("TLS") if isinstance(parser, argparse.ArgumentParser) else parser
    g.add_argument("--ssl-keyfile", default=None, help="private key of the server certificate (PEM)")
    g.add_argument("--ssl-certfile", default=None,
                   help="server certificate chain (PEM); with it the port speaks HTTPS only")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="CA bundle (PEM): verifies client certificates (with --ssl-cert-reqs) and, in the "
                        "router and supervisor, the certificates of https:// upstreams and ranks "
                        "(default there: the system's trust store)")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=(0, 1, 2),
                   help="client certificates: 0 = not asked, 1 = optional, 2 = required (verified against "
                        "--ssl-ca-certs)")


def check_tls(certfile: str | None, keyfile: str | None, ca_certs: str | None, cert_reqs: int) -> str | None:
    """Why these flags cannot work (None when they can): loads the files now, so a typo exits 2 at start."""
    if keyfile and not certfile:
        return "--ssl-keyfile needs --ssl-certfile (the certificate that goes with the key)"
    if cert_reqs and not ca_certs:
        return "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CAs that sign client certificates)"
    if cert_reqs and not certfile:
        return "--ssl-cert-reqs needs --ssl-certfile (client certificates are asked over TLS only)"
    try:
        if certfile:
            server_context(certfile, keyfile, ca_certs, cert_reqs)
        elif ca_certs:
            client_context(ca_certs)
    except (OSError, ssl.SSLError, ValueError) as e:
        return f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: cannot load: {e}"
    return None


def server_context(certfile: str | None, keyfile: str | None = None, ca_certs: str | None = None,
                   cert_reqs: int = 0) -> ssl.SSLContext | None:
    """The listening context, or None for plain HTTP (no --ssl-certfile)."""
    if not certfile:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    if ca_certs:
        ctx.load_verify_locations(cafile=ca_certs)
    ctx.verify_mode = ssl.VerifyMode(cert_reqs)
    return ctx


def client_context(ca_certs: str | None = None) -> ssl.SSLContext:
    """Verifies the peer's certificate and host name, against ``ca_certs`` or the system's trust store."""
    ctx = ssl.create_default_context(cafile=ca_certs)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
