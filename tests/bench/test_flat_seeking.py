from types import SimpleNamespace

import pytest
import torch

from pyro_flat.bench import METHODS, RunConfig
from pyro_flat.bench.flat_seeking import DEFAULT_RHO, sharpness_aware_loss
from pyro_flat.bench.problem import Problem
from pyro_flat.bench.runner import run_one
from pyro_flat.data import load_digits

TINY = RunConfig(hidden=(32,), num_epochs=4, lr=1e-2, num_bma_samples=4, ensemble_size=2, lambda_max_draws=1,
                 lambda_max_points=64, lambda_max_iters=10)
FLAT = {"f_vi": "vi", "sam": "map", "f_mc_dropout": "mc_dropout", "f_ensemble": "ensemble"}


def test_registered_against_their_baselines():
    for name, baseline in FLAT.items():
        assert METHODS[name].baseline == baseline
        assert "2302.02713" in METHODS[name].reference


@pytest.mark.parametrize("method", sorted(FLAT))
def test_flat_methods_learn_digits(method):
    record = run_one(method, "digits", 0, TINY)
    m = record.metrics
    # 4 epochs (40 Adam steps, lr 1e-2) of a 64-32-10 MLP reach ~90 %, far above the 10 % of chance
    assert m["acc"] > 0.75
    assert 0 < m["nll"] < 1.0
    assert m["lambda_max"] > 0


def test_rho_zero_reproduces_the_baseline():
    # SharpnessAwareELBO(0) is Trace_ELBO step for step (same random stream), so sam with rho=0 is map
    config = TINY.replace(num_epochs=2, options={"sam": {"rho": 0.0}})
    flat, base = run_one("sam", "digits", 3, config), run_one("map", "digits", 3, config)
    for key in ("acc", "nll", "ece", "lambda_max"):
        assert flat.metrics[key] == pytest.approx(base.metrics[key], rel=1e-6, abs=1e-9)


def test_options():
    problem = Problem(load_digits(), TINY.replace(options={"f_vi": {"rho": 0.2, "adaptive": True}}))
    loss = sharpness_aware_loss(problem, "f_vi")
    assert (loss.rho, loss.adaptive) == (0.2, True)
    assert sharpness_aware_loss(problem, "sam").rho == DEFAULT_RHO == 0.05
    bad = Problem(load_digits(), TINY.replace(options={"sam": {"rho": -1.0}}))
    with pytest.raises(ValueError, match="rho"):
        sharpness_aware_loss(bad, "sam")


@pytest.mark.parametrize("method", ["map", "vi", "f_vi", "sa_bma", "sgld", "bsam"])
def test_compiled_runs_reproduce_the_eager_runs(method, monkeypatch):
    """``RunConfig(compile=True)`` trains every method through a compiled step, the non-flat bases included (their
    ``JitTensorTrace_ELBO``: on a GPU, CUDA graphs), and those steps are the eager ones (the captured graph runs
    uncompiled here: TorchInductor would cost seconds; tests/infer/test_compiled.py compiles); bsam's closure too."""
    from pyro_flat.bench import flat_seeking, kl_ball, problem, sgmcmc

    made = []

    def graph(cls):
        def build(*args, **kwargs):
            made.append(cls(*args, jit_options={"backend": None}, **kwargs))
            return made[-1]
        return build

    monkeypatch.setattr(problem, "JitTensorTrace_ELBO", graph(problem.JitTensorTrace_ELBO))
    monkeypatch.setattr(flat_seeking, "JitSharpnessAwareELBO", graph(flat_seeking.JitSharpnessAwareELBO))
    monkeypatch.setattr(kl_ball, "JitKLBallELBO", graph(kl_ball.JitKLBallELBO))
    monkeypatch.setattr(sgmcmc, "SGLD", graph(sgmcmc.SGLD))

    calls = problem.CompiledCalls

    def closure_calls(owner):  # BayesianSAM's closure
        made.append(SimpleNamespace(_compiled=calls(owner, {"backend": None})))
        return made[-1]._compiled

    monkeypatch.setattr(problem, "CompiledCalls", closure_calls)
    config = TINY.replace(num_epochs=1)
    eager = run_one(method, "digits", 0, config)
    made.clear()
    compiled = run_one(method, "digits", 0, config.replace(compile=True))
    assert len(made) == 1 and made[0]._compiled.captures()  # the compiled path trained the method
    for key in ("acc", "nll", "ece", "lambda_max"):
        assert compiled.metrics[key] == pytest.approx(eager.metrics[key], rel=1e-5, abs=1e-7)


def test_cheaper_step_options_reach_the_objectives_and_optimizers():
    from pyro_flat.bench.trajectory import _cheaper_steps

    options = {"sam": {"looksam_k": 5, "looksam_alpha": 0.5}, "f_vi": {"rst_p": 0.3},
               "sam_torch": {"esam_gamma": 0.5, "rst_p": 0.25}}
    problem = Problem(load_digits(), TINY.replace(options=options))
    schedule = sharpness_aware_loss(problem, "sam").schedule
    assert (schedule.looksam_k, schedule.looksam_alpha, schedule.rst_p) == (5, 0.5, 1.0)
    assert sharpness_aware_loss(problem, "f_vi").schedule.rst_p == 0.3
    assert not sharpness_aware_loss(problem, "f_mc_dropout").schedule.active  # the defaults: the ascent every step
    assert _cheaper_steps(problem, "sam_torch") == {"esam_gamma": 0.5, "rst_p": 0.25}


@pytest.mark.parametrize(("options", "match"), [
    ({"sam": {"looksam_k": 0}}, "sam.looksam_k must be an int >= 1"),
    ({"sam": {"rst_p": 1.2}}, r"sam.rst_p must be a number in \[0, 1\]"),
    ({"sam_torch": {"esam_gamma": 0.0}}, r"sam_torch.esam_gamma must be a number in \(0, 1\]"),
    ({"sam": {"esam_gamma": 0.5}}, "method 'sam' has no option 'esam_gamma'"),
])
def test_bad_cheaper_step_options_are_refused_before_a_run(options, match):
    from pyro_flat.bench.options import check_option_values
    from pyro_flat.bench.registry import check_method_options

    config = TINY.replace(options=options)
    with pytest.raises(ValueError, match=match):
        check_method_options(config.options)
        check_option_values(config)


@pytest.mark.parametrize(("method", "options", "kill_at"), [
    ("sam", {"rst_p": 0.5}, 23), ("sam", {"looksam_k": 3}, 17), ("f_sgld", {"looksam_k": 4}, 19),
    ("sam_torch", {"esam_gamma": 0.5, "rst_p": 0.5}, 13), ("bsam", {"looksam_k": 3}, 11),
])
def test_resume_with_cheaper_steps_is_exact(method, options, kill_at, tmp_path, monkeypatch):
    # the schedule (steps taken, RST's random state, LookSAM's directions) is checkpointed with the rest
    from tests.bench.test_loop import _uninterrupted_and_resumed

    config = TINY.replace(num_epochs=4, options={method: options})
    reference, resumed = _uninterrupted_and_resumed(method, kill_at, config, tmp_path, monkeypatch)
    assert resumed.metrics == reference.metrics and torch.equal(resumed.test_probs, reference.test_probs)


def test_compile_by_default_on_cuda_for_runs_long_enough_to_repay_it():
    # RunConfig(compile=None): compiled on CUDA from COMPILE_AUTO_STEPS steps (the H200's compiled MAP / VI steps repay
    # their ~30 s compilation after ~2,000-2,700 steps), eager on a CPU and for short runs; True / False decide
    from pyro_flat.bench.config import COMPILE_AUTO_STEPS

    def problem(device: str, num_epochs: int, compile: bool | None = None) -> Problem:
        data = SimpleNamespace(device=torch.device(device), num_data=128 * 100)  # 100 steps an epoch at batch 128
        return Problem(data, RunConfig(num_epochs=num_epochs, batch_size=128, compile=compile))

    long_run = COMPILE_AUTO_STEPS // 100
    assert problem("cuda", long_run).compiled and not problem("cuda", long_run - 1).compiled
    assert not problem("cpu", long_run).compiled
    assert problem("cpu", 1, compile=True).compiled and not problem("cuda", long_run, compile=False).compiled
    with pytest.raises(ValueError, match="RunConfig.compile must be True, False or None"):
        RunConfig(compile="yes")
