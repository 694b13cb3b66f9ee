"""The SVI step-time benchmarks of ``benchmarks/`` run end to end at a tiny size (their timings are not checked)."""

import importlib.util
import json
import sys
from pathlib import Path

import pyro
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def _float32_and_threads(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import `_svi_steps` and `_timing`
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    pyro.enable_validation(True)


@pytest.mark.parametrize("name", ["sharpness_aware_elbo", "kl_ball_elbo"])
def test_step_time_script_runs_and_writes_its_table(name, tmp_path):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / f"{name}.md"
    module.main(["--repeats", "1", "--steps", "1", "--jit-backend", "eager", "--out", str(out)])
    text = out.read_text()
    assert "| ratio | value | target |" in text and "torch BBB" in text and "the limit of a step" in text
    assert "nan" not in text.lower()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:FutureWarning")  # Pyro's JitTrace_ELBO
@pytest.mark.slow
def test_compiled_step_time_script_runs_and_writes_its_table(tmp_path):
    """benchmarks/compiled.py at a tiny size, its compiled variants as captured graphs and dynamo traces (no
    compilation time), the compiled hand-written steps checked against the Pyro steps."""
    spec = importlib.util.spec_from_file_location("compiled", BENCHMARKS / "compiled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "compiled.md"
    module.main(["--repeats", "1", "--steps", "1", "--warmup", "3", "--draws", "10", "--jit-backend", "none",
                 "--warm-cache", "--out", str(out)])
    text = out.read_text()
    assert "| compiled / compiled hand-written (the limit) |" in text and "JitSharpnessAwareELBO" in text
    assert "not compiled" in text and "nan" not in text.lower()
    rows = [line for line in text.splitlines() if line.startswith("| ") and " / torch " in line]
    assert len(rows) == 7 and all(len(row.split(" | ")) == 5 for row in rows)
    assert all(f"| {name} | " in text for name in ("torch BBB-SAM", "torch KL-ball", "torch SGLD (idiomatic)"))
    assert "- SharpnessAwareELBO vs torch BBB-SAM, compiled: " in text


def test_compile_options_script_runs(tmp_path):
    """benchmarks/compile_options.py at a tiny size, torch.compile with its cheap `eager` backend."""
    spec = importlib.util.spec_from_file_location("compile_options", BENCHMARKS / "compile_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.main(["--repeats", "1", "--steps", "1", "--backend", "eager", "--warm-cache",
                        "--out", str(tmp_path / "c.md")])
    assert text.count("| ") >= 7 and "torch.jit.trace" in text and "nan" not in text.lower()


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_packed_steps_cost_at_most_the_goal_in_operations_and_make_no_host_read():
    """The CPU proxies of the GPU goals (benchmarks/step_ops.py) on ResNet-18 width 4: a packed Pyro step dispatches
    at most 1.5x the ATen operations of the cheaper hand-written torch step doing the same arithmetic (2x for the KL
    ball), checked to compute the same loss and gradients; TensorSVI makes no host read per step, SVI.step one."""
    step_ops = _load("step_ops")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)
    network = step_ops.Network("resnet18", width=4, num_data=64, batch=8)
    rows = step_ops.measure(network, list(step_ops.METHODS), steps=1)
    for row in rows:
        name = row["method"]
        assert row["pyro packed"].reads == 0, name
        if "svi reads packed" in row:
            assert row["svi reads packed"] == 1, name
        for key in ("check per tensor", "check packed"):
            if key in row:
                assert row[key] < 1e-4, (name, key, row[key])  # float32 rounding
        ratio = step_ops.ratio(row)
        if ratio is not None:
            assert ratio <= step_ops.GOALS.get(name, step_ops.DEFAULT_GOAL), (name, ratio)
        assert row["pyro packed"].ops < row["pyro per tensor"].ops / 3, name  # what packing saves
    assert {row["method"] for row in rows} == set(step_ops.METHODS)


def test_mlp_steps_make_no_host_read_and_match_the_hand_written_steps():
    step_ops = _load("step_ops")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)
    rows = step_ops.measure(step_ops.Network("mlp"), ["MAP", "F-VI", "KL ball", "SGLD"], steps=1)
    for row in rows:
        assert row["pyro packed"].reads == 0 and row["pyro per tensor"].reads == 0, row["method"]
        assert all(row[k] < 1e-4 for k in ("check per tensor", "check packed") if k in row), row


@pytest.mark.slow
def test_gpu_check_runs_every_part_on_a_cpu(tmp_path):
    """benchmarks/gpu_check.py at toy size on the CPU: the CUDA tests (skipped here), the step table with its plain
    torch rows and compiled rows (torch.compile's dynamo traces, Pyro's captured graph), the goals computed from the
    rows, and the harness (eager at this size)."""
    gpu_check = _load("gpu_check")
    out = tmp_path / "gpu_cpu.md"
    text = gpu_check.main(["--smoke", "--device", "cpu", "--methods", "MAP",
                           "--pytest-args", str(BENCHMARKS.parent / "tests" / "test_readme.py"), "--out", str(out)])
    assert out.read_text() == text
    assert "## CUDA tests" in text and "## Steps" in text and "## Harness" in text and "exit code 0" in text
    assert "failed" not in text and "differs" not in text and "skipped" not in text
    table = text.split("## Steps")[1].split("## Goals")[0]
    rows = {tuple(line.split(" | ")[:2]) for line in table.splitlines() if line.startswith(("| MAP |", "| plain "))}
    assert rows == {("| MAP", v) for v in ("Pyro packed", "Pyro packed, compiled", "torch packed",
                                           "torch packed, compiled")} | {
        ("| plain torch", v) for v in ("SGD", "SAM", "SGD, torch.compile(net) + fused SGD",
                                       "SAM, torch.compile(net) + fused SGD")}
    goals = dict(line.split(" | ")[:2] for line in text.splitlines() if line.startswith("| compiled MAP step"))
    assert set(goals) == {"| compiled MAP step / plain torch eager SGD step",
                          "| compiled MAP step / compiled hand-written step (the limit)"}
    assert "–" not in goals.values()
    harness = text.split("## Harness")[1]
    assert "| cifar10/map/seed 0" in harness
    assert json.loads(out.with_suffix(".json").read_text())[0]["method"] == "plain torch"


def _mlp_hand_written_steps(step_ops, compiled):
    """Every hand-written step of the step tables on the MLP (its own copy of the weights), by name."""
    network = step_ops.Network("mlp")
    steps = {name: step_ops.torch_step(network, cls, packed=False, **options)
             for name, (_, cls, options) in step_ops.METHODS.items() if isinstance(cls, type)}
    steps["SGLD"] = step_ops.torch_sgld(network, packed=False)
    steps["SGLD (idiomatic)"] = compiled.TorchSGLD(network)
    return steps


def test_hand_written_steps_draw_their_random_numbers_on_the_data_device():
    """The CPU twin of the CUDA failure of check_same_step (differences of order 1 on a GPU): Pyro's plate draws its
    minibatch on the data's device, so a hand-written step must too. With the default device set elsewhere ("meta",
    the data staying on the CPU), a draw made without ``device=`` leaves the data's device (and its generator): every
    random draw of every hand-written step must stay on the CPU, and a step must still run."""
    step_ops, compiled = _load("step_ops"), _load("compiled")
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)
    for name, step in _mlp_hand_written_steps(step_ops, compiled).items():
        run = getattr(step, "step", step)
        run()  # torch's optimisers keep their step counters on the default device: made before it changes
        with torch.device("meta"), step_ops.RandomDraws() as draws:
            run()
        assert draws.draws and {device for device, _ in draws.draws} == {"cpu"}, (name, draws.draws)


def test_check_same_step_refuses_steps_that_draw_different_random_numbers():
    """check_same_step compares the random draws of both sides first (device, size, order): a hand-written step that
    draws its minibatch on another device, or before the noise, is refused, not given a meaningless difference."""
    sharpness_aware_elbo, svi_steps = _load("sharpness_aware_elbo"), _load("_svi_steps")
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)
    network = svi_steps.Network("mlp", packed=True)

    class OtherDevice(sharpness_aware_elbo.TorchBBBSAM):
        def minibatch(self):
            return torch.randperm(self.num_data, device="meta")[: self.batch]

    class MinibatchFirst(sharpness_aware_elbo.TorchBBBSAM):
        def draw(self):
            idx = self.minibatch()
            return [torch.randn_like(m) for m in self.locs], idx

    pyro_step = network.svi(sharpness_aware_elbo.SharpnessAwareELBO(sharpness_aware_elbo.RHO))
    assert svi_steps.check_same_step(pyro_step, network.torch_step(sharpness_aware_elbo.TorchBBBSAM)) < 1e-4
    for cls in (OtherDevice, MinibatchFirst):
        with pytest.raises(ValueError, match="do not draw the same random numbers"):
            svi_steps.check_same_step(pyro_step, network.torch_step(cls))


def test_compiled_hand_written_steps_compute_the_pyro_steps():
    """The compiled hand-written steps (one graph, fullgraph=True, through AOTAutograd: the "aot_eager" backend, which
    TorchInductor then compiles) compute the loss and gradients of the Pyro step, and SGLD's transition, as the eager
    ones do (float32 rounding; the loss is of order 1e5)."""
    step_ops = _load("step_ops")
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)
    network = step_ops.Network("mlp", packed=True)
    options = {"backend": "aot_eager", "fullgraph": True}
    make_pyro = step_ops.METHODS["F-VI"][0]
    hand = step_ops.torch_step(network, step_ops.TorchBBBSAM, True, compile_options=options)
    assert step_ops.check_same_step(make_pyro(network, True), hand) < 1e-4
    hand.step()  # the fused optimiser after the compiled objective
    assert all(torch.isfinite(p).all() for p in hand.parameters())
    params, forward = step_ops.packed_torch(network.torch_params, network.torch_forward)
    sgld = step_ops.TorchSGLDStep(network.x, network.y, params, forward, network.batch, compile_options=options)
    assert step_ops.check_same_transition(step_ops.METHODS["SGLD"][0](network, True), sgld) < 1e-5


def test_cheaper_steps_script_counts_the_ascents_and_checks_the_full_step(tmp_path):
    """benchmarks/efficient_sam_steps.py at a tiny size: LookSAM k=5 took the ascent on exactly one step in five of
    the timed ones, and the full SharpnessAwareELBO step equals the hand-written one in float64."""
    spec = importlib.util.spec_from_file_location("efficient_sam_steps", BENCHMARKS / "efficient_sam_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.main(["--networks", "mlp", "--repeats", "1", "--steps", "5", "--warmup", "1",
                        "--out", str(tmp_path / "e.md")])
    ratios = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if "(× " in line}
    assert ratios["SharpnessAwareELBO looksam_k=5"][3] == "1/5 (0.20) |"
    assert ratios["SAM(SGD) looksam_k=5"][3] == "1/5 (0.20) |"
    checks = dict(pair.rsplit(" ", 1) for pair in text.split("float64): ")[1].split(".\n")[0].split("; "))
    assert max(float(v.rstrip(".")) for v in checks.values()) < 1e-10
    assert "nan" not in text.lower()
