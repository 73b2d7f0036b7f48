"""The ``--otlp-traces-endpoint`` rules every program shares (the engine's front end and the router).

Standard library only: the router checks the flag without importing the OpenTelemetry SDK or torch.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

OTLP_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def check_otlp_endpoint(endpoint: str) -> str | None:
    """Why ``--otlp-traces-endpoint`` cannot work (None when it can); shared by the engine and the router.

    vLLM exports OTLP/gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf; lbd ships only the
    HTTP exporter, so any other protocol is refused instead of silently sending nothing."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--otlp-traces-endpoint {endpoint!r}: use an OTLP/HTTP URL such as http://collector:4318"
    protocol = os.environ.get(OTLP_PROTOCOL_ENV, "http/protobuf")
    if protocol != "http/protobuf":
        return (f"{OTLP_PROTOCOL_ENV}={protocol}: only the OTLP/HTTP exporter is installed; unset it or use "
                "http/protobuf")
    return None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: an endpoint given without a path gets the standard /v1/traces."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint
