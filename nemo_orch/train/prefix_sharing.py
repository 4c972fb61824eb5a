"""Prefix-shared micro-batches: the sequences of a micro-batch packed into one row as a token
tree, so a prefix they share (a group's prompt; an episode's earlier turns) is computed once in
each forward and backward pass.

Each distinct prefix of the sequences is one node of the tree (:func:`token_tree`); a node's
token attends to its ancestors and itself, at the position of its depth, so its hidden state
is the one it has in each sequence that contains it, and the gradient a shared node receives is
the sum of what each of those sequences sends it: the per-token log-probabilities and the
gradients are those of the unshared batch, up to float rounding. AReaL calls this tree
training; here it is a boolean attention mask over the packed row
(:class:`~nemo_orch.models.sdpa_attention.SDPAttention`) and rotary positions read from
``position_ids`` (:class:`~nemo_orch.models.positioned_gpt.PositionedGPTModel`).

A packed micro-batch keeps every per-token field of the unshared one (``labels``, masks,
advantages, ...; ``[b, s]``) and replaces its inputs by the row (``tokens`` and
``position_ids``, ``[1, n]``), adding ``attention_mask`` (``[1, 1, n, n]``, True where a token
may not look) and ``unpack`` (``[b, s]``: the row's index of each sequence's token), through
which the policy reads its outputs back per sequence (:func:`unpacked`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

UNPACK = "unpack"  # the key a packed micro-batch has and an ordinary one has not


@dataclass(frozen=True)
class TokenTree:
    """The distinct prefixes of some sequences as nodes in depth-first order: each node's
    ``token`` and ``depth``, and ``end``, one past the last node of its subtree (so node ``j``
    is an ancestor of node ``i``, or ``i`` itself, exactly when ``j <= i < end[j]``);
    ``nodes[k]``: the node of each token of sequence ``k``."""

    tokens: list[int]
    depths: list[int]
    ends: list[int]
    nodes: list[list[int]]

    def __len__(self) -> int:
        return len(self.tokens)


def token_tree(sequences: Sequence[Sequence[int]]) -> TokenTree:
    """The tree of ``sequences``' prefixes. Inserted in lexicographic order, the nodes come out
    depth-first: a new branch only ever opens after every earlier sibling's subtree is
    complete, as no later sequence sorts before the one that opened it."""
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = []
    children: list[dict[int, int]] = [{}]  # children[0]: the roots; node i's at i + 1
    nodes: list[list[int]] = [[] for _ in sequences]
    for index in sorted(range(len(sequences)), key=lambda k: list(sequences[k])):
        parent = -1
        for depth, token in enumerate(sequences[index]):
            node = children[parent + 1].get(token)
            if node is None:
                node = len(tokens)
                children[parent + 1][token] = node
                children.append({})
                tokens.append(token)
                depths.append(depth)
                parents.append(parent)
            nodes[index].append(node)
            parent = node
    ends = [node + 1 for node in range(len(tokens))]
    for node in reversed(range(len(tokens))):
        if parents[node] >= 0:
            ends[parents[node]] = max(ends[parents[node]], ends[node])
    return TokenTree(tokens, depths, ends, nodes)


def packed_inputs(tree: TokenTree, width: int, length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The inputs of a packed micro-batch (module docstring) for ``tree``'s sequences in their
    order, as one row of ``length`` >= ``len(tree)``: ``tokens``, ``position_ids``,
    ``attention_mask`` and ``unpack`` (each sequence's row padded to ``width`` with index 0,
    which the loss masks out). Padding after the nodes sees only itself, at position 0."""
    if length < len(tree):
        raise ValueError(f"a packed row of {length} cannot hold a tree of {len(tree)} nodes")
    pad = length - len(tree)
    index = torch.arange(length)
    ends = torch.tensor(tree.ends + [node + 1 for node in range(len(tree), length)])
    # may look: an ancestor-or-self (j <= i < end[j])
    visible = (index[None, :] <= index[:, None]) & (index[:, None] < ends[None, :])
    return {
        "tokens": torch.tensor([tree.tokens + [pad_id] * pad], dtype=torch.long),
        "position_ids": torch.tensor([tree.depths + [0] * pad], dtype=torch.long),
        "attention_mask": ~visible[None, None],
        UNPACK: torch.tensor(
            [nodes + [0] * (width - len(nodes)) for nodes in tree.nodes], dtype=torch.long
        ),
    }


def is_packed(batch: Mapping[str, torch.Tensor]) -> bool:
    return UNPACK in batch


def unpacked(values: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A packed row's values per node (``[n, ...]``) read back per sequence token
    (``[b, s, ...]``); the gradients of a shared node's readers add up through the gather."""
    return values[batch[UNPACK]]
