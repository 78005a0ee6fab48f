"""The one block hash of the project: the prefix cache, the router and the simulator all key KV blocks
by it. A block's hash chains its parent's, so equal hashes mean equal prefixes, not just equal blocks.
blake2b is stable across processes (unlike `hash()`), so the ingress and every replica agree."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

from engine.multimodal.inputs import MultiModalInput, block_extra_keys

BlockHash = int  # 128-bit

NONE_HASH: BlockHash = 0  # parent of the first block


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    h = blake2b(parent.to_bytes(16, "little"), digest_size=16)
    tokens = array("q", token_ids)
    if sys.byteorder == "big":  # the same hash on every machine of a cluster
        tokens.byteswap()
    h.update(tokens.tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "little")


def first_block_extra_keys(cache_salt: str | None = None, lora_digest: str | None = None) -> tuple | None:
    """What separates a chain from others with the same tokens: the cache salt, and the LoRA adapter
    the KV was computed with, by a digest of its weights (engine/lora/peft.py), never by its name: two
    names of one adapter share blocks, new weights under an old name never see the old KV, and the base
    model never reads an adapter's blocks."""
    keys = ()
    if cache_salt is not None:
        keys += (cache_salt,)
    if lora_digest is not None:
        keys += (("lora", lora_digest),)
    return keys or None


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent_hashes: Sequence[BlockHash] = (),
    lora_digest: str | None = None,
    mm_inputs: Sequence[MultiModalInput] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, continuing after `parent_hashes` (the hashes
    already known for its first blocks). The extra keys (cache salt, adapter digest) enter the first
    block only, which is enough to separate whole chains; an image's content hash enters every block
    that holds some of its placeholder tokens (engine/multimodal/inputs.py)."""
    hashes = list(parent_hashes)
    first_extra = first_block_extra_keys(cache_salt, lora_digest)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else NONE_HASH
        extra = first_extra if not hashes else None
        if mm_inputs:
            images = block_extra_keys(mm_inputs, start, start + block_size)
            extra = (extra or ()) + images if images else extra
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra))
    return hashes


def short_hash(block_hash: BlockHash) -> int:
    """The low 64 bits: how replicas summarise the blocks they hold for the router (compact, and still
    collision-free in practice at millions of blocks)."""
    return block_hash & 0xFFFF_FFFF_FFFF_FFFF
