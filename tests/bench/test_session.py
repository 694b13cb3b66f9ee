"""The run session behind ``bench`` and ``recipe``: when checkpoints are written."""

from pyro_flat.bench.cli import main

ARGS = ["bench", "--methods", "map", "--epochs", "1", "--no-progress", "--no-figures", "--bma-samples", "1",
        "--lambda-max-draws", "1", "--lambda-max-points", "8", "--lambda-max-iters", "2"]


def test_checkpoint_every_zero_checkpoints_at_the_end_of_each_phase(tmp_path):
    """``--checkpoint-every 0`` asks for checkpoints at the end of each phase only (it used to write none, so a run
    could not be extended with --resume); without the flag or --resume nothing is checkpointed."""
    assert main([*ARGS, "--out", str(tmp_path / "zero"), "--checkpoint-every", "0"]) == 0
    saved = list((tmp_path / "zero" / "checkpoints").rglob("*.pt"))
    assert saved, "no checkpoint written"
    assert main([*ARGS, "--out", str(tmp_path / "none")]) == 0
    assert not (tmp_path / "none" / "checkpoints").exists()
