"""`liandan dash [DIR]`: the live web dashboard of the runs in a project directory."""

from __future__ import annotations

import argparse


def add_commands(sub) -> None:
    p = sub.add_parser(
        "dash",
        description="Serve the runs under DIR (the directory that holds the run directories, run.output_dir) as a"
        " web page: runs, curves with incidents marked, their evidence, per-rank health, comparisons. Bound to"
        " 127.0.0.1 unless --host says otherwise; elsewhere every API request needs a token.",
    )
    p.add_argument("dir", nargs="?", default="runs", help="project directory (default: runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one, printed)")
    p.add_argument("--token", help="token asked of every API request (generated when bound off loopback)")
    p.set_defaults(command=cmd_dash)


def cmd_dash(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.track.dash.serve import serve

    serve(args.dir, host=args.host, port=args.port, token=args.token, say=lambda m: print(m, flush=True))
    return 0
