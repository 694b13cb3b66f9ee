"""Long runs that lose nothing: a run interrupted after some checkpoints and resumed ends bit for bit where an
uninterrupted run ends (for every kind of state; the kills in real processes, on image data, and the damaged and
crafted files are in ``test_faults.py``); a resume refuses another configuration, naming what differs; divergence
keeps the last good checkpoint; writes are atomic; the per-epoch log and the curves."""

from __future__ import annotations

import json

import pytest
import torch

from pyro_flat.bench import METHODS, MethodSpec, RunConfig
from pyro_flat.bench.loop import RunContext, atomic_save, load_checkpoint
from pyro_flat.bench.problem import Posterior, run_svi
from pyro_flat.bench.runner import job_name, run_benchmark

TINY = RunConfig(hidden=(16,), num_epochs=3, lr=1e-2, num_bma_samples=2, lambda_max_draws=1, lambda_max_points=16,
                 lambda_max_iters=2)


class _Killed(Exception):
    pass


def _interrupt_at(step: int, monkeypatch) -> None:
    """Make the harness's loops raise ``_Killed`` at their ``step``-th step overall (across phases)."""
    from pyro_flat.bench import loop

    steps, original = [0], loop.TrainingLoop.__iter__

    def interrupted(self):
        for item in original(self):
            steps[0] += 1
            if steps[0] == step:
                raise _Killed
            yield item

    monkeypatch.setattr(loop.TrainingLoop, "__iter__", interrupted)


def _uninterrupted_and_resumed(method, kill_at, config, tmp_path, monkeypatch):
    """The record of an uninterrupted run, and of a run interrupted at step ``kill_at`` and resumed."""
    reference = run_benchmark(["digits"], [method], [0], config, progress=False, checkpoint_dir=tmp_path / "a",
                              checkpoint_every=3)[0]
    _interrupt_at(kill_at, monkeypatch)
    with pytest.raises(_Killed):
        run_benchmark(["digits"], [method], [0], config, progress=False, checkpoint_dir=tmp_path / "b",
                      checkpoint_every=3)
    monkeypatch.undo()
    resumed = run_benchmark(["digits"], [method], [0], config, progress=False, checkpoint_dir=tmp_path / "b",
                            resume=True)[0]
    return reference, resumed


@pytest.mark.parametrize("method, kill_at", [("ensemble", 47), ("f_swag", 17), ("csgld", 23), ("bsam", 11)])
def test_resume_in_process_for_every_kind_of_state(method, kill_at, tmp_path, monkeypatch):
    """The other families of state (ensemble members: phases; SAM/bSAM: torch optimizers, schedules, a SWAG
    collector; cSGLD: a cyclical kernel), interrupted by an exception at a step instead of a kill."""
    reference, resumed = _uninterrupted_and_resumed(method, kill_at, TINY.replace(num_epochs=4, ensemble_size=2),
                                                    tmp_path, monkeypatch)
    assert resumed.metrics == reference.metrics and torch.equal(resumed.test_probs, reference.test_probs)


@pytest.mark.cuda
@pytest.mark.parametrize("method, kill_at", [("hwa", 33), ("emcmc", 23), ("f_swag", 17)])
def test_resume_on_a_gpu(method, kill_at, tmp_path, monkeypatch):
    """Checkpoints are read onto the CPU and their tensors moved back to the run's device (CUDA kernels may not be
    deterministic: the resumed metrics are compared to a tolerance)."""
    reference, resumed = _uninterrupted_and_resumed(method, kill_at, TINY.replace(num_epochs=4, device="cuda"),
                                                    tmp_path, monkeypatch)
    for key, value in reference.metrics.items():
        assert resumed.metrics[key] == pytest.approx(value, rel=1e-3, abs=1e-4), key


def test_resume_refuses_another_configuration(tmp_path):
    run_benchmark(["digits"], ["map"], [0], TINY.replace(num_epochs=1), progress=False, checkpoint_dir=tmp_path)
    (tmp_path / job_name("digits", "map", 0) / "record.pt").unlink()  # as if killed before the job ended
    with pytest.raises(ValueError, match=r"checkpoint.pt belongs to another configuration \(lr was 0.01, now 0.1\)"):
        run_benchmark(["digits"], ["map"], [0], TINY.replace(num_epochs=1, lr=0.1), progress=False,
                      checkpoint_dir=tmp_path, resume=True)


def test_resume_checks_the_configuration_of_finished_jobs(tmp_path):
    """A finished job's record is reused on resume only if its configuration is this run's: another number of
    epochs or learning rate is refused, naming each key; the data folder's path, the number of workers and other
    methods' options do not change its results and are not compared."""
    run_benchmark(["digits"], ["map", "sam"], [0], TINY.replace(num_epochs=1), progress=False,
                  checkpoint_dir=tmp_path, checkpoint_every=3)
    with pytest.raises(ValueError, match=r"record.pt belongs to another configuration \(lr was 0.01, now 0.05; "
                                         r"num_epochs was 1, now 5\)"):
        run_benchmark(["digits"], ["map"], [0], TINY.replace(num_epochs=5, lr=0.05), progress=False,
                      checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match=r"options.rho was absent, now 0.1"):  # the method's own options count
        run_benchmark(["digits"], ["sam"], [0], TINY.replace(num_epochs=1, options={"sam": {"rho": 0.1}}),
                      progress=False, checkpoint_dir=tmp_path, resume=True)
    same = TINY.replace(num_epochs=1, data_root="/elsewhere", num_workers=2, options={"vi": {}})
    (record,) = run_benchmark(["digits"], ["map"], [0], same, progress=False, checkpoint_dir=tmp_path, resume=True)
    assert record.fit_seconds == load_checkpoint(tmp_path / job_name("digits", "map", 0) / "record.pt")[
        "fit_seconds"]  # read back, not re-run


def _poisoned(at_step: int):
    """A MAP fit whose guide is poisoned with a NaN after step ``at_step`` (the next step then diverges)."""

    def fit(problem):
        model = problem.build_model()
        from pyro.infer.autoguide import AutoDelta

        from pyro_flat.nn import init_to_network

        guide = AutoDelta(model, init_loc_fn=init_to_network(model))

        def poison(step):
            if step == at_step:
                with torch.no_grad():
                    next(guide.parameters()).fill_(float("nan"))

        run_svi(problem, model, guide, callback=poison)
        return Posterior.from_points(model, [guide.median()])

    return fit


def test_divergence_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setitem(METHODS, "poisoned", MethodSpec("poisoned", _poisoned(23), "MAP poisoned at step 23"))
    with pytest.raises(FloatingPointError) as info:
        run_benchmark(["digits"], ["poisoned"], [0], TINY, progress=False, checkpoint_dir=tmp_path,
                      checkpoint_every=10)
    message = str(info.value)
    assert "digits/poisoned/seed 0" in message and "at step 24 of 30" in message
    checkpoint = tmp_path / job_name("digits", "poisoned", 0) / "checkpoint.pt"
    assert f"the last good checkpoint is kept in {checkpoint}" in message
    saved = load_checkpoint(checkpoint)
    assert saved["step"] == 20 and all(torch.isfinite(v).all() for v in saved["state"]["guide"].values())


def test_a_non_finite_state_is_never_written(tmp_path):
    context = RunContext(label="job", directory=tmp_path, every=1)
    good = {"phase": 0, "step": 5, "state": {"guide": {"w": torch.ones(3)}}, "entries": []}
    context.save(good, complete=False)
    bad = {"phase": 0, "step": 6, "state": {"guide": {"w": torch.tensor([1.0, float("inf")])}}, "entries": []}
    with pytest.raises(FloatingPointError, match=r"job: guide.w is NaN or infinite at step 6 of phase 0; the "
                                                 r"checkpoint was not written, the last good one is kept"):
        context.save(bad, complete=False)
    assert load_checkpoint(context.checkpoint_path)["step"] == 5


def test_a_save_interrupted_midway_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    atomic_save({"step": 1}, path)

    def dies_halfway(obj, handle):
        handle.write(b"partial bytes")
        raise KeyboardInterrupt  # the process stops in the middle of writing

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind


def test_epoch_log_and_curves(tmp_path):
    records = run_benchmark(["digits"], ["map", "vi"], [0], TINY, progress=False, metrics_log=tmp_path / "m.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(e["job"], e["epoch"]) for e in lines] == [(f"digits/{m}/seed 0", k) for m in ("map", "vi")
                                                        for k in (1, 2, 3)]
    assert all(e["step"] == 10 * e["epoch"] and e["loss"] > 0 for e in lines)
    assert records[0].entries == lines[:3]
    # the mean loss of an epoch is the mean of its steps' losses (here: decreasing while MAP trains)
    assert lines[2]["loss"] < lines[0]["loss"]
    from pyro_flat.bench.report import plot_curves

    plot_curves(tmp_path / "curves.png", records)
    assert (tmp_path / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("method", ["map", "f_vi", "sa_bma", "sgld", "bsam", "f_swag"])
def test_training_steps_read_the_host_at_the_logging_interval_only(method, monkeypatch):
    """The harness's training loops (one method of every family) read values on the host only to log the loss (every
    ``log_every`` steps and at the end of a phase) and to close an epoch (its mean loss): not at every step. Counted
    with HostSyncCounter over the loops' steps and bookkeeping, Pyro's validation off as the harness runs it."""
    import pyro

    from pyro_flat.bench import loop
    from pyro_flat.testing import HostSyncCounter

    counter, steps, phases, epochs = HostSyncCounter(), [0], [0], [0]
    original_iter, original_end = loop.TrainingLoop.__iter__, loop.TrainingLoop._end_epoch

    def counted(self):
        phases[0] += 1
        with counter:
            for item in original_iter(self):
                steps[0] += 1
                yield item  # the step itself runs while the loop is suspended here: counted too

    def end_epoch(self, step):
        epochs[0] += 1
        return original_end(self, step)

    monkeypatch.setattr(loop.TrainingLoop, "__iter__", counted)
    monkeypatch.setattr(loop.TrainingLoop, "_end_epoch", end_epoch)
    pyro.enable_validation(False)
    run_benchmark(["digits"], [method], [0], TINY.replace(num_epochs=3 if method == "f_swag" else 2), progress=False)
    # at most: one read per epoch (its mean loss), two per phase (the first and the last logged loss), the SG-MCMC
    # kernels' divergence checks (every 100 steps)
    allowed = epochs[0] + 2 * phases[0] + steps[0] // 100
    assert steps[0] >= 20 and counter.count <= allowed, (steps[0], allowed, counter.report())
