"""`globalloader` command line: `globalloader demo` (more commands come with the service)."""

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from globalloader import demo

            demo.main(images=args.images, workers=args.workers, batch_size=args.batch_size)
    except GlobalLoaderError as exc:
        cause = f" (cause: {exc.__cause__})" if exc.__cause__ else ""
        print(f"globalloader: {exc}{cause}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
