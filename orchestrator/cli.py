"""The `orchestrator` command: build the tiny model, bring a cluster up, report its status."""

from __future__ import annotations

import argparse
import subprocess
import sys


def tiny_model(path: str | None) -> int:
    """Build the tiny model in a child process: the orchestrator itself never imports torch."""
    cmd = [sys.executable, "-m", "engine.tiny_model"] + ([path] if path else [])
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orchestrator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("tiny-model", help="build the deterministic tiny model (offline)")
    build.add_argument("path", nargs="?", help="output directory (default: the builtin:tiny cache)")
    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        return tiny_model(args.path)
    return 2


if __name__ == "__main__":
    sys.exit(main())
