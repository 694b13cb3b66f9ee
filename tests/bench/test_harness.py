import json

import pytest
import torch

from pyro_flat.bench import METHODS, PRESETS, RunConfig, register_method
from pyro_flat.bench.cli import main
from pyro_flat.bench.registry import lookup
from pyro_flat.bench.report import markdown_table, summarise
from pyro_flat.bench.runner import RunRecord, run_benchmark, run_one

TINY = RunConfig(hidden=(32,), num_epochs=8, lr=1e-2, num_bma_samples=4, ensemble_size=2, lambda_max_draws=1,
                 lambda_max_points=64, lambda_max_iters=10)


@pytest.mark.parametrize("method", ["map", "vi", "mc_dropout", "ensemble"])
def test_baselines_learn_digits(method):
    record = run_one(method, "digits", 0, TINY)
    m = record.metrics
    # 8 epochs (Adam, lr 1e-2) of a 64-32-10 MLP on digits reach ~95 %, far above the 10 % of chance
    assert m["acc"] > 0.8
    assert 0 < m["nll"] < 1.0
    assert 0 <= m["ece"] < 0.2
    assert 0 <= m["brier"] < 0.4
    assert m["lambda_max"] > 0  # near a minimum the top eigenvalue of the Hessian is positive
    assert {"ood_auroc_entropy", "ood_auroc_maxprob"} <= set(m)
    assert record.fit_seconds > 0
    assert record.test_probs.shape == (540, 10)


def test_seeds_are_reproducible_and_distinct():
    a = run_one("map", "digits", 0, TINY.replace(num_epochs=1))
    b = run_one("map", "digits", 0, TINY.replace(num_epochs=1))
    c = run_one("map", "digits", 1, TINY.replace(num_epochs=1))
    assert a.metrics["nll"] == b.metrics["nll"]
    assert a.metrics["nll"] != c.metrics["nll"]


def test_a_run_does_not_depend_on_torchs_default_dtype():
    # a float32 run is the same whatever torch's default dtype (the tests' float64, a user's): the network is
    # initialised in the run's dtype (torch's initialisers draw in the dtype a layer is made in; they drew in the
    # default dtype, and a vi run here reached acc 0.82 under float64 against 0.85 under float32)
    runs = []
    for default in (torch.float32, torch.float64):
        torch.set_default_dtype(default)
        runs.append(run_one("vi", "digits", 0, TINY.replace(num_epochs=1)).metrics)
    assert runs[0] == runs[1]


def test_unknown_names_fail_before_training():
    with pytest.raises(ValueError, match="unknown method 'nope'; known methods: .*map"):
        run_benchmark(["digits"], ["nope"], [0], TINY)
    with pytest.raises(ValueError, match="unknown dataset 'cifar'; known datasets: digits, mnist1d"):
        run_benchmark(["cifar"], ["map"], [0], TINY)
    with pytest.raises(ValueError, match="unknown model"):
        lookup({}, "model", "resnet")
    with pytest.raises(ValueError, match="method 'f_vi' has no option 'rhoo'; its options: rho, adaptive"):
        run_benchmark(["digits"], ["f_vi"], [0], TINY.replace(options={"f_vi": {"rhoo": 0.1}}))


def test_every_option_a_method_reads_is_declared():
    # Problem.option refuses an undeclared key, so running every method (the tests of each family do) checks the
    # declarations; here the declarations themselves: each declared key is read by the method's module
    import inspect

    for spec in METHODS.values():
        source = inspect.getsource(inspect.getmodule(spec.fit))
        for key in spec.options:
            assert f'"{key}"' in source, (spec.name, key)


def test_every_declared_option_has_a_rule_for_its_values():
    from pyro_flat.bench.options import OPTION_VALUES

    assert {key for spec in METHODS.values() for key in spec.options} == set(OPTION_VALUES)


@pytest.mark.parametrize("options, message", [
    ({"f_vi": {"rho": -1}}, r"f_vi.rho must be a number >= 0, got -1"),
    ({"f_vi": {"adaptive": "yes"}}, r"f_vi.adaptive must be True or False, got 'yes'"),
    ({"swag": {"swa_start": 8}}, r"swag.swa_start must be an int in \[0, epochs\), got 8"),
    ({"sam_torch": {"m_sharpness": 0}}, r"sam_torch.m_sharpness must be an int in \[1, batch size\], got 0"),
    ({"emcmc": {"collect": "all"}}, r"emcmc.collect must be 'theta', 'anchor' or 'both', got 'all'"),
    ({"sa_bma": {"backbone_swag": "missing.pt"}}, r"the file missing.pt does not exist and no method of this run"),
])
def test_option_values_are_checked_for_every_job_before_the_first_starts(options, message, monkeypatch, capsys):
    """A value a method would refuse stops the run before its first job, not when that method's turn comes."""
    from pyro_flat.bench import runner

    started = []
    monkeypatch.setattr(runner, "run_one", lambda *args, **kwargs: started.append(args))
    methods = ["map", *options]
    with pytest.raises(ValueError, match=message):
        run_benchmark(["digits"], methods, [0], TINY.replace(options=options))
    sets = [f"--set={m}.{k}={v!r}" for m, values in options.items() for k, v in values.items()]
    with pytest.raises(SystemExit):
        main(["bench", "--methods", *methods, "--epochs", "8", *sets, "--out", "unused"])
    assert started == [] and message.split(" must")[0].replace("\\", "") in capsys.readouterr().err


def test_register_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_method("map", description="again")(lambda problem: None)
    assert METHODS["map"].description.startswith("MAP")


@pytest.mark.parametrize("change, match", [({"num_epochs": 0}, "num_epochs"), ({"lr": -1.0}, "lr"),
                                           ({"dropout": 1.0}, "dropout"), ({"dtype": "half"}, "dtype")])
def test_config_validation(change, match):
    with pytest.raises(ValueError, match=match):
        PRESETS["quick"].replace(**change)


def test_summary_mean_and_std():
    records = [RunRecord("d", "m", s, {"acc": a, "nll": 1.0}, 2.0) for s, a in enumerate([0.5, 0.7])]
    (row,) = summarise(records)
    assert row["acc"][0] == pytest.approx(60.0)
    assert row["acc"][1] == pytest.approx(14.142135623730951)  # sample std of (50, 70)
    table = markdown_table(records)
    assert "| m | 60.00 ± 14.14 | 1.0000 ± 0.0000 |" in table


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["bench", "--methods", "map", "sam", "--epochs", "1", "--out", str(out), "--no-progress",
                 "--set", "sam.rho=0.02"])
    assert code == 0
    payload = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in payload["records"]] == ["map", "sam"]
    assert payload["config"]["num_epochs"] == 1 and payload["config"]["options"] == {"sam": {"rho": 0.02}}
    assert (out / "reliability_digits.png").stat().st_size > 1000
    assert (out / "curves_digits.png").stat().st_size > 1000
    assert (out / "flat_vs_base_digits.png").stat().st_size > 1000  # sam against its base, map
    assert "| map |" in (out / "table.md").read_text()
    assert capsys.readouterr().out.endswith(f"wrote {out}/: table.md, results.json, metrics.jsonl, run.log, "
                                            "reliability_digits.png, curves_digits.png, flat_vs_base_digits.png\n")
    assert not (out / ".lock").exists()  # the folder's lock is removed at the end of the run
    # the same folder, a run with no flat-vs-base pair and no logged loss: says only what it wrote, and no figure of
    # the first run stays behind
    assert main(["bench", "--methods", "sgld", "--epochs", "1", "--out", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {out}/: table.md, results.json, metrics.jsonl, run.log, "
                                            "reliability_digits.png\n")
    assert not (out / "flat_vs_base_digits.png").exists() and not (out / "curves_digits.png").exists()
    # --no-figures: the table, JSON and log, and no figure of the earlier run stays behind
    assert main(["bench", "--methods", "sgld", "--epochs", "1", "--out", str(out), "--no-progress",
                 "--no-figures"]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {out}/: table.md, results.json, metrics.jsonl, run.log\n")
    assert not list(out.glob("*.png"))


@pytest.mark.parametrize("argv, match", [
    (["bench", "--methods", "nope"], "unknown method 'nope'"),
    (["bench", "--datasets", "cifar"], "unknown dataset 'cifar'"),
    (["bench", "--datasets", "mnist"], "dataset 'mnist' is read from a local folder: pass --data-root DIR"),
    (["bench", "--datasets", "cifar10", "--data-root", "no/such/folder"], "--data-root no/such/folder: no such folder"),
    (["bench", "--model", "resnet18_imagenet", "--pretrained", "no/such.pth"], "--pretrained no/such.pth: no such"),
    (["bench", "--seeds", "0"], "--seeds must be >= 1"),
    (["bench", "--preset", "huge"], "invalid choice: 'huge'"),
    (["bench", "--set", "novalue"], "method.key=value"),
    (["bench", "--set", "f_vi.rhoo=0.1"], "--set: method 'f_vi' has no option 'rhoo'"),
    (["bench", "--set", "fvi.rho=0.1"], "--set: options given for unknown method 'fvi'"),
    (["bench", "--set", "f_vi.rho=abc"], "f_vi.rho must be a number >= 0, got 'abc'"),
    (["bench", "--set", "emcmc.collect=all"], "emcmc.collect must be 'theta', 'anchor' or 'both', got 'all'"),
    (["bench", "--set", "swag.max_rank=2.5"], "swag.max_rank must be an int >= 1, got 2.5"),
    (["bench", "--set", "f_vi.adaptive=1"], "f_vi.adaptive must be True or False, got 1"),
    (["bench", "--epochs", "0"], "--epochs must be an int >= 1, got 0"),
    (["recipe", "bsam-cifar10", "--out", "x"], "pass --data-root DIR"),
    (["data", "synthetic-cifar", "x", "--num-train", "0"], "--num-train must be >= 1"),
    (["data", "imagenet"], "invalid choice: 'imagenet'"),
])
def test_cli_bad_input(argv, match, tmp_path, monkeypatch, capsys):
    # every user error: one line on stderr, no traceback, exit status 2, before any training or writing
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--no-progress"] if argv[0] == "bench" else argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def test_cli_missing_data_files_is_a_one_line_error(tmp_path, capsys):
    # the folder exists but holds no CIFAR files: found when the data set is read, still one line and exit status 2
    (tmp_path / "data").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--datasets", "cifar10", "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
              "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(tmp_path / "data" / "cifar-10-batches-py") in err, err


def test_options_that_may_be_none_are_accepted():
    from pyro_flat.bench.options import check_option_values

    check_option_values(RunConfig(options={"emcmc": {"cycles": None, "anchor_prior_scale": None, "collect": "both",
                                                     "lr": 1}}))


def test_cli_writes_a_stand_in_cifar_folder(tmp_path, capsys):
    from pyro_flat.data import load_vision_dataset

    assert main(["data", "synthetic-cifar", str(tmp_path / "data"), "--num-train", "20", "--num-test", "10"]) == 0
    assert f"--data-root {tmp_path / 'data'}" in capsys.readouterr().out
    train = load_vision_dataset("cifar10", tmp_path / "data", train=True)
    assert len(train) == 20 and len(load_vision_dataset("cifar10", tmp_path / "data", train=False)) == 10


def test_cli_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("map", "vi", "mc_dropout", "ensemble", "digits", "mnist1d"):
        assert name in out


def test_float64_run():
    record = run_one("map", "digits", 0, TINY.replace(num_epochs=1, dtype="float64"))
    assert record.test_probs.dtype == torch.float64


def test_cli_version(capsys):
    import pyro_flat

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pyro_flat {pyro_flat.__version__}"


def test_cli_help_is_plain_text_and_explains_every_preset(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "`" not in text and ":class:" not in text and ":mod:" not in text  # no reST markup
    for name, config in PRESETS.items():
        assert f"  {name}  " in text
        assert f"{config.num_epochs} epochs, {config.num_bma_samples} posterior draws" in text
    # the epilog said the flags "below" override a preset; they are above it
    assert text.rstrip().endswith("The flags above (--epochs, --model, --lr, --set, ...) override a preset.")
    assert max(text.index(f"\n  {flag} ") for flag in ("--epochs", "--model", "--lr", "--set")) < text.index("presets:")


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "-1"], "--epochs must be an int >= 1, got -1"),
    (["--lr", "-0.5"], "--lr must be a finite number > 0, got -0.5"),
    (["--bma-samples", "0"], "--bma-samples must be an int >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be an int >= 1, got 0"),
    (["--dist-timeout", "inf"], "--dist-timeout must be a number of minutes in (0, 1e6], got inf"),
])
def test_cli_errors_name_the_flag_that_was_typed(argv, message, capsys):
    """``--epochs -1`` said ``RunConfig: `num_epochs` must be ...``: a name the user never typed."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "RunConfig" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, nearest", [
    (["bench", "--method", "map"], "--methods"),
    (["bench", "--epoch", "3"], "--epochs"),
    (["bench", "--dataset", "digits"], "--datasets"),
    (["recipe", "bsam-cifar10", "--out", "x", "--seed", "2"], "--seeds"),
])
def test_cli_refuses_abbreviated_flags_and_suggests_the_nearest(argv, nearest, tmp_path, monkeypatch, capsys):
    """argparse accepted ``--method`` for ``--methods`` and ``--epoch`` for ``--epochs`` silently (a later flag that
    shared the prefix would have changed their meaning)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--lr", "-1"])  # (an abbreviation taken silently would meet this error, not train)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized argument {argv[-2]} (did you mean {nearest}?)" in err and len(err.strip().splitlines()) == 1


def test_cli_help_and_argument_errors_do_not_import_torch():
    """``python -m pyro_flat --help`` imported torch and Pyro (3.5 s of CPU) to print its help; help and the errors
    found in the arguments now come back before either is imported (the time itself is measured in the report, not
    here: the test checks what is imported)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = """
import sys
from pyro_flat.bench.cli import main
for argv in (["--help"], ["bench", "--help"], ["recipe", "--help"], ["--version"], ["bench", "--methodz", "map"],
             ["bench", "--epochs", "-1"], ["bench", "--preset", "huge"], ["bench", "--seeds", "0"]):
    try:
        main(argv)
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "pyro", "numpy", "matplotlib") if m in sys.modules))
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]


def _record(method, seed, acc):
    return {"dataset": "digits", "method": method, "seed": seed, "fit_seconds": 1.0,
            "metrics": {"acc": acc, "nll": 1 - acc, "ece": 0.1, "ood_auroc_entropy": 0.5, "lambda_max": 2.0}}


def test_flat_vs_base_figure(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from pyro_flat.bench import report
    from pyro_flat.bench.report import FLAT_VS_BASE_METRICS, flat_base_pairs, plot_flat_vs_base

    assert flat_base_pairs(["map", "sam", "vi", "f_vi", "sgld"]) == [("sam", "map"), ("f_vi", "vi")]
    records = [_record(m, s, a + 0.01 * s) for s in range(3) for m, a in (("map", 0.9), ("sam", 0.95), ("vi", 0.8),
                                                                         ("f_vi", 0.79))]
    figures = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *args, **kwargs: figures.append(fig))
    monkeypatch.setattr(plt, "close", lambda fig: None)
    assert plot_flat_vs_base(tmp_path / "pairs.png", records, "digits")
    (fig,) = figures
    # one compact panel per metric, the pairs in rows on a shared axis, the differences centred on a line at 0
    assert [ax.get_title() for ax in fig.axes] == [label for _, label, *_ in FLAT_VS_BASE_METRICS]
    labels = {t.get_position()[1]: t.get_text() for t in fig.axes[0].get_yticklabels()}
    assert [labels[y] for y in sorted(labels, reverse=True)] == ["sam − map", "f_vi − vi"]  # top to bottom
    assert fig.get_size_inches()[1] < 3
    for ax in fig.axes:
        low, high = ax.get_xlim()
        assert low == -high and any(list(line.get_xdata()) == [0, 0] for line in ax.get_lines())
    acc = fig.axes[0]
    assert "method better →" in acc.get_xlabel() and "← method better" in fig.axes[1].get_xlabel()
    seeds = sorted(x for line in acc.get_lines() if line.get_marker() == "o" for x in line.get_xdata())
    assert seeds == pytest.approx([-1.0] * 3 + [5.0] * 3)  # f_vi - vi and sam - map, per seed, in points
    # no flat method whose base ran: nothing is written
    monkeypatch.undo()
    unpaired = [r for r in records if r["method"] not in ("map", "vi")]
    assert not report.plot_flat_vs_base(tmp_path / "none.png", unpaired, "digits")
    assert not (tmp_path / "none.png").exists()


def _curve_record(method, seed, phases, loop):
    entries = [{"phase": p, "epoch": e, "loss": 1000.0 * (p + 1) / e if loop == "svi" else 2.0 / e, "loop": loop}
               for p in range(phases) for e in (1, 2, 3)]
    return RunRecord("digits", method, seed, {}, 1.0, entries=entries)


def test_curves_figure_says_what_each_loss_is(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from pyro_flat.bench.report import LOSS_LABELS, plot_curves

    records = [_curve_record("ensemble", s, 3, "svi") for s in (0, 1)] + [
        _curve_record("sam_torch", 0, 1, "SAM"), RunRecord("digits", "sgld", 0, {}, 1.0)]
    figures = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *args, **kwargs: figures.append(fig))
    monkeypatch.setattr(plt, "close", lambda fig: None)
    assert plot_curves(tmp_path / "curves.png", records)
    (fig,) = figures
    ensemble, sam = fig.axes[:2]
    assert ensemble.get_ylabel() == LOSS_LABELS["svi"] and sam.get_ylabel() == LOSS_LABELS["SAM"]
    assert [t.get_text() for t in ensemble.get_legend().get_texts()] == ["phase 0", "phase 1", "phase 2"]
    assert len(ensemble.get_lines()) == 6 and sam.get_legend() is None  # a line per seed and phase
    assert "sgld" in fig._supxlabel.get_text()  # the sampler logs no loss: said, not silently missing
    assert not plot_curves(tmp_path / "none.png", records[-1:])
