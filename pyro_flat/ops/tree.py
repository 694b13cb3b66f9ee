"""Utilities on collections of tensors (lists or ``dict[str, Tensor]``) treated as one vector."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

TensorTree = Sequence[Tensor] | Mapping[str, Tensor]


def _leaves(tree: TensorTree) -> list[Tensor]:
    if isinstance(tree, Mapping):
        return list(tree.values())
    return list(tree)


def global_norm(tree: TensorTree) -> Tensor:
    r"""The L2 norm of all tensors of ``tree`` concatenated: :math:`\|g\|_2=\sqrt{\sum_i\|g_i\|_2^2}`.

    Stays on the tensors' device (no host sync).
    """
    leaves = _leaves(tree)
    if not leaves:
        raise ValueError("global_norm: expected at least one tensor, got an empty collection")
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in leaves]))


def tree_dot(a: TensorTree, b: TensorTree) -> Tensor:
    """The inner product :math:`\\sum_i \\langle a_i, b_i\\rangle` of two trees of equal structure."""
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        raise ValueError(f"tree_dot: trees have {len(la)} and {len(lb)} tensors")
    return sum((x * y).sum() for x, y in zip(la, lb, strict=True))


def flatten(tree: TensorTree) -> Tensor:
    """Concatenate the flattened tensors of ``tree`` into one vector (in iteration order)."""
    return torch.cat([t.reshape(-1) for t in _leaves(tree)])


def unflatten_like(vector: Tensor, tree: TensorTree) -> list[Tensor]:
    """Split ``vector`` into tensors shaped like the leaves of ``tree`` (inverse of :func:`flatten`)."""
    leaves = _leaves(tree)
    total = sum(t.numel() for t in leaves)
    if vector.numel() != total:
        raise ValueError(f"unflatten_like: vector has {vector.numel()} elements, tree has {total}")
    out, start = [], 0
    for t in leaves:
        out.append(vector[start : start + t.numel()].view_as(t))
        start += t.numel()
    return out
