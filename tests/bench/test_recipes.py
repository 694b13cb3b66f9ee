"""Every recipe runs end to end (smoke preset: tiny networks, 2 epochs) on a generated folder in the real CIFAR on-disk
format, and writes the table with the paper's numbers next to ours."""

from __future__ import annotations

import json

import pytest
import torch

from pyro_flat.bench import METHODS
from pyro_flat.bench import methods as _registered  # noqa: F401  (fills METHODS)
from pyro_flat.bench.cli import main
from pyro_flat.bench.recipes import RECIPES, network_name, recipe_table, stage_setup
from pyro_flat.data import write_synthetic_cifar

torchvision = pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_synthetic_cifar(root, "cifar10", num_train=60, num_test=20)
    write_synthetic_cifar(root, "cifar100", num_train=60, num_test=20)
    return root


@pytest.fixture(scope="module")
def imagenet_weights(tmp_path_factory):
    """A torchvision resnet18 state dict standing in for the ImageNet weights (the format --pretrained reads)."""
    path = tmp_path_factory.mktemp("weights") / "resnet18.pth"
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().float().state_dict(), path)
    return path


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.slow
def test_every_recipe_runs_end_to_end(name, cifar, imagenet_weights, tmp_path, capsys):
    out = tmp_path / name
    argv = ["recipe", name, "--preset", "smoke", "--data-root", str(cifar), "--out", str(out), "--no-progress"]
    figures = name == "bsam-cifar10"  # one recipe draws its figures (seconds each); the others pass --no-figures
    argv += [] if figures else ["--no-figures"]
    if RECIPES[name].needs_pretrained:
        argv += ["--pretrained", str(imagenet_weights)]
    assert main(argv) == 0
    recipe = RECIPES[name]
    summary = json.loads((out / "recipe.json").read_text())
    table = (out / "table.md").read_text()
    for stage in recipe.stages:
        ran = {row["method"] for row in summary["ours"][stage.name]}
        assert ran == set(stage.smoke_methods or stage.methods)
        assert (out / stage.name / "results.json").exists() and (out / stage.name / "metrics.jsonl").exists()
        assert (out / stage.name / f"reliability_{stage.datasets[0]}.png").exists() == figures
        smoke, _ = stage_setup(recipe, stage, "smoke", {"data_root": str(cifar)}, {}, out)
        for row in summary["ours"][stage.name]:
            assert 0 <= row["acc"][0] <= 100 and row["nll"][0] > 0
            (line,) = [line for line in table.splitlines()
                       if line.startswith(f"| {stage.name} |") and f"| {row['dataset']} | {row['method']} |" in line]
            assert line.split(" | ")[1].startswith(network_name(smoke))  # the network that ran
    for paper in recipe.paper:  # the paper's figures, next to ours, where the method ran
        ran = {row["method"] for row in summary["ours"].get(paper.stage, [])}
        if paper.method in ran and paper.acc is not None:
            assert f"| {paper.method} | {paper.acc:g} |" in table
    assert "Expected cost of the paper preset" in table and recipe.reference in table
    assert "This run is not the paper preset" in table and "* Ours:" not in table
    if name == "sa-bma-transfer":  # the source SWAG posterior was saved and the frozen block sampled from it
        assert (out / "source_swag.pt").exists()
        record = json.loads((out / "transfer_swag_backbone" / "results.json").read_text())["records"][0]
        assert record["method"] == "sa_bma_score"


def test_paper_presets_are_the_papers_settings():
    flat = RECIPES["flat-seeking-cifar"]
    config, methods = stage_setup(flat, flat.stages[3], "paper", {"data_root": "x"}, {}, "out")
    assert (config.model, config.depth, config.width, config.num_epochs, config.optimizer, config.lr) == (
        "wrn", 28, 10, 300, "sgd", 0.1)
    assert config.options["f_swag"] == {"rho": 0.1, "swa_start": 161, "max_rank": 20, "scale": 0.1}  # CIFAR-100
    assert config.prior_scale == pytest.approx((50_000 * 5e-4) ** -0.5)
    assert set(methods) <= set(METHODS)
    emcmc = RECIPES["entropy-mcmc-cifar10"]
    config, _ = stage_setup(emcmc, emcmc.stages[0], "paper", {"data_root": "x", "device": "cuda"}, {}, "out")
    assert config.options["emcmc"]["eta"] == 4e-4 and config.device == "cuda"  # command-line flags win
    sabma = RECIPES["sa-bma-transfer"]
    config, _ = stage_setup(sabma, sabma.stages[2], "paper", {"data_root": "x"}, {}, "OUT")
    assert config.options["sa_bma"]["backbone_swag"] == "OUT/source_swag.pt"
    for recipe in RECIPES.values():
        for stage in recipe.stages:
            assert set(stage.methods) <= set(METHODS)


def test_recipe_errors(cifar, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["recipe", "bsam-cifar10", "--out", str(tmp_path)])
    assert "--data-root" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["recipe", "sa-bma-transfer", "--data-root", str(cifar), "--out", str(tmp_path)])
    assert "--pretrained FILE" in capsys.readouterr().err


def test_a_recipes_inputs_are_checked_before_its_first_stage(cifar, imagenet_weights, tmp_path, capsys):
    """Missing or wrong weights, a bad option value of a later stage and a data folder without the dataset are
    refused before anything trains, for every preset (sa-bma-transfer's smoke preset without --pretrained used to fail
    in stage 2, minutes in)."""
    out = tmp_path / "out"
    base = ["recipe", "sa-bma-transfer", "--preset", "smoke", "--data-root", str(cifar), "--out", str(out),
            "--no-progress"]
    not_weights = tmp_path / "other.pth"
    torch.save({"conv.weight": torch.zeros(1)}, not_weights)
    cases = [
        ([], "--pretrained FILE"),
        (["--pretrained", str(tmp_path / "missing.pth")], "missing.pth: no such file"),
        (["--pretrained", str(not_weights)], "other.pth is not torchvision's resnet18 state dict"),
        (["--pretrained", str(imagenet_weights), "--set", "sa_bma_score.radius=-1"],
         "sa_bma_score.radius must be a number >= 0, got -1"),
        (["--pretrained", str(imagenet_weights), "--data-root", str(tmp_path)], "cifar-10-batches-py does not exist"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit):
            main(base + extra)
        assert message in capsys.readouterr().err
        assert not out.exists()  # refused before the first stage


def test_table_quotes_unverified_figures_as_missing():
    recipe = RECIPES["entropy-mcmc-cifar10"]
    rows = [{"dataset": "cifar10", "method": m, "acc": (90.0, float("nan")), "nll": (0.3, float("nan")),
             "ece": (0.02, float("nan")), "lambda_max": (5.0, float("nan"))} for m in ("csgld", "emcmc")]
    table = recipe_table(recipe, {"cifar10_resnet18": rows})
    assert "| csgld | – | – | – |" in table and "| emcmc | 95.69 | – | – |" in table
    assert "unverified" in table


def test_table_names_the_network_and_budget_that_ran():
    recipe = RECIPES["flat-seeking-cifar"]
    rows = {stage.name: [{"dataset": stage.datasets[0], "method": "f_swag", "acc": (50.0, float("nan"))}]
            for stage in recipe.stages}
    configs = {preset: {stage.name: stage_setup(recipe, stage, preset, {"data_root": "x"}, {}, "out")[0]
                        for stage in recipe.stages} for preset in ("paper", "smoke")}
    paper = recipe_table(recipe, rows, configs["paper"])
    assert "| cifar10_wrn | WRN-28-10 | cifar10 |" in paper and "* Ours: " in paper
    assert "* Expected cost: ≈ 370 GPU-hours" in paper and "not the paper preset" not in paper
    smoke = recipe_table(recipe, rows, configs["smoke"])
    assert "| cifar10_wrn | WRN-10-1; paper preset: WRN-28-10 | cifar10 |" in smoke
    assert "| cifar10_resnet18 | ResNet-18 (width 4); paper preset: ResNet-18 | cifar10 |" in smoke
    assert "cifar10_wrn: WRN-10-1, 2 epochs, batch 20, 2 BMA draws" in smoke
    assert "* Ours: " not in smoke and "* The paper preset: the harness methods with SGD" in smoke
    assert "* Expected cost of the paper preset: ≈ 370 GPU-hours" in smoke
