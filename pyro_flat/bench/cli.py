"""Command line of the comparison harness: ``python -m pyro_flat bench ...`` and ``python -m pyro_flat list``."""

from __future__ import annotations

import argparse
import ast
import shlex
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from .. import __version__
from .config import PRESETS, RunConfig
from .registry import DATASETS, METHODS, MODELS

DESCRIPTION = """\
The pyro_flat comparison harness: trains every chosen method on every chosen dataset for each seed, then writes a
markdown table (mean and std over seeds), results.json (every seed's metrics, the configuration, the environment),
reliability diagrams and a figure of each flat method against its non-flat base. The presets are explained by
python -m pyro_flat bench --help.
"""


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


def preset_help() -> str:
    """Plain text: what each preset sets, and what every preset shares."""
    defaults = RunConfig()
    shared = (f"every preset: {defaults.model.upper()} {'-'.join(map(str, defaults.hidden))}, prior N(0, "
              f"{defaults.prior_scale:g}^2), Adam lr {defaults.lr:g}, minibatches of {defaults.batch_size}, "
              f"dropout {defaults.dropout:g} for the MC-Dropout methods, lambda_max of the mean training NLL on "
              f"{defaults.lambda_max_points} training points, {defaults.dtype} on {defaults.device}")
    purpose = {"quick": "shorter runs: to try methods or check a change",
               "full": "the configuration behind the committed result tables"}
    lines = ["presets:"]
    for name, config in sorted(PRESETS.items(), key=lambda item: item[0] != "quick"):
        lines.append(f"  {name:<6}  {config.num_epochs} epochs, {config.num_bma_samples} posterior draws per "
                     f"prediction, ensembles of {config.ensemble_size}, lambda_max at {config.lambda_max_draws} "
                     f"draws ({config.lambda_max_iters} iterations)")
        if name in purpose:
            lines.append(f"          ({purpose[name]})")
    lines += textwrap.wrap(shared, width=110, initial_indent="  ", subsequent_indent="          ",
                           break_on_hyphens=False)
    return "\n".join([*lines, "--epochs, --model, --device, --dtype and --set override a preset."])


def build_parser() -> argparse.ArgumentParser:
    from . import methods as _methods  # noqa: F401  (fills the registry)

    parser = argparse.ArgumentParser(prog="python -m pyro_flat", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pyro_flat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered methods (and the base of each flat one), datasets and models")
    bench = sub.add_parser("bench", help="train and evaluate methods over datasets and seeds",
                           description="Train and evaluate methods over datasets and seeds.", epilog=preset_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--datasets", nargs="+", default=["digits"], metavar="NAME",
                       help=f"datasets among {sorted(DATASETS)} (default: digits)")
    bench.add_argument("--methods", nargs="+", default=["all"], metavar="NAME",
                       help="methods, or 'all' (default); python -m pyro_flat list shows them")
    bench.add_argument("--seeds", type=int, default=1, help="number of seeds, run as 0..n-1 (default 1)")
    bench.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                       help="hyperparameter preset (default quick; see below)")
    bench.add_argument("--model", choices=sorted(MODELS), default=None, help="model builder (default: preset's)")
    bench.add_argument("--epochs", type=int, default=None, help="override the preset's number of epochs")
    bench.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: preset's)")
    bench.add_argument("--dtype", choices=["float32", "float64"], default=None)
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
                                 ("dtype", args.dtype)) if v is not None}
    try:
        config = PRESETS[args.preset].replace(options=options, **changes)
    except ValueError as err:
        parser.error(str(err))

    from ..data import ClassificationData
    from .registry import DATASETS as _DATASETS
    from .report import markdown_table, plot_flat_vs_base, plot_reliability, record_dict, write_json
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
        plot_flat_vs_base(args.out / f"flat_vs_base_{dataset}.png", [record_dict(r) for r in records], dataset)
    print(f"wrote {args.out}/table.md, results.json, reliability_*.png and flat_vs_base_*.png")
    return 0
