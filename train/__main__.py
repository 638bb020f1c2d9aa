"""Entry point of one training rank.

Run under torchrun:
    torchrun --standalone --nproc-per-node 4 -m train --config configs/tiny-dp4.yaml [--run-dir DIR] [--resume auto] [--set steps=6]
or as a single process (world size 1) with `python -m train --config ...`.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys

from ground.typedconfig import ConfigError
from train.entry import run_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="training config YAML")
    parser.add_argument("--run-dir", default=None, help="output directory (default: runs/<timestamp>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. steps=6 or parallel.dp=2 (repeatable)")
    parser.add_argument("--resume", default=None, metavar="auto|none|PATH",
                        help="resume from the newest good checkpoint (auto) or a given one")
    args = parser.parse_args(argv)
    # A rank that dies of a fatal signal (SIGSEGV in a kernel or a collective) prints its Python stacks to stderr
    # first: the healer's crash classifier reads them from the log tail ("Fatal Python error: Segmentation fault").
    faulthandler.enable()
    overrides = args.overrides + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    try:
        run_rank(args.config, overrides, args.run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
