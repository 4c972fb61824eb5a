"""The CPU engine's prefix cache on hand-built keys and values: exact block matches, lookups of
whole blocks, inserts that copy only new blocks, LRU eviction of leaves, and the prefixes a call's
prompts share."""

import pytest
import torch

from nemo_orch.rollout.engines.prefix_cache import PrefixCache, shared_prefixes

LAYERS, HEADS, DIM = 2, 3, 5


def kv(tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values ``[heads, len(tokens), dim]`` that encode each token and its
    position, so a wrong block or offset shows."""
    position = torch.arange(len(tokens), dtype=torch.float32)[None, :, None]
    token = torch.tensor(tokens, dtype=torch.float32)[None, :, None]
    keys = [
        token * 1000 + position + layer * 0.5 + torch.zeros(HEADS, 1, DIM)
        for layer in range(LAYERS)
    ]
    return keys, [-k for k in keys]


def test_a_lookup_finds_the_longest_cached_run_of_whole_blocks():
    cache = PrefixCache(block_size=4, capacity_tokens=64)
    tokens = list(range(10, 20))
    assert cache.insert(tokens, *kv(tokens)) == 2  # the last 2 tokens fill no block
    assert cache.cached_tokens == 8
    found = cache.lookup(tokens + [99])
    assert found.length == 8
    keys, values = found.keys_values(6)
    expected_keys, expected_values = kv(tokens)
    assert torch.equal(keys, torch.stack([k[:, :6] for k in expected_keys]))
    assert torch.equal(values, torch.stack([v[:, :6] for v in expected_values]))
    assert cache.lookup(tokens[:7]).length == 4  # block 2 is not whole in the query
    assert cache.lookup([10, 11, 12, 13, 14, 15, 16, 0]).length == 4  # block 2 differs
    assert cache.lookup([0, 11, 12, 13, 14, 15, 16, 17]).length == 0
    with pytest.raises(ValueError, match="6 tokens"):
        cache.lookup(tokens[:5]).keys_values(6)


def test_a_block_stands_for_its_whole_prefix():
    cache = PrefixCache(block_size=2, capacity_tokens=64)
    cache.insert([1, 2, 3, 4], *kv([1, 2, 3, 4]))
    # The same second block after another first one is another prefix: no hit past block 1.
    assert cache.lookup([9, 9, 3, 4]).length == 0
    assert cache.lookup([1, 2, 3, 4]).length == 4


def test_an_insert_copies_only_new_blocks():
    cache = PrefixCache(block_size=2, capacity_tokens=64)
    first = [1, 2, 3, 4]
    cache.insert(first, *kv(first))
    stored = cache.lookup(first).blocks
    assert cache.insert(first, *kv(first)) == 0
    longer = first + [5, 6, 7]
    keys, values = kv(longer)
    assert cache.insert(longer, [k * 0 for k in keys], values) == 1  # only [5, 6] is new
    again = cache.lookup(longer).blocks
    assert again[:2] == stored  # the cached blocks stay as they were
    assert torch.equal(again[2].keys, torch.zeros(LAYERS, HEADS, 2, DIM))
    # Views of a larger tensor are copied, not kept (the batch cache they come from is freed).
    assert again[2].values.untyped_storage().nbytes() == again[2].values.nbytes
    with pytest.raises(ValueError, match="cover the 3 tokens"):
        cache.insert([1, 2, 3], *kv([1, 2]))


def test_eviction_keeps_the_bound_and_drops_leaves_first():
    cache = PrefixCache(block_size=2, capacity_tokens=7)  # 3 whole blocks
    a, b, c = [1, 1, 2, 2], [3, 3, 4, 4], [5, 5]
    cache.insert(a, *kv(a))
    cache.insert(b, *kv(b))
    assert cache.cached_tokens == 6 and cache.evicted_blocks == 1
    assert cache.lookup(a).length == 2  # a's leaf went; its root stayed
    assert cache.lookup(b).length == 4
    cache.lookup(a)  # a's root is now the most recent
    cache.insert(c, *kv(c))
    assert cache.evicted_blocks == 2 and cache.cached_tokens == 6
    assert cache.lookup(b).length == 2  # b's leaf went, the least recently used block
    assert cache.lookup(a).length == 2 and cache.lookup(c).length == 2
    # No block outlives its parent: every cached block is reachable from the root.
    ids = {block.id for block in cache._blocks.values()}
    assert all(parent == -1 or parent in ids for parent, _ in cache._blocks)


def test_clear_forgets_everything():
    cache = PrefixCache(block_size=2, capacity_tokens=8)
    cache.insert([1, 2, 3], *kv([1, 2, 3]))
    cache.clear()
    assert cache.cached_tokens == 0 and cache.lookup([1, 2, 3]).length == 0
    with pytest.raises(ValueError, match="room for one block"):
        PrefixCache(block_size=4, capacity_tokens=3)


def test_shared_prefixes_are_the_maximal_ones_shared_by_two_or_more():
    group = [1, 2, 3, 4, 5, 6]
    prompts = [
        group + [7],
        group + [8, 9],
        [1, 2, 3, 4, 0, 0, 1],  # shares only the first two blocks with the group
        [9, 9, 9],  # shares nothing
        [1, 2, 3, 4, 0, 0, 2],
    ]
    assert shared_prefixes(prompts, block_size=2) == [group, [1, 2, 3, 4, 0, 0]]
    # A prefix shared by all is covered by the longer one two of them share.
    assert shared_prefixes([group, group, group[:4] + [7, 7]], block_size=2) == [group]
    assert shared_prefixes([group], block_size=2) == []
