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
    assert (out / "flat_vs_base_digits.png").stat().st_size > 1000  # sam against its base, map
    assert "| map |" in (out / "table.md").read_text()


@pytest.mark.parametrize("argv, match", [
    (["bench", "--methods", "nope"], "unknown method 'nope'"),
    (["bench", "--datasets", "cifar"], "unknown dataset 'cifar'"),
    (["bench", "--seeds", "0"], "--seeds must be >= 1"),
    (["bench", "--set", "novalue"], "method.key=value"),
    (["bench", "--set", "f_vi.rhoo=0.1"], "--set: method 'f_vi' has no option 'rhoo'"),
    (["bench", "--set", "fvi.rho=0.1"], "--set: options given for unknown method 'fvi'"),
    (["bench", "--epochs", "0"], "num_epochs"),
])
def test_cli_bad_input(argv, match, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert match in capsys.readouterr().err


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


def _record(method, seed, acc):
    return {"dataset": "digits", "method": method, "seed": seed, "fit_seconds": 1.0,
            "metrics": {"acc": acc, "nll": 1 - acc, "ece": 0.1, "ood_auroc_entropy": 0.5, "lambda_max": 2.0}}


def test_flat_vs_base_figure(tmp_path):
    from pyro_flat.bench.report import flat_base_pairs, plot_flat_vs_base

    assert flat_base_pairs(["map", "sam", "vi", "f_vi", "sgld"]) == [("sam", "map"), ("f_vi", "vi")]
    records = [_record(m, s, a) for s in range(3) for m, a in (("map", 0.9), ("sam", 0.95), ("vi", 0.8))]
    assert plot_flat_vs_base(tmp_path / "pairs.png", records, "digits")
    assert (tmp_path / "pairs.png").stat().st_size > 1000
    # no flat method whose base ran: nothing is written
    assert not plot_flat_vs_base(tmp_path / "none.png", [r for r in records if r["method"] != "map"], "digits")
    assert not (tmp_path / "none.png").exists()
