"""What the cluster example's workers and router share: the directory flags, names and look-ups.

A worker started with `--directory etcd://host:port/<cluster>` registers
(prefill) or follows (decode) ranks there instead of being told addresses:
the prefill worker's record carries its RPC address in `meta["rpc"]`, so one
directory look-up gives a decode worker both the pdxfer record to `expect`
from and the worker to ask for the prompt. Slots are named after the model's
weights digest, so workers of two different models never resolve each other.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdxfer.cliargs import positive_float
from pdxfer.directory import PeerRecord, Slot, engine_record, open_directory


def model_name(model: Any) -> str:
    """The slots' model component: the weights digest, so only the same model resolves."""
    return f"hybrid-{model.digest()[:12]}"


def add_directory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--directory", default=None, metavar="URL",
                        help="peer directory: etcd://host:port[,host:port]/<cluster>")
    parser.add_argument("--ttl", type=positive_float, default=2.0,
                        help="with --directory: seconds a dead worker stays listed (its lease)")


def open_from_args(args: argparse.Namespace, follow: tuple = ()) -> Any:
    """The directory the flags name, or None without --directory."""
    if args.directory is None:
        return None
    return open_directory(args.directory, ttl=args.ttl, follow=follow)


def register_prefill(directory: Any, instance: str, model: Any, engine: Any, pools: Any,
                     rpc: str) -> PeerRecord:
    """Register a TP-1 prefill worker's rank, its RPC address in the record's meta."""
    slot = Slot(model_name(model), "prefill", instance)
    record, layouts = engine_record(slot, engine, pools, meta={"rpc": rpc})
    directory.register(slot, record, layouts)
    return record


def resolve_prefill(directory: Any, model: Any, instance: str) -> PeerRecord:
    """The live record of prefill `instance`, or LookupError saying it is not listed."""
    group = directory.group(model_name(model), "prefill", instance, 0)
    if group is None:
        raise LookupError(f"prefill instance {instance!r} is not in the directory (down, or "
                          "not started)")
    return group[0]
