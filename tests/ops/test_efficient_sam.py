"""pyro_flat.ops.efficient_sam: LookSAM's decomposition, ESAM's selection and the schedule of LookSAM/RST steps."""

import json
import math

import pytest
import torch

from pyro_flat.ops.efficient_sam import (
    BASE_STEP,
    REUSE_STEP,
    SAM_STEP,
    SharpnessSchedule,
    looksam_direction,
    looksam_gradient,
    selection_size,
    sharpness_sensitive_selection,
)


def test_looksam_direction_is_the_orthogonal_part_over_all_tensors():
    g = [torch.tensor([1.0, 2.0]), torch.tensor([[0.5], [-1.0]])]
    gs = [torch.tensor([0.3, -0.7]), torch.tensor([[2.0], [0.1]])]
    gv = looksam_direction(g, gs)
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in (g, gs, gv)]
    assert abs(float(flat[0] @ flat[2])) < 1e-12  # orthogonal to g, globally (not per tensor)
    torch.testing.assert_close(flat[1] - flat[2], (flat[0] @ flat[1]) / (flat[0] @ flat[0]) * flat[0])
    assert [t.shape for t in gv] == [t.shape for t in g]


def test_looksam_gradient_adds_the_direction_scaled_to_the_gradient_norm():
    g = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]  # |g| = 5
    gv = [torch.tensor([0.0, 2.0]), torch.tensor([0.0])]  # |g_v| = 2
    out = looksam_gradient(g, gv, alpha=0.7)
    torch.testing.assert_close(out[0], torch.tensor([3.0, 0.7 * 5 * 1.0]))
    torch.testing.assert_close(out[1], torch.tensor([4.0]))
    zero = looksam_gradient(g, [torch.zeros(2), torch.zeros(1)], alpha=0.7)  # before any refresh: g itself
    for a, b in zip(zero, g, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(("batch", "gamma", "expected"), [(128, 0.5, 64), (10, 0.3, 3), (10, 0.7, 7), (100, 0.29, 29),
                                                          (5, 0.1, 1), (8, 1.0, 8)])
def test_selection_size_is_the_floor_and_at_least_one(batch, gamma, expected):
    assert selection_size(batch, gamma) == expected


def test_selection_keeps_the_largest_loss_increases_in_order():
    before = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    after = torch.tensor([1.5, 0.2, 3.0, 1.1, 2.0, 0.9])
    assert sharpness_sensitive_selection(before, after, 0.5).tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="one loss per example"):
        sharpness_sensitive_selection(before.mean(), after.mean(), 0.5)


def test_looksam_schedule_refreshes_every_k_steps():
    schedule = SharpnessSchedule("test", looksam_k=3)
    assert [schedule.next_step() for _ in range(7)] == [SAM_STEP, REUSE_STEP, REUSE_STEP] * 2 + [SAM_STEP]
    assert schedule.looksam and schedule.active and schedule.steps == 7


def test_rst_schedule_takes_the_ascent_with_probability_p():
    # 4000 Bernoulli(0.3) trials: the count is within 5 standard deviations (sqrt(4000 * 0.3 * 0.7) = 29)
    schedule = SharpnessSchedule("test", rst_p=0.3, rst_seed=1)
    kinds = [schedule.next_step() for _ in range(4000)]
    assert set(kinds) == {SAM_STEP, BASE_STEP}
    assert abs(kinds.count(SAM_STEP) - 1200) < 5 * math.sqrt(4000 * 0.3 * 0.7)
    assert all(SharpnessSchedule("t", rst_p=0.0, rst_seed=0).next_step() == BASE_STEP for _ in range(5))


def test_the_default_schedule_is_sam_every_step_and_draws_no_seed():
    state = torch.get_rng_state()
    schedule = SharpnessSchedule("test")
    assert not schedule.active and [schedule.next_step() for _ in range(3)] == [SAM_STEP] * 3
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(5)
    a = SharpnessSchedule("test", rst_p=0.5)
    torch.manual_seed(5)
    b = SharpnessSchedule("test", rst_p=0.5)
    assert [a.next_step() for _ in range(20)] == [b.next_step() for _ in range(20)]  # seeded from torch


def test_state_round_trip_through_a_checkpoint_continues_the_choices():
    schedule = SharpnessSchedule("test", rst_p=0.5, rst_seed=3)
    for _ in range(5):
        schedule.next_step()
    schedule.directions["w"] = torch.ones(2)
    saved = json.loads(json.dumps({**schedule.state_dict(), "directions": {}}))  # tuples become lists on the way
    saved["directions"] = {"w": torch.full((2,), 4.0)}
    expected = [schedule.next_step() for _ in range(10)]
    other = SharpnessSchedule("test", rst_p=0.5, rst_seed=99)
    kept = other.directions["w"] = torch.zeros(2)
    other.load_state_dict(saved)
    assert [other.next_step() for _ in range(10)] == expected and other.steps == 15
    assert other.directions["w"] is kept and torch.equal(kept, torch.full((2,), 4.0))  # updated in place
    with pytest.raises(ValueError, match="the saved schedule is RST's"):
        SharpnessSchedule("test").load_state_dict(saved)


@pytest.mark.parametrize(("options", "match"), [
    ({"looksam_k": 0}, "`looksam_k` must be an int >= 1"),
    ({"looksam_k": True}, "`looksam_k` must be an int >= 1"),
    ({"looksam_alpha": float("nan")}, "`looksam_alpha` must be a finite number >= 0"),
    ({"rst_p": -0.1}, "`rst_p` must be a number in"),
    ({"rst_p": 0.5, "rst_seed": -1}, "`rst_seed` must be an int >= 0"),
    ({"looksam_k": 2, "rst_p": 0.5}, "use one of them"),
])
def test_bad_options_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        SharpnessSchedule("owner", **options)


def test_peek_leaves_the_schedule_where_it_is():
    schedule = SharpnessSchedule("test", rst_p=0.5, rst_seed=2)
    peeked = [schedule.peek_step() for _ in range(3)]
    assert len(set(peeked)) == 1 and schedule.steps == 0
    assert schedule.next_step() == peeked[0]
