"""`lbd` command: one entry point, one subcommand per component; each loads only what it needs."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("lbd.serve.cli", "Serve a model: one engine rank, or a data-parallel deployment (internal, "
                                "multi-node with --headless, hybrid, Ray) built from supervise + route."),
    "supervise": ("lbd.supervisor.cli", "Run a node's DP ranks on their own ports, probe and restart them."),
    "scale": ("lbd.supervisor.scale_cli", "Resize a node (supervise or serve) to N local ranks at run time."),
    "route": ("lbd.router.cli", "Balance OpenAI HTTP traffic over rank endpoints using their telemetry."),
    "bench": ("lbd.bench.cli", "Load-test any OpenAI endpoint and report latency and throughput."),
}


def _usage() -> str:
    lines = ["usage: lbd <command> [flags]   (lbd <command> --help lists every flag with its default)", "",
             "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(version("lbd"))
        return 0
    entry = COMMANDS.get(argv[0])
    if entry is None:
        print(f"lbd: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
