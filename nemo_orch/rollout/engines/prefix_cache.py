"""Automatic prefix caching for the CPU engine (:mod:`.hf`), after vLLM's.

A multi-turn episode sends its whole conversation again on every turn, and a GRPO group's
samples share their prompt: without reuse the engine computes the same keys and values over and
over. Here they are kept in blocks of ``block_size`` tokens, each keyed by its parent block and
its own tokens, so a block stands for the whole prefix that ends with it. A block's key is the
pair itself (``(parent id, tokens)``, compared in full by the dict), not a hash of it: a hit is
exact, with no collision to guard against.

Keys are cached after RoPE, and a token's position is its index in its sequence, so a block is
valid for any later prompt that starts with the same tokens -- under the same weights: the
engine clears the cache on every refit.

Blocks are evicted least recently used first. Every lookup and insert touches its chain from the
leaf up to the root, so an ancestor is always more recent than its descendants: the oldest block
is a leaf, and eviction never strands a block behind a missing parent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ROOT = -1  # the parent id of a prompt's first block
BlockKey = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class _Block:
    id: int
    key: BlockKey
    keys: torch.Tensor  # [layers, kv_heads, block_size, head_dim]
    values: torch.Tensor


@dataclass(frozen=True)
class CachedPrefix:
    """What :meth:`PrefixCache.lookup` found: the first ``length`` tokens' blocks."""

    blocks: tuple[_Block, ...]
    block_size: int

    @property
    def length(self) -> int:
        return len(self.blocks) * self.block_size

    def keys_values(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens' keys and values, ``[layers, kv_heads, length,
        head_dim]`` each (a fresh tensor: the cached blocks stay as they are)."""
        if not 0 < length <= self.length:
            raise ValueError(f"{length} tokens asked of a cached prefix of {self.length}")
        used = self.blocks[: -(-length // self.block_size)]
        keys = torch.cat([block.keys for block in used], dim=2)[:, :, :length]
        values = torch.cat([block.values for block in used], dim=2)[:, :, :length]
        return keys, values


NO_PREFIX = CachedPrefix((), block_size=1)  # a prompt that reads nothing from a cache


@dataclass
class PrefixStats:
    """Counters of an engine's prefills since it was built (refits clear the cache, not these).
    ``reused_tokens`` of the ``prompt_tokens`` came from the cache (``hits`` of the ``prompts``
    reused some); ``computed_tokens`` went through the model: the rest of the prompts, a few
    cached tokens recomputed to line up a batch, and ``shared_prefixes`` computed once for the
    prompts of one call that share them (a GRPO group)."""

    prompts: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    shared_prefixes: int = 0

    @property
    def reuse_rate(self) -> float:
        """The share of prompt tokens whose keys and values came from the cache."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    """Keys and values of token prefixes, in blocks of ``block_size`` tokens, at most
    ``capacity_tokens`` tokens' worth (whole blocks), least recently used evicted first."""

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        if block_size < 1 or capacity_tokens < block_size:
            raise ValueError(
                f"a prefix cache needs block_size >= 1 and room for one block, got "
                f"block_size={block_size}, capacity_tokens={capacity_tokens}"
            )
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self.evicted_blocks = 0
        self._blocks: OrderedDict[BlockKey, _Block] = OrderedDict()
        self._next_id = 0

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def lookup(self, tokens: Sequence[int]) -> CachedPrefix:
        """The longest run of whole blocks of ``tokens``, from the first, that is cached."""
        found: list[_Block] = []
        parent = ROOT
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            block = self._blocks.get((parent, tuple(tokens[start : start + self.block_size])))
            if block is None:
                break
            found.append(block)
            parent = block.id
        self._touch(found)
        return CachedPrefix(tuple(found), self.block_size)

    def insert(
        self, tokens: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
    ) -> int:
        """Store the whole blocks of ``tokens`` not cached yet; ``keys[layer]`` and
        ``values[layer]`` are ``[kv_heads, len(tokens), head_dim]`` (views are fine: only new
        blocks are copied). Returns how many blocks were added."""
        if any(k.shape[1] != len(tokens) for k in (*keys, *values)):
            raise ValueError(f"keys and values must cover the {len(tokens)} tokens")
        chain: list[_Block] = []
        parent, added = ROOT, 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            end = start + self.block_size
            key = (parent, tuple(tokens[start:end]))
            block = self._blocks.get(key)
            if block is None:
                block = _Block(
                    self._next_id,
                    key,
                    torch.stack([k[:, start:end] for k in keys]),
                    torch.stack([v[:, start:end] for v in values]),
                )
                self._next_id += 1
                self._blocks[key] = block
                added += 1
            chain.append(block)
            parent = block.id
        self._touch(chain)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)  # a leaf (see the module docstring)
            self.evicted_blocks += 1
        return added

    def clear(self) -> None:
        """Forget every block (the weights that computed them changed)."""
        self._blocks.clear()

    def _touch(self, chain: Sequence[_Block]) -> None:
        for block in reversed(chain):  # the leaf first: ancestors end up the most recent
            self._blocks.move_to_end(block.key)


def shared_prefixes(prompts: Sequence[Sequence[int]], block_size: int) -> list[list[int]]:
    """The longest whole-block prefixes that two or more of ``prompts`` share, the maximal ones
    only (none begins another): computed once, they cover every prompt's shared part."""
    children: dict[BlockKey, int] = {}  # a trie of blocks: (parent node, tokens) -> node
    count: list[int] = []
    paths: list[list[int]] = []  # each prompt's nodes
    for prompt in prompts:
        parent, path = ROOT, []
        for start in range(0, len(prompt) - block_size + 1, block_size):
            key = (parent, tuple(prompt[start : start + block_size]))
            if key not in children:
                children[key] = len(count)
                count.append(0)
            parent = children[key]
            count[parent] += 1
            path.append(parent)
        paths.append(path)
    deepest: dict[int, list[int]] = {}  # the deepest shared node of a prompt -> its prefix
    above: set[int] = set()  # nodes with a deeper shared one below them
    for prompt, path in zip(prompts, paths):
        depth = sum(count[node] > 1 for node in path)  # counts only fall along a path
        if depth:
            deepest[path[depth - 1]] = list(prompt[: depth * block_size])
            above.update(path[: depth - 1])
    return [prefix for node, prefix in deepest.items() if node not in above]
