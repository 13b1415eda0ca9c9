"""`globalloader` command line: serve | stop | status | demo | cache | convert."""

from __future__ import annotations

import argparse
import os
import sys

from globalloader._version import __version__
from globalloader.errors import ArgumentError, GlobalLoaderError

_SOCKET_HELP = (
    "the server's socket (default: $GLOBALLOADER_SOCKET if set, else server.sock in "
    "$XDG_RUNTIME_DIR/globalloader, or in a per-user globalloader-<uid> folder of the temp dir)"
)
_ENVIRONMENT = """environment variables:
  GLOBALLOADER_SOCKET     the server's socket when --socket is not given (serve, stop, status,
                          and every Loader(share=True) without server=)
  GLOBALLOADER_DASHBOARD_TOKEN  status --web: a fixed token (at least 16 characters) instead of a
                          new random one per start, e.g. for a Prometheus scrape config
  GLOBALLOADER_CACHE_DIR  where tar indexes, disk caches, downloaded objects and the demo's
                          images are kept (default: $XDG_CACHE_HOME/globalloader, else
                          ~/.cache/globalloader); it must be the user's own
  GLOBALLOADER_CACHE_SHARED  group: share that folder with its group (default: private)
  GLOBALLOADER_CACHE_LIMIT  size limit of the downloaded objects, e.g. 50GB (default: 20GB)"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every option's default after its help, except where the help already says it
    (None defaults and switches, whose help explains them in words); keeps the epilog's layout."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or isinstance(default, bool)
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: {default})"


def _parser() -> argparse.ArgumentParser:
    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=_ENVIRONMENT, formatter_class=_HelpFormatter)

    parser = argparse.ArgumentParser(
        prog="globalloader", description=__doc__, epilog=_ENVIRONMENT, formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = command("demo", "epochs on a synthetic JPEG set, next to torch's DataLoader; then several jobs at once")
    demo.add_argument("--images", type=int, default=1000, help="synthetic images to make (once, in the cache folder)")
    demo.add_argument("--workers", type=int, default=2, help="worker processes per loader (and per job)")
    demo.add_argument("--batch-size", type=int, default=64, help="samples per batch of the first act")
    demo.add_argument(
        "--runs", type=int, default=3, help="runs of each measurement; the median is shown with the min and max"
    )
    demo.add_argument(
        "--no-shared",
        dest="shared",
        action="store_false",
        help="skip the second act (three jobs, independent then through one server)",
    )
    demo.add_argument("--shared-memory", default="256M", help="the second act's server pool, e.g. 128M")
    serve = command("serve", "run the global loader server in the foreground")
    serve.add_argument("--memory", default="2G", help="buffer pool size, e.g. 512M, 4G")
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"decode worker processes (default: one per core, {os.cpu_count() or 1} here)",
    )
    serve.add_argument("--socket", default=None, help=_SOCKET_HELP)
    serve.add_argument(
        "--idle-exit",
        type=float,
        default=0.0,
        help="exit after this many seconds with no jobs (0: never; servers a Loader starts use 60)",
    )
    stop = command("stop", "stop the global loader server cleanly")
    stop.add_argument("--socket", default=None, help=_SOCKET_HELP)
    status = command("status", "live table (or, with --web, dashboard) of the server's jobs, pool and savings")
    status.add_argument("--socket", default=None, help=_SOCKET_HELP)
    status.add_argument("--once", action="store_true", help="print one table and exit")
    status.add_argument(
        "--web",
        action="store_true",
        help="serve a live dashboard and Prometheus /metrics on 127.0.0.1 (its address, with a token, is printed)",
    )
    status.add_argument("--port", type=int, default=8470, help="the dashboard's port with --web (0: any free port)")
    cache = command("cache", "the machine-wide cache of downloaded objects: how big it is, or empty it")
    cache.add_argument("action", choices=["info", "clear"], help="info: size, downloads, hits; clear: delete all")
    convert = command(
        "convert",
        "write a dataset (MDS, LitData or Hugging Face folders, tar shards, Parquet files or an image folder;"
        " local or a URL) as tar or Parquet shards",
    )
    convert.add_argument("source", help="the dataset: a folder, a file, a pattern (shard-{000..009}.tar) or a URL")
    convert.add_argument(
        "dest",
        help="a folder (shards named shard-%%06d.tar in it) or a pattern with a number field, such as "
        "out/train-%%05d.tar; local or a URL",
    )
    convert.add_argument("--workers", type=int, default=2, help="worker processes reading the source")
    convert.add_argument("--maxcount", type=int, default=None, help="samples per shard at most (default: no limit)")
    convert.add_argument(
        "--maxsize", default=None, help="bytes per shard at most, e.g. 512MB (default: 256MB without --maxcount)"
    )
    convert.add_argument("--format", choices=["tar", "parquet"], default="tar", help="the shards' format")
    convert.add_argument(
        "--storage-options",
        default=None,
        help='JSON options for object storage (fsspec), e.g. \'{"endpoint_url": "http://..."}\' (default: none)',
    )
    return parser


def _convert(args: argparse.Namespace) -> None:
    import json

    from globalloader.dataset import Dataset
    from globalloader.execution import write_shards
    from globalloader.sources.detect import open_source
    from globalloader.storage import parse_size

    try:
        options = None if args.storage_options is None else json.loads(args.storage_options)
    except ValueError as exc:
        raise ArgumentError(f"convert: --storage-options is not JSON ({exc})") from None
    if args.workers < 0:
        raise ArgumentError(f"convert: --workers must be >= 0, got {args.workers}")
    maxsize = None if args.maxsize is None else parse_size(args.maxsize, "--maxsize")
    dest = args.dest
    if "%" not in dest and not dest.endswith((".tar", ".parquet")):  # a folder
        dest = dest.rstrip("/") + f"/shard-%06d.{args.format}"
    kind, source = open_source(args.source, options)
    paths = write_shards(
        Dataset(source),
        dest,
        args.workers,
        maxcount=args.maxcount,
        maxsize=maxsize,
        storage_options=options,
        format=args.format,
    )
    print(f"{len(source):,} samples ({kind}) from {args.source}: {len(paths)} shards in {dest}")


def _cache(action: str) -> None:
    from globalloader.storage import ObjectCache

    cache = ObjectCache()
    if action == "clear":
        print(f"freed {cache.clear():,} bytes in {cache.root}")
        return
    counts = cache.recount()
    print(
        f"folder      {cache.root}\nobjects     {counts['entries']}\nsize        {counts['bytes']:,} bytes\n"
        f"limit       {cache.limit:,} bytes\ndownloaded  {counts['downloaded_bytes']:,} bytes\n"
        f"misses      {counts['misses']:,}\nhits        {counts['hits']:,}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from globalloader import demo

            demo.main(
                images=args.images,
                workers=args.workers,
                batch_size=args.batch_size,
                runs=args.runs,
                shared=args.shared,
                shared_memory=args.shared_memory,
            )
        elif args.command == "cache":
            _cache(args.action)
        elif args.command == "convert":
            _convert(args)
        elif args.command == "serve":
            from globalloader.service import server

            forwarded = ["--memory", args.memory, "--idle-exit", str(args.idle_exit)]
            forwarded += ["--socket", args.socket] if args.socket else []
            return server.main(forwarded + (["--workers", str(args.workers)] if args.workers is not None else []))
        else:
            from pathlib import Path

            from globalloader.service import launcher, protocol, status

            path = Path(args.socket) if args.socket else protocol.default_socket()
            if args.command == "stop":
                print("stopped" if launcher.stop(path) else f"no server runs at {path}")
            elif args.web:
                from globalloader.service import dashboard

                if args.once:
                    raise ArgumentError("status: --once and --web exclude each other")
                dashboard.serve(path, port=args.port)
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
