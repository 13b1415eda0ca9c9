"""`globalloader` command line: serve | stop | status | demo."""

from __future__ import annotations

import argparse
import sys

from globalloader.errors import GlobalLoaderError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="globalloader", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="one epoch on a synthetic JPEG set, next to torch's DataLoader")
    demo.add_argument("--images", type=int, default=1000, help="synthetic images to make (once)")
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--no-shared", dest="shared", action="store_false",
                      help="skip the second act (three jobs, independent then through one server)")
    demo.add_argument("--shared-memory", default="256M", help="the second act's server pool, e.g. 128M")
    serve = sub.add_parser("serve", help="run the global loader server in the foreground")
    serve.add_argument("--memory", default="2G", help="buffer pool size, e.g. 512M, 4G")
    serve.add_argument("--workers", type=int, default=None, help="decode workers (default: one per core)")
    serve.add_argument("--socket", default=None, help="socket path (default: the user's runtime folder)")
    stop = sub.add_parser("stop", help="stop the global loader server cleanly")
    stop.add_argument("--socket", default=None)
    status = sub.add_parser("status", help="live table of the server's jobs, pool and savings")
    status.add_argument("--socket", default=None)
    status.add_argument("--once", action="store_true", help="print one table and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from globalloader import demo

            demo.main(images=args.images, workers=args.workers, batch_size=args.batch_size,
                      shared=args.shared, shared_memory=args.shared_memory)
        elif args.command == "serve":
            from globalloader.service import server

            forwarded = ["--memory", args.memory] + (["--socket", args.socket] if args.socket else [])
            return server.main(forwarded + (["--workers", str(args.workers)] if args.workers else []))
        else:
            from pathlib import Path

            from globalloader.service import launcher, protocol, status

            path = Path(args.socket) if args.socket else protocol.default_socket()
            if args.command == "stop":
                print("stopped" if launcher.stop(path) else f"no server runs at {path}")
            else:
                status.watch(path, once=args.once)
    except GlobalLoaderError as exc:
        cause = f" (cause: {exc.__cause__})" if exc.__cause__ else ""
        print(f"globalloader: {exc}{cause}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
