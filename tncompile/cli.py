"""``tncompile`` command line: ``tncompile inspect <module>:<factory> --target-ratio R [--batch-sizes B ...] [--code]``."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from torch import nn

from .api import compile as compile_model
from .runtime.kernels.executor import generated_code_dump

__all__ = ["main"]


def _load_factory(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"error: expected <module>:<factory>, e.g. tncompile.testing:six_encoder; got {spec!r}")
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"error: cannot import {module_name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise SystemExit(f"error: {module_name!r} has no attribute {attr!r}") from e


def _inspect(args: argparse.Namespace) -> int:
    built = _load_factory(args.factory)()
    model, example = (built if isinstance(built, tuple) else (built, None))
    if not isinstance(model, nn.Module):
        raise SystemExit(f"error: {args.factory} returned {type(model).__name__}, expected an nn.Module "
                         "or (nn.Module, example_inputs)")
    compiled = compile_model(model, target_ratio=args.target_ratio, example_inputs=example,
                                 dump_dir=args.dump_dir, init=args.init,
                                 batch_sizes=args.batch_sizes or None)
    print(compiled.report())
    print()
    print(compiled.program.dump(args.format))
    if args.code:
        code = generated_code_dump((str(node.target), mod) for node, mod in compiled.program.modules())
        print()
        print(code or "# no layer is planned yet: give --batch-sizes, or a factory that returns "
                      "(model, example_inputs)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tncompile", description="Compile a model into tensor-train form and show what came out.",
        epilog="example: tncompile inspect tncompile.testing:six_encoder --target-ratio 0.05 --batch-sizes 32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="compile a model and print its report and final IR")
    ins.add_argument("factory", help="<module>:<callable> returning a model or (model, example_inputs)")
    ins.add_argument("--target-ratio", type=float, required=True, help="params(compiled)/params(model)")
    ins.add_argument("--dump-dir", default=None, help="write the IR after every pass here")
    ins.add_argument("--format", choices=("text", "json", "dot"), default="text")
    ins.add_argument("--init", choices=("svd", "random"), default="svd")
    ins.add_argument("--batch-sizes", type=int, nargs="+", default=None, metavar="B",
                     help="plan the contractions for these batch sizes")
    ins.add_argument("--code", action="store_true",
                     help="also print the Python each planned contraction runs")
    args = parser.parse_args(argv)
    try:
        return _inspect(args)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
