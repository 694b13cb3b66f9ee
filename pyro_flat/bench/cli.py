"""Command line of the comparison harness: ``python -m pyro_flat bench ...`` and ``python -m pyro_flat list``."""

from __future__ import annotations

import argparse
import ast
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from .config import PRESETS
from .registry import DATASETS, METHODS, MODELS


def _parse_option(text: str) -> tuple[str, str, object]:
    """``method.key=value`` (value parsed as a Python literal when possible)."""
    try:
        target, value = text.split("=", 1)
        method, key = target.split(".", 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--set expects method.key=value, got {text!r}") from None
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return method, key, parsed


def build_parser() -> argparse.ArgumentParser:
    from . import methods as _methods  # noqa: F401  (fills the registry)

    parser = argparse.ArgumentParser(prog="python -m pyro_flat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered methods, datasets and models")
    bench = sub.add_parser("bench", help="train and evaluate methods over datasets and seeds")
    bench.add_argument("--datasets", nargs="+", default=["digits"], metavar="NAME",
                       help=f"datasets among {sorted(DATASETS)} (default: digits)")
    bench.add_argument("--methods", nargs="+", default=["all"], metavar="NAME",
                       help="methods, or 'all' (default); see `list`")
    bench.add_argument("--seeds", type=int, default=1, help="number of seeds, run as 0..n-1 (default 1)")
    bench.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="hyperparameter preset")
    bench.add_argument("--model", choices=sorted(MODELS), default=None, help="model builder (default: preset's)")
    bench.add_argument("--epochs", type=int, default=None, help="override the preset's number of epochs")
    bench.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: preset's)")
    bench.add_argument("--dtype", choices=["float32", "float64"], default=None)
    bench.add_argument("--compile", action="store_true", default=None,
                       help="compiled flat objectives and kernels (JitSharpnessAwareELBO, ..., jit_compile=True)")
    bench.add_argument("--set", dest="options", type=_parse_option, action="append", default=[],
                       metavar="METHOD.KEY=VALUE", help="per-method hyperparameter, e.g. f_vi.rho=0.1")
    bench.add_argument("--out", type=Path, default=Path("results/quick"), help="output folder (default results/quick)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        print("methods:")
        for spec in METHODS.values():
            base = f"  (flat counterpart of {spec.baseline})" if spec.baseline else ""
            print(f"  {spec.name:<16} {spec.description}{base}")
        print("datasets:", ", ".join(sorted(DATASETS)))
        print("models:  ", ", ".join(sorted(MODELS)))
        return 0

    methods = list(METHODS) if args.methods == ["all"] else args.methods
    for name in methods:
        if name not in METHODS:
            parser.error(f"unknown method {name!r}; known methods: {', '.join(METHODS)} (or 'all')")
    for name in args.datasets:
        if name not in DATASETS:
            parser.error(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}")
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    options: dict[str, dict[str, object]] = {}
    for method, key, value in args.options:
        if method not in METHODS:
            parser.error(f"--set names unknown method {method!r}; known methods: {', '.join(METHODS)}")
        options.setdefault(method, {})[key] = value
    changes = {k: v for k, v in (("model", args.model), ("num_epochs", args.epochs), ("device", args.device),
                                 ("dtype", args.dtype), ("compile", args.compile)) if v is not None}
    try:
        config = PRESETS[args.preset].replace(options=options, **changes)
    except ValueError as err:
        parser.error(str(err))

    from ..data import ClassificationData
    from .registry import DATASETS as _DATASETS
    from .report import markdown_table, plot_reliability, write_json
    from .runner import run_benchmark

    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m pyro_flat " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    records = run_benchmark(args.datasets, methods, list(range(args.seeds)), config, progress=not args.no_progress)
    table = markdown_table(records)
    print(table)
    (args.out / "table.md").write_text(f"`{command}`\n\n{table}\n")
    write_json(args.out / "results.json", records, config, command)
    for dataset in args.datasets:
        data: ClassificationData = _DATASETS[dataset](flatten=config.model != "cnn")
        plot_reliability(args.out / f"reliability_{dataset}.png", [r for r in records if r.dataset == dataset], data)
    print(f"wrote {args.out}/table.md, results.json and reliability_*.png")
    return 0
