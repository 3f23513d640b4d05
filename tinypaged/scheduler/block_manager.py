"""BlockManager: the paged KV cache's allocator, with a hash-chained prefix cache.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence's `block_table` lists its
blocks in position order; block i holds the K/V rows of positions [i*bs, (i+1)*bs).

Prefix caching. A *full* block is named by a hash chained over its parent's hash and its own
tokens:

    h_0 = sha256(ROOT || tokens[0:bs]),   h_i = sha256(h_{i-1} || tokens[i*bs:(i+1)*bs])

so equal hashes mean equal whole prefixes, not just equal blocks (sha256 keeps crafted prompts
from colliding with someone else's prefix). Once a block is full and its tokens computed, its hash
is registered in `cached` (prompt blocks and decode-filled blocks alike). A new sequence takes every
registered block of its longest cached prefix (refcount + 1) and computes only the rest, but always
at least its last token, whose logits give the next token.

Block states (each block is in exactly one):
    in use     ref_count > 0, listed in the block tables of ref_count live sequences
    free       ref_count 0, no hash: `free_block_ids`
    evictable  ref_count 0, hash registered: `evictable`, oldest first (LRU). It is still a prefix-
               cache hit; it is evicted (hash dropped) only when a fresh block is needed and no
               free block is left.
`num_free_blocks` counts free + evictable: both can be handed out now.

A sequence's blocks are released tail first, so within one sequence the deepest blocks are
evicted before the prefix blocks they hang off (which are the ones other prompts share).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from tinypaged.scheduler.sequence import Sequence

_ROOT_HASH = b"tinypaged-prefix-root"


def hash_block(parent_hash: bytes | None, token_ids: SequenceABC[int]) -> bytes:
    """Chained hash of one full block: stable across processes and Python versions."""
    h = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks  # set only while registered
        self.cached: dict[bytes, int] = {}  # registered hash -> block id
        self.free_block_ids = list(
            range(num_blocks - 1, -1, -1)
        )  # a stack: pop() hands out 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # LRU first

    # ---- accounting ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached ones."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of the cache held by live sequences (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        """Make seq.block_hashes cover its first num_full_blocks blocks (incremental)."""
        bs = self.block_size
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else None
        if parent is None and seq.lora_int_id:  # an adapter's blocks: a chain of their own
            parent = hash_block(None, [-seq.lora_int_id])
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest registered prefix of a sequence that holds no blocks yet.

        Stops one token short of the end: the last token must be computed to get logits. Changes
        no refcounts; pass the result to `allocate`.
        """
        if not self.enable_prefix_caching or seq.block_table or seq.skip_prefix_cache:
            return []
        num_full = (len(seq.token_ids) - 1) // self.block_size
        self._extend_hashes(seq, num_full)
        hits = []
        for h in seq.block_hashes[:num_full]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def mark_computed(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register in the prefix cache the blocks filled by seq's first `num_computed` tokens
        (default seq.num_computed_tokens): call once the step that computed them has run (a
        later step may already be scheduled); O(new full blocks).
        """
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        num_full = num_computed // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            h = seq.block_hashes[i]
            block_id = seq.block_table[i]
            # A block already registered (a prefix hit) keeps its hash. When another sequence
            # computed the same content into its own block meanwhile (both admitted before either
            # finished), the first one stays the cached copy and this block stays private.
            if self.block_hash[block_id] is None and h not in self.cached:
                self.cached[h] = block_id
                self.block_hash[block_id] = h
        seq.num_registered_blocks = num_full

    # ---- allocation ----------------------------------------------------------------------
    def num_allocatable_tokens(self, seq: Sequence, cached_blocks: SequenceABC[int] = ()) -> int:
        """How many new tokens seq could get slots for now (after taking cached_blocks)."""
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        num_held = len(seq.block_table) + len(cached_blocks)
        slack = num_held * self.block_size - num_computed  # empty slots in the last held block
        # Taking an evictable hit removes it from the pool the new blocks come from.
        available = self.num_free_blocks - sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return slack + available * self.block_size

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceABC[int] = ()
    ) -> bool:
        return num_new_tokens <= self.num_allocatable_tokens(seq, cached_blocks)

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceABC[int] = ()
    ) -> bool:
        """Grow seq.block_table to cover num_computed_tokens + num_new_tokens positions.

        `cached_blocks` (from `find_cached_prefix`, first allocation only) become the head of the
        block table and count as computed: seq.num_computed_tokens is set to their token count.
        Returns False, changing nothing, when the cache cannot hold the new tokens.
        """
        if cached_blocks and (seq.block_table or seq.num_computed_tokens):
            raise ValueError(
                f"cached_blocks given for seq {seq.seq_id} that already holds "
                f"{len(seq.block_table)} blocks; prefix hits apply to the first allocation only"
            )
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            return False
        for block_id in cached_blocks:
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
        if cached_blocks:
            seq.block_table.extend(cached_blocks)
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
            seq.num_registered_blocks = len(cached_blocks)
        num_needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        for _ in range(num_needed - len(seq.block_table)):
            seq.block_table.append(self._take_fresh_block())
        return True

    def _take_fresh_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.pop()
        else:  # evict the least recently used cached block
            block_id, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash[block_id]]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks; its KV is gone, so num_computed_tokens drops to 0."""
        for block_id in reversed(seq.block_table):  # tail first: evicted before its prefix
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget seq's last `num_tokens` computed tokens (speculative drafts the target
        rejected): num_computed_tokens drops, so their slots are written again by the next step.
        The blocks stay with the sequence (as in vLLM) as room for its next drafts; they were
        never registered, since registration follows the accepted count, and they are freed
        with the sequence. (Keeping them also keeps every block-table row append-only, which
        the runner's HostBlockTables relies on.)"""
        if num_tokens > 0:
            seq.num_computed_tokens -= num_tokens

    # ---- testing aid ---------------------------------------------------------------------
    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless the allocator state is consistent with live_seqs (all the
        sequences that hold blocks)."""

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        holders: Counter[int] = Counter()
        for seq in live_seqs:
            check(
                len(set(seq.block_table)) == len(seq.block_table),
                f"seq {seq.seq_id} lists a block twice: {seq.block_table}",
            )
            check(
                len(seq.block_table) * self.block_size >= seq.num_computed_tokens,
                f"seq {seq.seq_id}: {seq.num_computed_tokens} computed tokens exceed its "
                f"{len(seq.block_table)} blocks",
            )
            holders.update(seq.block_table)
        free = set(self.free_block_ids)
        check(len(free) == len(self.free_block_ids), "a block is in the free list twice")
        for b in range(self.num_blocks):
            ref = self.ref_counts[b]
            check(ref == holders[b], f"block {b}: ref_count {ref} but {holders[b]} holders")
            if ref > 0:
                check(b not in free and b not in self.evictable, f"block {b} in use and free")
            else:
                check((b in free) != (b in self.evictable), f"block {b} lost or listed twice")
            h = self.block_hash[b]
            if b in free:
                check(h is None, f"free block {b} still carries a hash")
            if b in self.evictable:
                check(h is not None, f"evictable block {b} has no hash")
            if h is not None:
                check(self.cached.get(h) == b, f"block {b}'s hash maps elsewhere")
        check(
            len(self.cached) == sum(h is not None for h in self.block_hash),
            "cached map and block hashes disagree",
        )
