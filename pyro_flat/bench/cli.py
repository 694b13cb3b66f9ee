"""Command line of the comparison harness: ``python -m pyro_flat bench ...``, ``python -m pyro_flat recipe ...``,
``python -m pyro_flat list`` and ``python -m pyro_flat data synthetic-cifar DIR``.

A user error (a bad flag or value, a missing folder or file, a configuration a job is bound to fail on) ends in one
line on stderr, ``prog: error: ...``, naming the flag as typed, and exit status 2, before the output folder is
created. Flags are not abbreviated (``--method`` is not ``--methods``); a typo gets the nearest flag suggested. The
parsing and these checks import neither torch nor Pyro, so ``--help`` and argument errors answer at once; the names
of the registries (methods, datasets, models, recipes) are checked once those are imported.

A run ends in one clear line too (its tracebacks go to ``OUT/run.log``): exit status 0 when every job finished, 1
when a job failed (the others ran; ``--fail-fast`` stops at the first) or a fault ended the run (a full disk, a rank
that stopped answering), 130 / 143 when SIGINT / SIGTERM stopped it at a step boundary; the line says where the
finished results and the last checkpoint are and the exact command that continues the run.

Under ``torchrun`` (``WORLD_SIZE`` set, even to 1) ``bench`` and ``recipe`` run data-parallel: one process per device
(``cuda:LOCAL_RANK`` with NCCL for ``--device cuda``, gloo on CPU), each on its shard of every minibatch; rank 0
writes the outputs (:mod:`pyro_flat.bench.session`). This module only parses: it turns the flags into the plain
arguments of :func:`~pyro_flat.bench.session.run_and_report` and :func:`~pyro_flat.bench.recipes.run_recipe`.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import shlex
import signal
import sys
import textwrap
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from .. import __version__
from .config import COMPILE_AUTO_STEPS, LATENT_CHOICES, PRESETS, RunConfig
from .signals import stop_on_signals

DEFAULT_TIMEOUT_MINUTES = 10.0
"""``--dist-timeout``'s default (:data:`~pyro_flat.bench.session.DEFAULT_TIMEOUT`, which this module does not import:
it would import torch)."""

RUN_ARGUMENTS = {  # CLI flag -> RunConfig field
    "model": "model", "epochs": "num_epochs", "batch_size": "batch_size", "lr": "lr", "prior_scale": "prior_scale",
    "bma_samples": "num_bma_samples", "device": "device", "dtype": "dtype", "norm": "norm", "depth": "depth",
    "width": "width", "latent": "latent", "pretrained": "pretrained", "optimizer": "optimizer",
    "lr_schedule": "lr_schedule", "data_root": "data_root", "shots": "shots", "num_workers": "num_workers",
    "precision": "precision", "lambda_max_draws": "lambda_max_draws", "lambda_max_points": "lambda_max_points",
    "lambda_max_iters": "lambda_max_iters", "compile": "compile",
}
FLAGS = {field: "--" + flag.replace("_", "-") for flag, field in RUN_ARGUMENTS.items()} | {
    "hidden": "--hidden", "augment": "--no-augment", "channels_last": "--channels-last", "packed": "--per-tensor-sites"}
"""The flag that sets each ``RunConfig`` field, for errors that name what the user typed."""

DESCRIPTION = """\
The pyro_flat comparison harness. bench trains every chosen method on every chosen dataset for each seed, then writes a
markdown table (mean and std over seeds), results.json (every seed's metrics, the configuration, the environment), a
per-epoch log, learning curves, reliability diagrams and a figure of each flat method against its non-flat base; the
presets are explained by python -m pyro_flat bench --help. recipe runs a seed paper's headline experiment and writes
the paper's numbers beside ours. list shows the methods, datasets, models and recipes. data synthetic-cifar writes a
stand-in CIFAR folder (random images in the real on-disk format) for trying the image datasets and recipes.
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``prog: error: message (see prog --help)`` on stderr, exit status 2), no
    abbreviated flags, and the nearest flag suggested for one it does not know."""

    commands: dict[str, argparse.ArgumentParser]
    """The parser of each command (``bench``, ``recipe``, ``data``), for errors found after parsing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)  # the subcommands' parsers are of this class too

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") != "0":  # under torchrun every rank refuses alike: rank 0 says it
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: object = None) -> argparse.Namespace:
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = getattr(self, "commands", {}).get(getattr(namespace, "command", None), self)
            parser.error(_unrecognized(parser, extras))
        return namespace


def _unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``unrecognized argument --method (did you mean --methods?)``: the first unknown flag and the nearest known."""
    flags = [a for a in extras if a.startswith("-")]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    typed = flags[0].split("=", 1)[0]
    known = [flag for action in parser._actions for flag in action.option_strings]
    nearest = difflib.get_close_matches(typed, known, n=1, cutoff=0.6)
    return f"unrecognized argument {typed}" + (f" (did you mean {nearest[0]}?)" if nearest else "")


def flag_message(message: str) -> str:
    """``message`` with each ``RunConfig`` field it names (``RunConfig: `num_epochs```, ``RunConfig.dtype``) replaced
    by the flag that sets it (``--epochs``)."""
    return re.sub(r"RunConfig(?::\s*`|\.)(\w+)`?", lambda m: FLAGS.get(m.group(1), m.group(0)), message)


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
    return "\n".join([*lines, "The flags above (--epochs, --model, --lr, --set, ...) override a preset."])


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags shared by ``bench`` and ``recipe``: architecture, data, optimisation, GPU knobs, checkpoints."""
    group = parser.add_argument_group("model and data")
    group.add_argument("--model", default=None, metavar="NAME",
                       help="model builder (default: preset's mlp; python -m pyro_flat list shows them)")
    group.add_argument("--hidden", type=int, nargs="+", default=None, help="MLP hidden widths / CNN channels")
    group.add_argument("--norm", choices=["batch", "group"], default=None, help="ResNet normalisation layers")
    group.add_argument("--depth", type=int, default=None, help="PreResNet / WRN depth (20, 56, 164 / 28)")
    group.add_argument("--width", type=int, default=None, help="ResNet-18 / PreResNet width, WRN widen factor")
    group.add_argument("--latent", choices=LATENT_CHOICES, default=None, help="which ResNet weights are latent")
    group.add_argument("--pretrained", default=None, metavar="FILE",
                       help="torchvision resnet18 ImageNet weights (a state dict file) for resnet18_imagenet")
    group.add_argument("--data-root", default=None, metavar="DIR",
                       help="folder of the image datasets (cifar10, cifar100, svhn, mnist, fashionmnist)")
    group.add_argument("--shots", type=int, default=None, help="training examples per class (few-shot)")
    group.add_argument("--no-augment", action="store_true", help="no random crops/flips for image data")
    group = parser.add_argument_group("optimisation")
    group.add_argument("--epochs", type=int, default=None, help="override the preset's number of epochs")
    group.add_argument("--batch-size", type=int, default=None)
    group.add_argument("--lr", type=float, default=None, help="Adam's learning rate, or SGD's on the mean loss")
    group.add_argument("--optimizer", choices=["adam", "sgd"], default=None)
    group.add_argument("--lr-schedule", choices=["constant", "cosine"], default=None)
    group.add_argument("--prior-scale", type=float, default=None)
    group.add_argument("--bma-samples", type=int, default=None, help="posterior draws in the BMA")
    group.add_argument("--lambda-max-draws", type=int, default=None, help="posterior draws at which λ_max is measured")
    group.add_argument("--lambda-max-points", type=int, default=None, help="training points in λ_max's loss")
    group.add_argument("--lambda-max-iters", type=int, default=None, help="power iterations for λ_max")
    group.add_argument("--set", dest="options", type=_parse_option, action="append", default=[],
                       metavar="METHOD.KEY=VALUE", help="per-method hyperparameter, e.g. f_vi.rho=0.1")
    group = parser.add_argument_group("devices")
    group.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: preset's)")
    group.add_argument("--dtype", choices=["float32", "float64"], default=None)
    group.add_argument("--precision", choices=["float32", "bf16"], default=None,
                       help="bf16: the network's forward pass under autocast (the objectives' algebra stays float32)")
    group.add_argument("--channels-last", action="store_true", help="channels-last memory format (GPUs)")
    group.add_argument("--per-tensor-sites", action="store_true",
                       help="one sample site per weight tensor (default: all latent weights packed in one site)")
    group.add_argument("--num-workers", type=int, default=None,
                       help="build augmented images in N DataLoader workers on the CPU (default 0: on the device)")
    group.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="train every method through its compiled step (the Jit objectives, jit_compile=True; "
                            "CUDA graphs on a GPU). Default: compiled on CUDA for methods of "
                            f"{COMPILE_AUTO_STEPS:,} steps or more, where the steps saved repay the compilation "
                            "(measured on an H200: docs/speed.md), eager otherwise and on a CPU")
    group = parser.add_argument_group("long runs")
    group.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                       help="checkpoint every STEPS steps (0: only at the end of each training phase; without this "
                            "flag or --resume, no checkpoints); checkpoints go to OUT/checkpoints")
    group.add_argument("--resume", action="store_true",
                       help="continue a killed run from OUT/checkpoints, exactly where it stopped")
    group.add_argument("--fail-fast", action="store_true",
                       help="stop at the first job that fails (default: record it as failed, run the others, exit "
                            "status 1 at the end)")
    group.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT_MINUTES, metavar="MINUTES",
                       help="under torchrun: how long a rank waits for the others before the run ends naming the "
                            f"ranks that stopped answering (default {DEFAULT_TIMEOUT_MINUTES:g})")
    group.add_argument("--no-progress", action="store_true", help="no progress bars")
    group.add_argument("--no-figures", action="store_true",
                       help="write the table, JSON and log only, no figures (drawing them takes seconds per dataset "
                            "when many methods run)")


def build_parser() -> _Parser:
    parser = _Parser(prog="python -m pyro_flat", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pyro_flat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered methods (and the base of each flat one), datasets, models and "
                   "recipes")
    bench = sub.add_parser("bench", help="train and evaluate methods over datasets and seeds",
                           description="Train and evaluate methods over datasets and seeds.", epilog=preset_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--datasets", nargs="+", default=["digits"], metavar="NAME",
                       help="datasets (default: digits; python -m pyro_flat list shows them)")
    bench.add_argument("--methods", nargs="+", default=["all"], metavar="NAME",
                       help="methods, or 'all' (default); python -m pyro_flat list shows them")
    bench.add_argument("--seeds", type=int, default=1, help="number of seeds, run as 0..n-1 (default 1)")
    bench.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                       help="hyperparameter preset (default quick; see below)")
    bench.add_argument("--out", type=Path, default=Path("results/quick"), help="output folder (default results/quick)")
    _add_run_arguments(bench)
    recipe = sub.add_parser("recipe", help="a seed paper's headline experiment, with the paper's numbers beside ours")
    recipe.add_argument("name", help="the recipe (python -m pyro_flat list shows them)")
    recipe.add_argument("--preset", choices=["paper", "smoke"], default="paper",
                        help="paper: the paper's budget (GPU hours); smoke: tiny networks, a few steps (CI)")
    recipe.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the recipe's)")
    recipe.add_argument("--out", type=Path, required=True, help="output folder")
    _add_run_arguments(recipe)
    data = sub.add_parser("data", help="write data sets to try the harness without downloads")
    kinds = data.add_subparsers(dest="kind", required=True)
    cifar = kinds.add_parser("synthetic-cifar", help="a stand-in CIFAR-10/100 folder: random 32x32 images with a "
                             "colour per class, in the real on-disk format (for --data-root)",
                             description="Write a stand-in CIFAR folder (pyro_flat.data.write_synthetic_cifar): random "
                             "32x32 images with a colour offset per class, in the real on-disk format, so that "
                             "--datasets cifar10 and the recipes run without the real data (nothing is downloaded).")
    cifar.add_argument("root", type=Path, metavar="DIR", help="the data root to pass as --data-root DIR")
    cifar.add_argument("--dataset", choices=["cifar10", "cifar100"], default="cifar10")
    cifar.add_argument("--num-train", type=int, default=500, help="training images (default 500)")
    cifar.add_argument("--num-test", type=int, default=100, help="test images (default 100)")
    cifar.add_argument("--seed", type=int, default=0, help="seed of the images and labels (default 0)")
    parser.commands = {"bench": bench, "recipe": recipe, "data": cifar}
    return parser


def config_changes(args: argparse.Namespace) -> dict[str, object]:
    """The ``RunConfig`` fields set on the command line."""
    changes = {field: getattr(args, flag) for flag, field in RUN_ARGUMENTS.items() if getattr(args, flag) is not None}
    if args.hidden is not None:
        changes["hidden"] = tuple(args.hidden)
    if args.no_augment:
        changes["augment"] = False
    if args.channels_last:
        changes["channels_last"] = True
    if args.per_tensor_sites:
        changes["packed"] = False
    return changes


def method_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, dict[str, object]]:
    """``--set``'s options as ``{method: {key: value}}``, their methods and keys checked against the registry."""
    from .registry import check_method_options

    options: dict[str, dict[str, object]] = {}
    for method, key, value in args.options:
        options.setdefault(method, {})[key] = value
    try:
        check_method_options(options)
    except ValueError as err:
        parser.error(f"--set: {err}")
    return options


def list_command() -> int:
    """``list``: the registered methods (with the base of each flat one), datasets, models and recipes."""
    from .models import MODELS
    from .recipes import RECIPES
    from .registry import METHODS, dataset_names

    print("methods:")
    for spec in METHODS.values():
        base = f"  (compared with {spec.baseline})" if spec.baseline else ""
        print(f"  {spec.name:<16} {spec.description}{base}")
    print("datasets:", ", ".join(dataset_names()))
    print("models:  ", ", ".join(sorted(MODELS)))
    print("recipes:")
    for recipe in RECIPES.values():
        print(f"  {recipe.name:<22} {recipe.title}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        return list_command()
    command_parser = parser.commands[args.command]
    if args.command == "data":
        return write_data(command_parser, args)
    check_run_arguments(command_parser, args)
    try:
        base = PRESETS[args.preset] if args.command == "bench" else RunConfig()
        base.replace(**config_changes(args))  # the flags' values, checked before torch is imported
    except ValueError as err:
        command_parser.error(flag_message(str(err)))
    run = _Run(command_parser, args, argv)  # from here on torch and Pyro are imported
    try:
        with stop_on_signals():
            failed = run.recipe() if args.command == "recipe" else run.bench()
    except BaseException as error:  # noqa: BLE001 (each fault ends in one line: _Run.fault)
        return run.fault(error)
    return 1 if failed else 0


def _command_line(argv: Sequence[str]) -> str:
    """The shell command that runs ``argv`` the way this process was started (under torchrun: torchrun with as many
    processes per node)."""
    args = " ".join(shlex.quote(a) for a in argv)
    if "WORLD_SIZE" in os.environ:
        return f"torchrun --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '1')} -m pyro_flat {args}"
    return f"python -m pyro_flat {args}"


class _Run:
    """One ``bench`` or ``recipe`` run of the command line: its checks, the run, and the one line that ends it."""

    def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> None:
        self.parser, self.args = parser, args
        self.command = "python -m pyro_flat " + " ".join(shlex.quote(a) for a in argv)
        self.resume_command = _command_line([*argv, "--resume"] if "--resume" not in argv else argv)
        self.checkpoints = args.checkpoint_every is not None or args.resume
        self.timeout = timedelta(minutes=args.dist_timeout)

    def error(self, message: str) -> NoReturn:
        """A user error: one line, exit status 2 (after ending the process group, if any)."""
        from .session import shutdown_distributed

        try:
            shutdown_distributed()
        finally:
            self.parser.error(flag_message(message))

    def bench(self) -> int:
        """The ``bench`` command: check the names and the configuration, then run and report; returns the number of
        failed jobs."""
        from ..data import VISION_DATASETS
        from .files import OutputFolderError, output_lock
        from .registry import METHODS
        from .runner import check_device, check_jobs
        from .session import init_distributed, run_and_report, shutdown_distributed

        args = self.args
        methods = list(METHODS) if args.methods == ["all"] else args.methods
        for name in methods:
            if name not in METHODS:
                self.error(f"unknown method {name!r}; known methods: {', '.join(METHODS)} (or 'all')")
        for name in args.datasets:
            if name in VISION_DATASETS and args.data_root is None:
                self.error(f"dataset {name!r} is read from a local folder: pass --data-root DIR (python -m pyro_flat "
                           "data synthetic-cifar DIR writes a stand-in CIFAR folder)")
        options = method_options(self.parser, args)
        try:
            config = PRESETS[args.preset].replace(options=options, **config_changes(args))
            check_device(config.device)
            config = init_distributed(config, self.timeout)
            check_jobs(args.datasets, methods, config)  # every job, before the output folder exists
        except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
            self.error(str(err))
        try:
            with output_lock(args.out):  # one run at a time writes to --out
                records = run_and_report(args.datasets, methods, args.seeds, config, args.out, command=self.command,
                                         checkpoint_every=args.checkpoint_every, resume=args.resume,
                                         progress=not args.no_progress, figures=not args.no_figures,
                                         fail_fast=args.fail_fast)
        except OutputFolderError as err:
            self.error(str(err))
        shutdown_distributed()
        return sum(r.error is not None for r in records)

    def recipe(self) -> int:
        """The ``recipe`` command; returns the number of failed jobs."""
        from .recipes import RECIPES, run_recipe

        args = self.args
        if args.name not in RECIPES:
            self.error(f"unknown recipe {args.name!r}; known recipes: {', '.join(sorted(RECIPES))}")
        try:
            return run_recipe(args.name, preset=args.preset, seeds=args.seeds, out=args.out,
                              changes=config_changes(args), options=method_options(self.parser, args),
                              command=self.command, checkpoint_every=args.checkpoint_every, resume=args.resume,
                              progress=not args.no_progress, figures=not args.no_figures, fail_fast=args.fail_fast,
                              timeout=self.timeout)
        except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
            self.error(str(err))

    def fault(self, error: BaseException) -> int:
        """End a run that stopped early in one line on stderr (its traceback, if any, in ``OUT/run.log``) and return
        the exit status; data-parallel, end the process at once (the process group may be broken)."""
        from .files import append_log

        if isinstance(error, SystemExit):
            raise error
        line, status, logged = self._describe(error)
        log = self.args.out / "run.log" if self.args.out.is_dir() else None
        written = append_log(log, line + ("\n" + "".join(traceback.format_exception(error)) if logged else ""))
        if logged and written:
            line += f" (traceback in {log})"
        rank = os.environ.get("RANK", "0")
        print(f"pyro_flat: {'' if rank == '0' else f'rank {rank}: '}{line}", file=sys.stderr, flush=True)
        if "WORLD_SIZE" in os.environ:
            sys.stdout.flush()
            os._exit(status)  # the process group may be broken: ending it cleanly could wait for a dead rank
        return status

    def _describe(self, error: BaseException) -> tuple[str, int, bool]:
        """The line that ends a run stopped by ``error``, the exit status, and whether the traceback goes to the log."""
        from .files import disk_full
        from .runner import JobFailed, collective_failure
        from .session import unresponsive_ranks
        from .signals import Interrupted

        out = self.args.out
        done = len(list(out.glob("**/records/*/record.pt")))
        finished = f"the results of the {done} finished job{'s' if done != 1 else ''} are in {out}"
        resume = f"continue with: {self.resume_command}"
        if isinstance(error, KeyboardInterrupt):  # a Ctrl-C outside the run's signal handling
            error = Interrupted(signal.SIGINT)
        if isinstance(error, Interrupted):
            if error.checkpoint is not None:
                state = f"the job's state is saved in {error.checkpoint}"
            elif self.checkpoints:
                state = f"the last checkpoints are in {out / 'checkpoints'}"
            else:
                state = ("no checkpoints were kept (--checkpoint-every), so --resume reuses the finished jobs and "
                         "redoes the unfinished ones from their start")
            return f"stopped by {error.name} {error.where or 'at once'}; {finished}; {state}; {resume}", \
                error.exit_status, False
        if isinstance(error, JobFailed):
            return f"stopped at the first failed job (--fail-fast); {finished}; {resume}", 1, False
        full = disk_full(error)
        if full is not None:
            kept = "the last checkpoint and " if self.checkpoints else ""
            return (f"{full.filename or out}: no space left on device; {kept}the files written before are intact "
                    f"(each is written whole or not at all); {finished}; free some space, then {resume}"), 1, True
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if collective_failure(error):
            ranks = unresponsive_ranks()
            wait = min(self.timeout, timedelta(minutes=1)).total_seconds()
            who = (f"rank {', '.join(map(str, ranks))} did not answer within {wait:g} s: stalled or dead" if ranks
                   else "another rank stopped answering (rank 0 names it)")
            return f"a collective operation with the other ranks failed ({first}); {who}; {finished}; {resume}", 1, True
        if not out.is_dir():
            raise error  # nothing ran yet: a bug, with its traceback
        return f"{type(error).__name__}: {first}; {finished}; {resume}", 1, True


def check_run_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before anything runs, the ``bench``/``recipe`` flags whose values are wrong on their own: counts, and
    the folders and files they name."""
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.data_root is not None and not Path(args.data_root).is_dir():
        parser.error(f"--data-root {args.data_root}: no such folder")
    if args.pretrained is not None and not Path(args.pretrained).is_file():
        parser.error(f"--pretrained {args.pretrained}: no such file")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a folder")
    if not 0 < args.dist_timeout <= 1e6:  # a timedelta holds no more than ~1.6e9 minutes; inf and nan are no timeout
        parser.error(f"--dist-timeout must be a number of minutes in (0, 1e6], got {args.dist_timeout:g}")


def write_data(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``data synthetic-cifar DIR``: write the stand-in CIFAR folder and say how to use it."""
    from ..data import write_synthetic_cifar

    for flag, value in (("--num-train", args.num_train), ("--num-test", args.num_test)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.root.exists() and not args.root.is_dir():
        parser.error(f"{args.root}: exists and is not a folder")
    folder = write_synthetic_cifar(args.root, args.dataset, num_train=args.num_train, num_test=args.num_test,
                                   seed=args.seed)
    print(f"wrote {folder} ({args.num_train} training and {args.num_test} test images of random noise with a colour "
          f"per class, in the real {args.dataset} format); use it with --data-root {args.root}, e.g. python -m "
          f"pyro_flat bench --datasets {args.dataset} --model resnet18 --width 4 --epochs 1 --data-root {args.root}")
    return 0
