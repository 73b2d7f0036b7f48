"""`lbd scale --node URL --data-parallel-size N [--wait]`: resize a node (`lbd supervise` or `lbd serve`)
to N local ranks through ``POST /scale`` on its health port (lbd.supervisor.scale says what happens).

The token goes in ``Authorization: Bearer``: the first line of ``--token-file``, else ``$LBD_ADMIN_TOKEN``,
else ``$LBD_CLUSTER_TOKEN`` (never on the command line, where others read it in ps). Prints the node's
answer; ``--wait`` then follows the node's /status until the resize is done or failed.

Exit codes: 0 done (or begun, without --wait), 1 the node refused or the resize failed (the node's reason
is printed), or the node could not be reached; 2 bad flags (one line naming the flag).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from lbd.common.cluster import CLUSTER_TOKEN_ENV, ClusterTokenError, read_cluster_token
from lbd.supervisor.flags import ADMIN_TOKEN_ENV, OneLineParser
from lbd.wire.scale import RUNNING, ScaleResult, decode_result

PROG = "lbd scale"
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # /status of a large node is well under this
POLL_S = 0.5
STALE_GRACE_S = 10.0  # lbd serve's /status is its last poll of its supervisor: a resize shows later


class NodeError(Exception):
    """The node refused, or could not be reached: one line for the user."""


def make_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, allow_abbrev=False,
                      description="Resize a node to N local ranks at run time.")
    p.add_argument("--node", required=True, metavar="URL",
                   help="the node's health port, e.g. http://10.0.0.5:9256")
    p.add_argument("--data-parallel-size", type=int, required=True, metavar="N",
                   help="the node's new number of local ranks (>= 1)")
    p.add_argument("--wait", action="store_true", help="follow /status until the resize is done or failed")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="with --wait: give up after this long (the resize goes on)")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help=f"file whose first line is the admin or cluster token (else ${ADMIN_TOKEN_ENV}, "
                        f"else ${CLUSTER_TOKEN_ENV})")
    p.add_argument("--ca-certs", default=None, metavar="PATH", help="verify an https node against these CAs")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    parser = make_parser()
    ns = parser.parse_args(argv)
    if ns.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be >= 1, got {ns.data_parallel_size}")
    url = urlsplit(ns.node)
    if url.scheme not in ("http", "https") or not url.hostname:
        parser.error(f"--node must be an http:// or https:// URL of the node's health port, got {ns.node!r}")
    if ns.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {ns.timeout_s}")
    try:
        ns.token = (read_cluster_token(ns.token_file, {}) if ns.token_file is not None else
                    os.environ.get(ADMIN_TOKEN_ENV) or os.environ.get(CLUSTER_TOKEN_ENV) or None)
    except ClusterTokenError as e:
        parser.error(str(e).replace("--cluster-token-file", "--token-file"))
    return ns


def _call(ns: argparse.Namespace, method: str, path: str, body: bytes | None = None) -> bytes:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if ns.token:
        headers["Authorization"] = f"Bearer {ns.token}"
    req = urllib.request.Request(ns.node.rstrip("/") + path, data=body, method=method, headers=headers)
    ctx = ssl.create_default_context(cafile=ns.ca_certs) if ns.ca_certs else None
    try:
        with urllib.request.urlopen(req, timeout=10.0, context=ctx) as resp:
            return resp.read(MAX_ANSWER_BYTES)
    except urllib.error.HTTPError as e:
        raise NodeError(f"the node answered {e.code}: {_message(e.read(MAX_ANSWER_BYTES))}") from None
    except (urllib.error.URLError, OSError) as e:
        raise NodeError(f"cannot reach {ns.node}: {getattr(e, 'reason', e)}") from None


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace").strip()[:500] or "(no body)"


def describe(r: ScaleResult) -> str:
    text = f"resize {r.previous} -> {r.target} local ranks: {r.state}"
    if r.added:
        text += f"; added ranks {r.added}"
    if r.removing:
        text += f"; removing ranks {r.removing}" if r.state == RUNNING else f"; removed ranks {r.removing}"
    if r.finished_at is not None and r.started_at is not None:
        text += f" ({r.finished_at - r.started_at:.1f} s)"
    return text + (f": {r.error}" if r.error else "")


def wait(ns: argparse.Namespace, begun: ScaleResult) -> ScaleResult:
    """The resize's record from /status once it is no longer running (NodeError after --timeout-s)."""
    start = time.monotonic()
    while time.monotonic() < start + ns.timeout_s:
        time.sleep(POLL_S)
        scaling = json.loads(_call(ns, "GET", "/status")).get("scaling")
        if scaling is None or scaling.get("started_at") != begun.started_at:
            if time.monotonic() > start + STALE_GRACE_S:
                raise NodeError("the node's /status does not show this resize (did it restart?)")
            continue
        if scaling.get("state") != RUNNING:
            return decode_result(json.dumps(scaling).encode())
    raise NodeError(f"the resize still runs after --timeout-s {ns.timeout_s:g}")


def main(argv: list[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    body = json.dumps({"data_parallel_size_local": ns.data_parallel_size}).encode()
    try:
        result = decode_result(_call(ns, "POST", "/scale", body))
        print(describe(result), flush=True)
        if ns.wait and result.state == RUNNING:
            result = wait(ns, result)
            print(describe(result), flush=True)
    except NodeError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"{PROG}: the node's answer is not a resize: {e}", file=sys.stderr)
        return 1
    return 0 if result.state != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
