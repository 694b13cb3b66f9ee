"""pyro_flat.ops.bayesian_sam: each piece of the bSAM step against its documented formula."""

import math

import torch

from pyro_flat.ops.bayesian_sam import (
    bsam_curvature,
    bsam_noisy_params,
    bsam_perturbation,
    bsam_perturbed_means,
    bsam_posterior_std,
    bsam_update_,
)


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 2, generator=g), torch.randn(4, generator=g)]


def test_pieces_match_their_formulas():
    m, g, e = _tensors(0), _tensors(1), _tensors(2)
    s = [t.abs() + 0.1 for t in _tensors(3)]
    n = 50.0
    pairs = [
        (bsam_noisy_params(m, s, n, e), [mi + ei / (n * si).sqrt() for mi, si, ei in zip(m, s, e, strict=True)]),
        (bsam_perturbation(g, s, 0.3), [0.3 * gi / si for gi, si in zip(g, s, strict=True)]),
        (bsam_perturbed_means(m, g, s, 0.3), [mi + 0.3 * gi / si for mi, gi, si in zip(m, g, s, strict=True)]),
        (bsam_curvature(g, s), [(si * gi**2).sqrt() for gi, si in zip(g, s, strict=True)]),
    ]
    for outs, refs in pairs:
        for out, ref in zip(outs, refs, strict=True):
            torch.testing.assert_close(out, ref)
    for out, si in zip(bsam_posterior_std(s, n), s, strict=True):
        torch.testing.assert_close(out, 1 / (n * si).sqrt())


def test_update_matches_the_documented_step():
    m, gm, geps, gs = _tensors(0), _tensors(1), _tensors(2), [t.abs() for t in _tensors(3)]
    s = [t.abs() + 0.5 for t in _tensors(4)]
    lr, b1, b2, delta, damping = 0.2, 0.9, 0.999, 0.01, 0.1
    ref_gm = [b1 * a + (1 - b1) * (g + delta * mi) for a, g, mi in zip(gm, geps, m, strict=True)]
    ref_m = [mi - lr * a / si for mi, a, si in zip(m, ref_gm, s, strict=True)]  # the old s
    ref_s = [b2 * si + (1 - b2) * (c + damping + delta) for si, c in zip(s, gs, strict=True)]
    bsam_update_(m, gm, s, geps, gs, lr=lr, beta1=b1, beta2=b2, delta=delta, damping=damping)
    for got, want in zip(m + gm + s, ref_m + ref_gm + ref_s, strict=True):
        torch.testing.assert_close(got, want)


def test_quadratic_fixed_point_formula_is_consistent():
    # at m = a the curvature term sqrt(s)|g| = h|e|/sqrt(N), whatever s is (the docstring's derivation)
    h, n = 3.0, 40.0
    s = [torch.tensor([0.2, 5.0])]
    e = [torch.tensor([1.3, 1.3])]
    theta = bsam_noisy_params([torch.zeros(2)], s, n, e)
    grads = [h * theta[0]]
    torch.testing.assert_close(bsam_curvature(grads, s)[0], torch.full((2,), h * 1.3 / math.sqrt(n)))
