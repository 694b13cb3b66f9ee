"""The tutorial notebooks: committed with the outputs of one full run, and executed here at smoke size.

Each notebook has one visible cell tagged ``parameters`` holding its sizes (steps, draws, ...). The test inserts a
cell after it with the smaller sizes below (the papermill convention), runs the notebook top to bottom, then runs the
checks below in the same kernel, so the reader's notebook carries no test scaffolding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))

SMOKE = {
    "01_getting_started.ipynb": "NUM_STEPS = 100\nNUM_SAMPLES = 10",
    "02_sharpness_aware.ipynb": "NUM_STEPS = 40\nNUM_SAMPLES = 5\nLANCZOS_ITERS = 20\nSLICE_POINTS = 11",
    "03_bayesian_sam_and_averaging.ipynb": (
        "MOONS_EPOCHS = 30\nBSAM_STEPS = 60\nSWAG_EPOCHS = 4\nHWA_PRETRAIN = 30\nHWA_CYCLES = 3\nNUM_SAMPLES = 10"
    ),
    "04_sampling_flat_basins.ipynb": "BUDGET = 2_000\nNET_STEPS = 150",
    "05_flat_transfer_learning.ipynb": "PRETRAIN_EPOCHS = 3\nSTEPS = 100",
}

# What each notebook shows, checked after its smoke run (a broken pipeline is near chance: 10 % on digits, 20 % on
# the 5-class transfer task; the thresholds leave room for the short smoke runs).
CHECKS = {
    "01_getting_started.ipynb": """
assert report["acc"] > 0.6 and flat_report["acc"] > 0.6, (report["acc"], flat_report["acc"])
assert report["lambda_max"] > 0 and flat_report["lambda_max"] > 0
""",
    "02_sharpness_aware.ipynb": """
# the ELBO class and Trace_ELBO on the transformed model are the same objective
assert torch.allclose(loss_a, loss_b)
assert all(torch.allclose(a, b) for a, b in zip(grads_a, grads_b, strict=True))
assert set(reports) == {"VI", "F-VI", "MAP", "SAM"}
""",
    "03_bayesian_sam_and_averaging.ipynb": """
assert bsam_report["acc"] > 0.6, bsam_report
assert hwa.num_collected == HWA_CYCLES
assert all(r["acc"] > 0.5 for r in results.values()), results
""",
    "04_sampling_flat_basins.ipynb": """
reached = {name: float(in_flat_basin(s).amax(0).double().mean())
           for name, s in [("SGLD", samples["SGLD"]["x"]), ("theta_a", samples["Entropy-MCMC"]["x_anchor"])]}
assert reached["theta_a"] > reached["SGLD"] + 0.2, reached  # the anchors escape the sharp mode far more often
assert all(m["acc"] > 0.7 for m in results.values()), results
assert bma.num_samples == 20
""",
    "05_flat_transfer_learning.ipynb": """
assert all(report["acc"] > 0.4 for _, report, _ in results.values()), results
for radius in (1e-1, 1e-2, 1e-3):  # the Fisher of the augmented process dominates: inside the ball
    delta = KLBallELBO(radius).perturbation(model, guide, target.x_train, target.y_train)
    assert kl_to_perturbed(delta, low_rank_posterior) <= 1.05 * radius
for radius in (1e-2, 1e-4):  # exact Fisher: on the ball, to second order
    delta = KLBallELBO(radius).perturbation(model, mean_field, target.x_train, target.y_train)
    assert abs(kl_to_perturbed(delta, mean_field_posterior) / radius - 1) < 0.1
""",
}


FIGURE_CALLS = ("plt.", "subplots(", "reliability_diagram(")
"""What draws a figure in the tutorials."""


def test_every_tutorial_has_smoke_sizes_and_checks():
    assert NOTEBOOKS
    assert {p.name for p in NOTEBOOKS} == set(SMOKE) == set(CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_the_outputs_of_one_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    # executed top to bottom in one kernel, without errors, and showing at least one figure
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "re-run and commit the outputs"
    outputs = [out for cell in code for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert any("image/png" in out.get("data", {}) for out in outputs)
    # every cell that draws a figure shows it (a figure pyplot does not manage is shown only as the cell's value)
    for cell in code:
        if any(call in cell.source for call in FIGURE_CALLS):
            assert any("image/png" in out.get("data", {}) for out in cell.outputs), cell.source.splitlines()[-1]
    # no test scaffolding in what the reader sees
    text = "\n".join(cell.source for cell in code)
    assert "assert " not in text and "SMOKE" not in text and "environ" not in text
    assert "pyro_flat.bench" not in text and "._" not in text.replace("__", "")
    assert sum("parameters" in cell.metadata.get("tags", []) for cell in code) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
@pytest.mark.slow
def test_notebook_runs_at_smoke_size(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one torch thread in the kernel, as in the test workers
    nb = nbformat.read(path, as_version=4)
    (position,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    nb.cells.insert(position + 1, nbformat.v4.new_code_cell(SMOKE[path.name]))
    nb.cells.append(nbformat.v4.new_code_cell(CHECKS[path.name]))
    resources = {"metadata": {"path": str(TUTORIALS)}}
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources=resources)
    client.execute()  # raises CellExecutionError, with the failing cell, if any cell (or check) fails
