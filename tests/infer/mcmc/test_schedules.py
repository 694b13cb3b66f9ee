import math

import pytest

from pyro_flat.infer.mcmc import ConstantStepSize, CyclicalStepSize, PolynomialDecay
from pyro_flat.infer.mcmc.schedules import as_schedule


def test_constant_and_polynomial():
    assert ConstantStepSize(0.1)(0) == ConstantStepSize(0.1)(1000) == 0.1
    decay = PolynomialDecay(0.5, b=10.0, gamma=0.55)
    assert decay(0) == pytest.approx(0.5 * 10**-0.55)
    assert decay(90) == pytest.approx(0.5 * 100**-0.55)
    assert decay.collects(3) is None and decay.injects_noise(3)


def test_cyclical_cosine_schedule():
    sched = CyclicalStepSize(1.0, cycle_length=10, final_step_size=0.1, exploration_fraction=0.5, samples_per_cycle=2)
    # eps_t = final + (initial - final) / 2 (cos(pi r) + 1), r = (t mod C) / C
    for t in (0, 3, 9, 10, 27):
        r = (t % 10) / 10
        assert sched(t) == pytest.approx(0.1 + 0.45 * (math.cos(math.pi * r) + 1))
    assert sched(0) == sched(10) == pytest.approx(1.0)
    # exploration stage (r < 0.5) has no noise, sampling stage has
    assert [sched.injects_noise(t) for t in range(10)] == [False] * 5 + [True] * 5
    # two draws per cycle, evenly spaced in the sampling stage, the last at the end of the cycle
    assert [t for t in range(30) if sched.collects(t)] == [7, 9, 17, 19, 27, 29]


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: ConstantStepSize(0.0), "step_size"),
        (lambda: ConstantStepSize(-1.0), "step_size"),
        (lambda: PolynomialDecay(0.1, gamma=-1.0), "gamma"),
        (lambda: CyclicalStepSize(0.1, 0), "cycle_length"),
        (lambda: CyclicalStepSize(0.1, 10, final_step_size=0.2), "final_step_size"),
        (lambda: CyclicalStepSize(0.1, 10, exploration_fraction=1.0), "exploration_fraction"),
        (lambda: CyclicalStepSize(0.1, 10, exploration_fraction=0.8, samples_per_cycle=3), "samples_per_cycle"),
        (lambda: as_schedule(float("nan")), "step_size"),
        (lambda: as_schedule("0.1"), "step_size"),
    ],
)
def test_bad_schedules(build, match):
    with pytest.raises(ValueError, match=match):
        build()
