"""Fault injection for long runs, on image data (a generated CIFAR-10 folder, PreResNet-8 width 2).

* kills: a run SIGKILLed at random steps (chosen by a seeded generator) and in the middle of a checkpoint write,
  then resumed, ends bit for bit where an uninterrupted run ends (for one method of every family, in process; and
  through the command line in real processes);
* damaged and crafted files: a crafted pickle in any of the files a resume reads is refused unread (no code runs); a
  truncated file or a flipped bit is refused naming the file;
* concurrent writers: a second run on the same folder is refused while the first holds it; a killed holder's
  checkpoints are neither reused by a run without ``--resume`` nor overwritten, and ``--resume`` continues them.

The tests with real processes or many runs are marked ``slow``; they run in CI.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pyro_flat.bench import RunConfig
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
    return {job: load_checkpoint(out / "checkpoints" / job / "record.pt")
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
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", job_name("digits", "map", 0), "keep.tmp1"]


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
