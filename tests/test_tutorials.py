"""The tutorial notebooks: committed with the outputs of one full run, and executed here.

The cheap notebooks (:data:`FULL_SIZE`, about a minute each) run at full size, and what they print must be what the
committed notebook shows (``scripts/run_tutorials.py --check``): a change of the code that changes a printed number
fails here until the notebook is re-run. The others run at smoke size: each notebook has one visible cell tagged
``parameters`` holding its sizes (steps, draws, ...); the test inserts a cell after it with the smaller sizes below
(the papermill convention). Either way the notebook runs top to bottom, then the checks below run in the same kernel,
so the reader's notebook carries no test scaffolding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))

SMOKE = {
    "01_getting_started.ipynb": "NUM_STEPS = 100\nNUM_SAMPLES = 10",
    "02_sharpness_aware.ipynb": "NUM_STEPS = 40\nNUM_SAMPLES = 5\nLANCZOS_ITERS = 20\nSLICE_POINTS = 11",
}
FULL_SIZE = ("03_bayesian_sam_and_averaging.ipynb", "04_sampling_flat_basins.ipynb", "05_flat_transfer_learning.ipynb")
"""The notebooks run at full size, their printed outputs compared with the committed ones."""

# What each notebook shows, checked after its run (a broken pipeline is near chance: 10 % on digits, 20 % on the
# 5-class transfer task; the thresholds leave room for the short smoke runs).
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
    assert {p.name for p in NOTEBOOKS} == set(SMOKE) | set(FULL_SIZE) == set(CHECKS)
    assert not set(SMOKE) & set(FULL_SIZE)  # each runs once


def _notebook(*printed):
    """A notebook of one code cell per text, each cell having printed its text."""
    nb = nbformat.v4.new_notebook()
    for i, text in enumerate(printed):
        cell = nbformat.v4.new_code_cell(f"print(result_{i})")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        nb.cells.append(cell)
    return nb


def test_check_names_the_cells_and_numbers_that_differ_and_writes_nothing(script, tmp_path, monkeypatch, capsys):
    run_tutorials = script("run_tutorials")
    path = tmp_path / "04_demo.ipynb"
    nbformat.write(_notebook("SGLD acc 0.9704\n", "Entropy-MCMC {'acc': 0.9722, 'nll': 0.1213}\n"), path)
    committed = path.read_bytes()
    monkeypatch.setattr(run_tutorials, "TUTORIALS", tmp_path)

    def execute_printing(*printed):
        def execute(nb, timeout=0):  # stands in for the kernel: the cells print ``printed``
            nb.cells[:] = _notebook(*printed).cells
            return 1.0
        return execute

    monkeypatch.setattr(run_tutorials, "execute", execute_printing("SGLD acc 0.9704\n", "Entropy-MCMC {'acc': "
                                                                   "0.9741, 'nll': 0.1021}\n"))
    assert run_tutorials.main(["--check", path.name]) == 1
    assert path.read_bytes() == committed
    err = capsys.readouterr().err
    assert "04_demo.ipynb, code cell 2 ('print(result_1)'): numbers differ: 0.9722 -> 0.9741, 0.1213 -> 0.1021" in err
    assert "code cell 1" not in err and "python scripts/run_tutorials.py 04_demo.ipynb" in err
    monkeypatch.setattr(run_tutorials, "execute", execute_printing("SGLD acc 0.9704\n", "Entropy-MCMC {'acc': "
                                                                   "0.9722, 'nll': 0.1213}\n"))
    assert run_tutorials.main(["--check", path.name]) == 0
    assert path.read_bytes() == committed


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


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name in SMOKE], ids=lambda p: p.name)
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


@pytest.mark.parametrize("path", [TUTORIALS / name for name in FULL_SIZE], ids=lambda p: p.name)
@pytest.mark.slow
def test_notebook_prints_its_committed_outputs(path, script):
    run_tutorials = script("run_tutorials")
    committed = nbformat.read(path, as_version=4)
    nb = copy.deepcopy(committed)
    nb.cells.append(nbformat.v4.new_code_cell(CHECKS[path.name]))
    run_tutorials.execute(nb, timeout=600)  # raises CellExecutionError, with the failing cell, if any cell fails
    nb.cells.pop()
    differ = run_tutorials.mismatches(path.name, committed, nb)
    assert not differ, "\n".join(map(str, differ)) + f"\nre-run: python scripts/run_tutorials.py {path.name}"
