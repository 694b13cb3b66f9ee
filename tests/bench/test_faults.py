"""Fault injection for long runs.

* kills: a run SIGKILLed at random steps (chosen by a seeded generator) and in the middle of a checkpoint write,
  then resumed, ends bit for bit where an uninterrupted run ends (for one method of every family, in process; and
  through the command line in real processes), on image data (a generated CIFAR-10 folder, PreResNet-8 width 2);
* damaged and crafted files: a crafted pickle in any of the files a resume reads is refused unread (no code runs); a
  truncated file or a flipped bit is refused naming the file, and the command line says what to do;
* concurrent writers: a second run on the same folder is refused while the first holds it; a killed holder's
  checkpoints are neither reused by a run without ``--resume`` nor overwritten, and ``--resume`` continues them;
* a run never loses finished work (the command line on digits, tiny): a job that raises or diverges is recorded as
  failed and the others run; what a job is bound to fail on is refused before the output folder exists; SIGINT and
  SIGTERM stop at a step boundary, a full disk (a small tmpfs) and a stalled rank under torchrun end the run in one
  line — each with the finished jobs' results on disk and ``--resume`` continuing.

The tests with real processes or many runs are marked ``slow``; they run in CI.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pyro_flat.bench import METHODS, MethodSpec, RunConfig
from pyro_flat.bench.cli import main
from pyro_flat.bench.loop import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    OutputFolderError,
    atomic_save,
    load_checkpoint,
    output_lock,
)
from pyro_flat.bench.runner import job_name, run_benchmark
from pyro_flat.data import write_synthetic_cifar
from tests.bench.test_loop import _interrupt_at, _Killed

ROOT = Path(__file__).resolve().parents[2]
DIGITS = RunConfig(hidden=(8,), num_epochs=1, lr=1e-2, num_bma_samples=2, lambda_max_draws=1, lambda_max_points=16,
                   lambda_max_iters=2)


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_synthetic_cifar(root, "cifar10", num_train=40, num_test=20)
    return root


def _image_config(cifar: Path, **changes) -> RunConfig:
    """PreResNet-8 (width 2, BatchNorm) on 40 augmented images, batches of 10: 4 steps per epoch."""
    base = dict(model="preresnet", depth=8, width=2, data_root=str(cifar), num_epochs=2, batch_size=10,
                num_bma_samples=2, lambda_max_draws=1, lambda_max_points=8, lambda_max_iters=2, ensemble_size=2)
    return RunConfig(**(base | changes))


# ---------------------------------------------------------------------------------------------------------------------
# kills: in process, one method of every family


# one method per family module: baselines (SVI; the Monte-Carlo draws of the guide), flat seeking (an ensemble: two
# phases), KL ball (a low-rank guide), trajectory (bSAM: a torch optimizer, a schedule, sampled noise), SG-MCMC (a
# kernel and its draws); the interruption step is drawn at random (seeded) among each job's 8 or 16 steps
FAMILIES = ("vi", "f_ensemble", "sa_bma", "bsam", "emcmc")
KILL_AT = {m: random.Random(f"kill {m}").randint(2, 15 if m == "f_ensemble" else 7) for m in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("method", FAMILIES, ids=[f"{m}-killed-at-step-{KILL_AT[m]}" for m in FAMILIES])
def test_resume_on_image_data_is_exact_for_every_family(method, cifar, tmp_path, monkeypatch):
    """Each DataLoader iterator used to take its seed from torch's global generator, and a resume opens one more:
    every random number after a resume was shifted (vi differed in ~200 tensors from an uninterrupted run)."""
    config = _image_config(cifar)
    reference = run_benchmark(["cifar10"], [method], [0], config, progress=False, checkpoint_dir=tmp_path / "a",
                              checkpoint_every=3)[0]
    _interrupt_at(KILL_AT[method], monkeypatch)
    with pytest.raises(_Killed):
        run_benchmark(["cifar10"], [method], [0], config, progress=False, checkpoint_dir=tmp_path / "b",
                      checkpoint_every=3)
    monkeypatch.undo()
    resumed = run_benchmark(["cifar10"], [method], [0], config, progress=False, checkpoint_dir=tmp_path / "b",
                            resume=True)[0]
    assert resumed.metrics == reference.metrics and torch.equal(resumed.test_probs, reference.test_probs)
    assert [e["loss"] for e in resumed.entries] == [e["loss"] for e in reference.entries]


# ---------------------------------------------------------------------------------------------------------------------
# kills: real processes through the command line


METHODS_RUN = ("vi", "emcmc")  # 2 jobs of 16 steps each, a checkpoint every 2 steps


def _args(cifar: Path, out: Path) -> list[str]:
    return ["bench", "--datasets", "cifar10", "--data-root", str(cifar), "--methods", *METHODS_RUN, "--model",
            "preresnet", "--depth", "8", "--width", "2", "--epochs", "4", "--batch-size", "10", "--bma-samples", "2",
            "--lambda-max-draws", "1", "--lambda-max-points", "8", "--lambda-max-iters", "2", "--checkpoint-every",
            "2", "--no-progress", "--no-figures", "--out", str(out)]


def _launch(cifar: Path, out: Path, fault: str = "none", k: int = 0, *extra: str, **env: str) -> subprocess.Popen:
    """``python -m pyro_flat bench`` in a new process, with a fault of :mod:`tests.bench._fault_injection`."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.stderr{len(list(out.parent.glob(f'{out.name}.stderr*')))}.txt"
    with open(log, "w") as handle:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-m", "tests.bench._fault_injection", fault, str(k), "--",
                                 *_args(cifar, out), *extra], cwd=ROOT, env=environment,
                                stdout=subprocess.DEVNULL, stderr=handle)


def _errors(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.parent.glob(f"{out.name}.stderr*")))


def _records(out: Path) -> dict[str, dict]:
    return {job: load_checkpoint(out / "records" / job / "record.pt")
            for job in (job_name("cifar10", m, 0) for m in METHODS_RUN)}


def _assert_same_results(ours: Path, theirs: Path) -> None:
    mine, reference = _records(ours), _records(theirs)
    for job in mine:
        assert mine[job]["metrics"] == reference[job]["metrics"], job  # every float equal
        assert torch.equal(mine[job]["test_probs"], reference[job]["test_probs"]), job
        assert [e["loss"] for e in mine[job]["entries"]] == [e["loss"] for e in reference[job]["entries"]], job
    # the per-epoch log was rebuilt on resume: the same entries in the same order (times aside)
    read = [[{k: v for k, v in json.loads(line).items() if k != "seconds"}
             for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (ours, theirs)]
    assert read[0] == read[1] and len(read[0]) == 2 * 4
    assert [r["method"] for r in json.loads((ours / "results.json").read_text())["records"]] == list(METHODS_RUN)


def _temporaries(out: Path) -> list[Path]:
    return [p for p in out.rglob(".*.tmp*") if p.is_file()]


def _wait_for(path: Path, process: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 300
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, _errors(out)
        time.sleep(0.05)


@pytest.mark.slow
def test_kills_and_a_second_writer_then_resume_is_exact(cifar, tmp_path, capsys):
    """A run SIGKILLed at a random step; resumed and held at a random step while second runs on its folder are
    refused, then SIGKILLed from outside; resumed and SIGKILLed in the middle of a write; resumed to the end: it
    equals an uninterrupted run bit for bit (before: vi differed in ~200 tensors, and two runs on one folder lost one
    run's rows silently). The kill points come from a seeded generator."""
    reference = _launch(cifar, tmp_path / "reference")  # the uninterrupted run, alongside
    rng, out = random.Random(20), tmp_path / "killed"
    step = rng.randint(3, 14)  # inside vi's 16 steps
    run = _launch(cifar, out, "kill-step", step)
    assert run.wait(timeout=600) == -signal.SIGKILL, _errors(out)
    saved = load_checkpoint(out / "checkpoints" / job_name("cifar10", "vi", 0) / "checkpoint.pt")
    assert saved["step"] == 2 * ((step - 1) // 2) and not (out / "table.md").exists()
    # resumed and held at a step: while it holds the folder, any second run is refused
    hold = tmp_path / "holding"
    held = _launch(cifar, out, "hold-step", rng.randint(2, 12), "--resume", HOLD_FILE=str(hold))
    _wait_for(hold, held, out)
    for extra in ([], ["--resume"]):
        with pytest.raises(SystemExit):
            main(_args(cifar, out) + extra)
        assert f"another run is writing to {out}" in capsys.readouterr().err
    held.send_signal(signal.SIGKILL)  # the OS releases the lock with the process
    held.wait()
    with pytest.raises(SystemExit):  # without --resume: the killed run's checkpoints are never overwritten
        main(_args(cifar, out))
    assert "holds the checkpoints of an earlier run" in capsys.readouterr().err
    # resumed, then killed in the middle of a write: half a file under a temporary name, the last good one kept
    run = _launch(cifar, out, "kill-write", rng.randint(2, 6), "--resume")
    assert run.wait(timeout=600) == -signal.SIGKILL, _errors(out)
    assert len(_temporaries(out)) == 1
    run = _launch(cifar, out, "none", 0, "--resume")
    assert run.wait(timeout=600) == 0, _errors(out)
    assert _temporaries(out) == []  # the stale temporary file was removed by the next writer
    assert reference.wait(timeout=600) == 0, _errors(tmp_path / "reference")
    _assert_same_results(out, tmp_path / "reference")


# ---------------------------------------------------------------------------------------------------------------------
# concurrent writers and reruns, in process


def test_a_folder_has_one_writer_at_a_time(tmp_path):
    with output_lock(tmp_path):
        with pytest.raises(OutputFolderError, match="another run is writing to"):
            run_benchmark(["digits"], ["map"], [0], DIGITS, progress=False, checkpoint_dir=tmp_path)
    (tmp_path / ".checkpoint.pt.tmp123").write_bytes(b"half a file")  # left by a write killed midway
    (tmp_path / "keep.tmp1").write_bytes(b"not ours")
    run_benchmark(["digits"], ["map"], [0], DIGITS, progress=False, checkpoint_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [job_name("digits", "map", 0), "keep.tmp1"]  # no .lock


def test_a_rerun_without_resume_never_overwrites_checkpoints(tmp_path):
    run_benchmark(["digits"], ["map"], [0], DIGITS, progress=False, checkpoint_dir=tmp_path, checkpoint_every=3)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*.pt")}
    with pytest.raises(OutputFolderError, match=r"holds the checkpoints of an earlier run, and this run would "
                                                r"overwrite them: continue it with --resume"):
        run_benchmark(["digits"], ["vi", "map"], [0], DIGITS, progress=False, checkpoint_dir=tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.pt")} == files
    assert not (tmp_path / job_name("digits", "vi", 0)).exists()  # refused before the first job


# ---------------------------------------------------------------------------------------------------------------------
# crafted and damaged files


class _Payload:
    """Unpickling this runs code (it would create ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _crafted(path: Path, marker: Path, how: str) -> None:
    if how == "torch.save":  # the format tag and a checksum, as a careful forger would write them
        torch.save({"format": CHECKPOINT_FORMAT, "sha256": "0" * 64, "content": {"step": _Payload(marker)}}, path)
    else:
        path.write_bytes(pickle.dumps(_Payload(marker), protocol=2))  # the protocol torch.load expects


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory):
    """A finished MAP job on digits with its checkpoint, phase and record files."""
    directory = tmp_path_factory.mktemp("finished")
    run_benchmark(["digits"], ["map"], [0], DIGITS, progress=False, checkpoint_dir=directory, checkpoint_every=4)
    return directory


def _copy(directory: Path, to: Path) -> Path:
    for path in directory.rglob("*"):
        if path.is_file() and path.name != ".lock":
            target = to / path.relative_to(directory)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    return to


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
@pytest.mark.parametrize("name", ["checkpoint.pt", "phase_0.pt", "record.pt"])
def test_a_crafted_file_is_refused_unread(finished_job, name, how, tmp_path):
    """Every file a resume reads used to go through torch.load(weights_only=False): a pickle payload ran."""
    directory = _copy(finished_job, tmp_path / "run")
    path = directory / job_name("digits", "map", 0) / name
    marker = tmp_path / "ran"
    _crafted(path, marker, how)
    if name != "record.pt":  # the job must be re-run from its checkpoints to read these
        (path.parent / "record.pt").unlink()
    with pytest.raises(CheckpointError, match=rf"{path}: refused: the file holds more than tensors and plain values"):
        run_benchmark(["digits"], ["map"], [0], DIGITS, progress=False, checkpoint_dir=directory, resume=True)
    assert not marker.exists()


def test_a_crafted_backbone_swag_file_is_refused_unread(tmp_path):
    from pyro_flat.bench.kl_ball import _frozen_sampler
    from pyro_flat.bench.problem import Problem
    from pyro_flat.data import load_digits

    path, marker = tmp_path / "source_swag.pt", tmp_path / "ran"
    _crafted(path, marker, "torch.save")
    problem = Problem(load_digits(), DIGITS.replace(options={"sa_bma": {"backbone_swag": str(path)}}))
    with pytest.raises(CheckpointError, match=f"{path}: refused"):
        _frozen_sampler(problem, "sa_bma", None)
    assert not marker.exists()


def test_a_damaged_checkpoint_is_refused_naming_it(finished_job, tmp_path):
    directory = _copy(finished_job, tmp_path / "run")
    job = directory / job_name("digits", "map", 0)
    (job / "record.pt").unlink()
    phase = job / "phase_0.pt"
    data = phase.read_bytes()
    phase.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match=rf"{phase}: cannot be read: truncated or damaged"):
        run_benchmark(["digits"], ["map"], [0], DIGITS, progress=False, checkpoint_dir=directory, resume=True)
    # a flipped bit inside a weight: the archive reads, the checksum does not match
    weights = load_checkpoint(finished_job / job_name("digits", "map", 0) / "phase_0.pt")["state"]["guide"]
    name, value = next((k, v) for k, v in weights.items() if v.numel() > 100)
    at = data.find(value.numpy().tobytes())
    assert at > 0
    flipped = bytearray(data)
    flipped[at + 17] ^= 0x08
    phase.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=rf"{phase}: damaged: its content does not match the checksum"):
        run_benchmark(["digits"], ["map"], [0], DIGITS, progress=False, checkpoint_dir=directory, resume=True)


def test_no_flipped_bit_loads_silently(tmp_path):
    """Flip one bit at 300 random places of a checkpoint: each load either fails naming the file or gives back the
    exact content (a bit in a field the reader ignores); before checksums, flips in tensor data loaded silently."""
    content = {"step": 12, "state": {"w": torch.randn(200, dtype=torch.float32), "m": torch.arange(50.0)},
               "history": [0.5, 0.25], "rng": (3, (1, 2, 3), None)}
    path = tmp_path / "checkpoint.pt"
    atomic_save(content, path)
    data = path.read_bytes()
    rng = random.Random(3)
    refused = 0
    for _ in range(300):
        flipped = bytearray(data)
        flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(flipped))
        try:
            loaded = load_checkpoint(path)
        except CheckpointError as error:
            assert str(path) in str(error)
            refused += 1
            continue
        assert loaded.keys() == content.keys() and loaded["history"] == content["history"]
        assert loaded["step"] == 12 and loaded["rng"] == content["rng"]
        assert all(torch.equal(loaded["state"][k], content["state"][k]) for k in content["state"])
    assert refused > 50


# ---------------------------------------------------------------------------------------------------------------------
# a run never loses finished work: the command line on digits


TINY_ARGS = ["--hidden", "8", "--epochs", "1", "--bma-samples", "1", "--lambda-max-draws", "1", "--lambda-max-points",
             "8", "--lambda-max-iters", "2", "--no-progress", "--no-figures"]
"""Digits, an MLP 64-8-10, one epoch of 10 steps per job."""


def _bench(out: Path, *args: str) -> list[str]:
    """``bench`` with :data:`TINY_ARGS` and ``args`` (which override them) to ``out``."""
    return ["bench", *TINY_ARGS, *args, "--out", str(out)]


def _one_line(err: str) -> str:
    """The one line a run ends with on stderr (no traceback before it)."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _record_file(out: Path, method: str) -> Path:
    return out / "records" / job_name("digits", method, 0) / "record.pt"


def _broken(problem):
    """A method that trains 3 steps, then raises (as a bug in a method would)."""
    from pyro_flat.bench.state import Holder

    for step, _ in problem.loop(10, {"w": Holder(0)}):
        if step == 2:
            raise RuntimeError("the broken method broke")
    raise AssertionError("unreachable")


def test_a_failing_job_among_three_leaves_the_others_results(tmp_path, monkeypatch, capsys):
    """A job that raised ended the whole run and lost the finished jobs (results.json and table.md were written at
    the very end): now it is recorded as failed — one line naming the job, the step, the cause and the log with the
    traceback — the jobs after it run, the table marks it, and the exit status is 1. ``--resume`` reads the finished
    jobs back; ``--fail-fast`` stops at the failure."""
    monkeypatch.setitem(METHODS, "broken", MethodSpec("broken", _broken, "raises at step 2"))
    out = tmp_path / "run"
    assert main(_bench(out, "--methods", "map", "broken", "vi")) == 1
    captured = capsys.readouterr()
    failure, summary = captured.err.strip().splitlines()
    assert failure == (f"pyro_flat: digits/broken/seed 0 failed at step 2 of 10: RuntimeError: the broken method "
                       f"broke (traceback in {out / 'run.log'})")
    assert summary.startswith("pyro_flat: 1 of 3 jobs failed") and "digits/broken/seed 0" in summary
    assert "Traceback" not in captured.err and "Traceback" in (out / "run.log").read_text()
    table = (out / "table.md").read_text()
    assert "| map | " in table and "| vi | " in table and "| broken (failed) | – |" in table
    records = json.loads((out / "results.json").read_text())["records"]
    assert [(r["method"], "error" in r) for r in records] == [("map", False), ("broken", True), ("vi", False)]
    assert _record_file(out, "map").exists() and _record_file(out, "vi").exists()
    assert not _record_file(out, "broken").exists()
    finished = {m: _record_file(out, m).read_bytes() for m in ("map", "vi")}
    # --resume: the finished jobs are read back, not trained again; the failed one runs (and fails) again
    assert main(_bench(out, "--methods", "map", "broken", "vi", "--resume")) == 1
    assert {m: _record_file(out, m).read_bytes() for m in ("map", "vi")} == finished
    assert "digits/map/seed 0: read back" in (out / "run.log").read_text()
    capsys.readouterr()
    # --fail-fast: the run stops at the failed job; what finished before it is on disk
    fast = tmp_path / "fast"
    assert main(_bench(fast, "--methods", "map", "broken", "vi", "--fail-fast")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1].startswith("pyro_flat: stopped at the first failed job (--fail-fast)")
    command = err[1].split("continue with: ")[1]
    assert command.startswith("python -m pyro_flat bench ") and command.endswith(f"--out {fast} --resume")
    assert _record_file(fast, "map").exists() and not _record_file(fast, "vi").exists()
    assert [r["method"] for r in json.loads((fast / "results.json").read_text())["records"]] == ["map", "broken"]


def test_divergence_by_lr_is_a_failed_job_and_the_others_finish(tmp_path, capsys):
    """sgld at lr 1e6 overflows (non-finite logits), vi at --lr 1e6 collapses its scales to exactly 0 (finite, so it
    was a 109-line Pyro traceback naming no job): each is a failed job naming the step and what diverged, and map,
    which ran before them, and the jobs between them finish."""
    out = tmp_path / "run"
    code = main(_bench(out, "--methods", "sgld", "map", "vi", "--epochs", "3", "--lr", "1e6", "--set", "sgld.lr=1e6"))
    assert code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("pyro_flat: digits/sgld/seed 0 failed: diverged: ") and " at step " in lines[0]
    assert lines[1].startswith("pyro_flat: digits/vi/seed 0 failed: diverged: guide.scales.net.weights left the "
                               "support of its constraint SoftplusPositive(lower_bound=0.0) (its values span [0, ")
    assert " at step " in lines[1] and lines[1].endswith(f"(traceback in {out / 'run.log'})")
    assert [r["method"] for r in json.loads((out / "results.json").read_text())["records"] if "error" not in r] == [
        "map"]


def test_a_degenerate_posterior_is_caught_at_the_log_interval_without_validation():
    """With Pyro's validation off nothing rejects a zero scale: the loop's check at the log interval (in the host
    read of the loss there, not one more per step) names it, with finite losses throughout."""
    from pyro.infer.autoguide import AutoNormal

    from pyro_flat.bench.loop import RunContext
    from pyro_flat.bench.problem import Problem
    from pyro_flat.data import load_digits

    problem = Problem(load_digits(), DIGITS, context=RunContext(label="job"))
    model = problem.build_model()
    guide = AutoNormal(model)
    guide(problem.data.x_train[:2], problem.data.y_train[:2])
    loop = problem.loop(100, {"model": model, "guide": guide}, log_every=50)
    with pytest.raises(FloatingPointError, match=r"^job: guide.scales.net.weights left the support of its constraint "
                                                 r"SoftplusPositive\(lower_bound=0.0\) \(its values span \[0, 0\]\) at "
                                                 r"step 99 of 100$"):
        for step, _ in loop:
            if step == 60:
                with torch.no_grad():
                    guide.scales.net.weights_unconstrained.fill_(-1e4)  # softplus underflows to exactly 0
            loop.record(torch.tensor(1.0))
    assert loop.step == 99  # caught at the next logged step (the last), not at once: no host read in between


@pytest.mark.parametrize("args, message", [
    (["--methods", "map", "swag", "sgld", "--epochs", "2"], "swag: its low-rank term needs 2 snapshots, and this run "
     "collects 1 (one per epoch from swa_start=1 to --epochs 2); use --epochs 3 or more or --set swag.swa_start=0, or "
     "swag_diag (the diagonal alone)"),
    (["--methods", "f_swag", "--epochs", "1"], "f_swag: its low-rank term needs 2 snapshots, and this run collects 1"),
    (["--methods", "swag", "--epochs", "3", "--set", "swag.swa_start=2"], "collects 1 (one per epoch from "
     "swa_start=2 to --epochs 3); use --epochs 4 or more or --set swag.swa_start=1"),
    (["--methods", "swag", "--epochs", "3", "--set", "swag.max_rank=1"], "--set swag.max_rank=1 keeps fewer than"),
    (["--methods", "map", "csgld", "--epochs", "1"], "csgld: CyclicalStepSize: samples_per_cycle=1 exceeds the 0 "
     "steps of the sampling stage"),
    (["--methods", "map", "--device", "cuda:x"], "--device cuda:x: not a torch device"),
    (["--methods", "map", "--model", "resnet"], "--model resnet: unknown model; known models: cnn, mlp"),
])
def test_what_a_job_is_bound_to_fail_on_is_refused_before_the_output_folder(args, message, tmp_path, capsys):
    """SWAG collecting one snapshot used to train every method, then raise in SWAG's guide after the others
    finished (and lose them); now such a configuration is one line, exit status 2, before the output folder exists."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(_bench(out, *args))
    assert exit_info.value.code == 2
    assert message in _one_line(capsys.readouterr().err)
    assert not out.exists()


def test_device_cuda_without_a_gpu_is_refused_before_the_output_folder(tmp_path, monkeypatch, capsys):
    """It was a 31-line "Found no NVIDIA driver" traceback raised after the output folder was created (the GPU is
    hidden here, so that the test means the same on a machine with one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(_bench(out, "--methods", "map", "--device", "cuda"))
    assert exit_info.value.code == 2
    assert "--device cuda: no cuda device is available on this machine" in _one_line(capsys.readouterr().err)
    assert not out.exists()


def test_methods_that_refuse_torchrun_are_refused_before_training(tmp_path, monkeypatch, capsys):
    """sgld refused torchrun only when its turn came, after map trained; now before the output folder exists (a
    process group of one rank, as torchrun --nproc_per_node=1 makes)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(_bench(out, "--methods", "map", "sgld"))
    assert exit_info.value.code == 2
    assert "sgld: the SG-MCMC methods run in one process" in _one_line(capsys.readouterr().err)
    assert not out.exists() and not torch.distributed.is_initialized()


def test_a_damaged_checkpoint_is_named_with_what_to_do(tmp_path, capsys):
    """A damaged checkpoint ended the resume in a 45-line traceback that did not say what to do; now the job fails in
    one line naming the file and the fix, the other jobs run, and the fix works."""
    out = tmp_path / "run"
    assert main(_bench(out, "--methods", "map", "vi", "--checkpoint-every", "4")) == 0
    job = out / "checkpoints" / job_name("digits", "map", 0)
    _record_file(out, "map").unlink()  # as if killed before the job's end
    (job / "phase_0.pt").write_bytes(os.urandom(2000))
    capsys.readouterr()
    assert main(_bench(out, "--methods", "map", "vi", "--checkpoint-every", "4", "--resume")) == 1
    failure = capsys.readouterr().err.strip().splitlines()[0]
    assert failure.startswith(f"pyro_flat: digits/map/seed 0 failed before training: {job / 'phase_0.pt'}: cannot be "
                              "read: truncated or damaged (")
    assert f"to redo this job from its start, delete {job} and run again with --resume" in failure
    import shutil

    shutil.rmtree(job)
    assert main(_bench(out, "--methods", "map", "vi", "--checkpoint-every", "4", "--resume")) == 0


def _run_process(out: Path, fault: str, k: int, *args: str) -> subprocess.Popen:
    """``python -m pyro_flat`` (through :mod:`tests.bench._fault_injection`) with ``fault`` at step ``k``."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "tests.bench._fault_injection", fault, str(k), "--",
                             *_bench(out, *args)], cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigint_and_sigterm_stop_at_a_step_boundary_and_resume_continues(tmp_path, capsys):
    """Ctrl-C printed a 57-94-line KeyboardInterrupt traceback (exit 1), SIGTERM nothing (exit 143); neither said how
    to continue, and --resume after a run without checkpoints silently started over. Now (two real processes, the
    signal sent at vi's 5th step, map done): one line — where it stopped, the checkpoint (SIGINT, with checkpoints)
    or that --resume redoes the unfinished jobs (SIGTERM, without), the exact command — exit 130 / 143, the finished
    job's results on disk; that command finishes the run with map read back and vi as an uninterrupted vi."""
    runs = {"sigint": _run_process(tmp_path / "sigint", "sigint-step", 15, "--methods", "map", "vi",
                                   "--checkpoint-every", "2"),
            "sigterm": _run_process(tmp_path / "sigterm", "sigterm-step", 15, "--methods", "map", "vi")}
    reference = tmp_path / "reference"
    torch.set_default_dtype(torch.float32)  # as the processes run (the tests' default is float64; restored after)
    assert main(_bench(reference, "--methods", "vi")) == 0
    for name, run in runs.items():
        _, err = run.communicate(timeout=300)
        out = tmp_path / name
        assert run.returncode == (130 if name == "sigint" else 143), err
        line = _one_line(err)
        assert line.startswith(f"pyro_flat: stopped by {name.upper()} in digits/vi/seed 0 before step 5 of 10; the "
                               f"results of the 1 finished job are in {out}; ")
        if name == "sigint":
            checkpoint = out / "checkpoints" / job_name("digits", "vi", 0) / "checkpoint.pt"
            assert f"the job's state is saved in {checkpoint}" in line and load_checkpoint(checkpoint)["step"] == 5
        else:
            assert "no checkpoints were kept (--checkpoint-every), so --resume reuses the finished jobs and redoes " \
                   "the unfinished ones from their start" in line
        command = line.split("continue with: ")[1]
        assert command.startswith("python -m pyro_flat bench ") and command.endswith("--resume")
        assert "| map |" in (out / "table.md").read_text() and not (out / ".lock").exists()
        finished = _record_file(out, "map").read_bytes()
        assert main(shlex.split(command)[3:]) == 0  # the printed command, run here
        assert _record_file(out, "map").read_bytes() == finished  # read back, not trained again
        records = {r["method"]: r for r in json.loads((out / "results.json").read_text())["records"]}
        vi = json.loads((reference / "results.json").read_text())["records"][0]
        assert records["vi"]["metrics"] == vi["metrics"]  # every float equal


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (skipped where this process may not mount one); unmounted after the test."""
    import shutil

    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (or CAP_SYS_ADMIN) and the mount command")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_never_a_sigbus(small_disk, capsys):
    """On a full disk a checkpoint write was a 55-line RuntimeError with Errno 28 buried in it, and sgld's
    memory-mapped draw file (sparse) a SIGBUS: exit 135, no output at all. Now the draw file is allocated up front,
    so the full disk is an ordinary error: one line naming the file, exit status 1, map's results on disk; after
    space is freed the printed command finishes the run."""
    out = small_disk / "run"
    run = _run_process(out, "none", 0, "--methods", "map", "sgld", "--hidden", "256", "--epochs", "2",
                       "--bma-samples", "8", "--checkpoint-every", "0")  # map's files fit, sgld's draws do not
    _, err = run.communicate(timeout=300)
    assert run.returncode == 1, err
    line = _one_line(err)
    assert f"{out / 'checkpoints' / job_name('digits', 'sgld', 0)}/" in line and ": no space left on device; the " \
           "last checkpoint and the files written before are intact" in line, line
    assert _record_file(out, "map").exists() and "| map |" in (out / "table.md").read_text()
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # space freed
    assert main(shlex.split(line.split("continue with: ")[1].split(" (traceback")[0])[3:]) == 0
    assert _record_file(out, "sgld").exists()


@pytest.mark.slow
def test_a_stalled_rank_ends_the_others_naming_it(tmp_path):
    """A rank that stalls (SIGSTOP) held the other in a collective for torch's 30 minutes, silently, and no flag
    changed it. Now the process group times out after --dist-timeout (here 12 s) and rank 0 ends the run in one line
    naming rank 1 (then the stopped rank is killed, as an operator would)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    hold, out = tmp_path / "stalled", tmp_path / "run"
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HOLD_FILE=str(hold))
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                            str(port), "-m", "tests.bench._fault_injection", "stall-step", "3", "--",
                            *_bench(out, "--methods", "map", "--dist-timeout", "0.2")], cwd=ROOT, env=environment,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in run.stderr:  # torchrun passes the ranks' stderr through as it comes
            lines.append(line)
            if line.startswith("pyro_flat: "):
                break
    finally:
        if hold.exists():
            os.kill(int(hold.read_text()), signal.SIGKILL)
        run.communicate(timeout=120)
    assert lines and lines[-1].startswith("pyro_flat: a collective operation with the other ranks failed ("), lines
    assert "rank 1 did not answer within 12 s: stalled or dead" in lines[-1]
    assert "continue with: torchrun --nproc_per_node=2 -m pyro_flat bench " in lines[-1] and " --resume" in lines[-1]
    assert run.returncode != 0
