"""Prefix caching: reuse the keys and values of a prompt's beginning across requests.

Blog section: "Prefix caching". Two levels:

1. The post's experiment is in main_prefix_cache.py (`prefix_caching`): the keys and values of a
   shared prefix are computed once (`_, prefix_cache = model(prefix)`) and every request starts from
   them (`generate_kvcache(model, request[None], n, seqlen, kv_cache=prefix_cache)`). The dynamic cache
   grows with torch.cat, which allocates new tensors, so a request never modifies the shared cache; a
   StaticKVCache is written in place, so `fork_static_cache` below copies it per request.

2. What serving engines do, `PrefixCache`: a store that keeps KV blocks after a request ends and
   serves later requests by exact token-ID match. We follow vLLM's design rather than SGLang's radix
   tree: a flat dict of fixed-size blocks, each full block keyed by a hash of its tokens chained with
   its parent block's hash. The key of block i therefore names the whole prefix tokens[:16 * (i+1)],
   a lookup walks from the first block and stops at the first miss, and no tree has to be kept: one
   different early token changes every later key. A radix tree shares partial blocks too, at the
   price of splitting nodes; fixed blocks are also the unit a paged KV cache allocates: the paged
   engine (paged_engine.BlockManager) keys the blocks its sequences share with the same `block_key`.

Positions are absolute in GPTlite, so a block is only valid at the place it was computed: the chain
from the first block encodes that place. The keys and values of token t are exactly those a prefill
computes only if t < seqlen and the cache had not yet dropped its oldest entry, so only those are
stored. A prompt longer than seqlen keeps its last seqlen tokens (what generate_kvcache asks for);
that window starts at another position than any cached block, so the store falls back to plain
generation for it: no lookup, no insert, counted in `stats()["fallbacks"]` and flagged in the result.
"""
from collections import OrderedDict
from dataclasses import dataclass

import torch

from gptlite import check_generation_args
from gptlite_kvcache import StaticKVCache, decode_n_tokens, generate_kvcache, prefill

# ----------------------------------------------------------------------------------------------------
# 1. The post's experiment (main_prefix_cache.prefix_caching) with a static cache: fork it per request.

def fork_static_cache(cache):
    """A copy of a StaticKVCache's filled slots in a new cache of the same size: requests write in place,
    so each one needs its own copy (copy-on-write at request granularity). The dynamic cache needs no
    copy: it grows with torch.cat, which makes new tensors."""
    n_layers, batch_size, n_heads, max_seqlen, d_head = cache.keys.shape
    fork = StaticKVCache(n_layers, batch_size, n_heads, d_head, max_seqlen, cache.keys.device, cache.keys.dtype)
    n = len(cache)
    fork.keys[:, :, :, :n] = cache.keys[:, :, :, :n]  # [L, B, H, n, D]
    fork.values[:, :, :, :n] = cache.values[:, :, :, :n]
    fork.n_tokens = cache.n_tokens
    return fork


# ----------------------------------------------------------------------------------------------------
# 2. The store: block-hashed chain, LRU eviction of unreferenced blocks, multi-turn reuse.

@dataclass(eq=False)
class Block:
    key: int            # hash of (parent key, tokens): names the whole prefix up to this block
    parent: int | None  # the parent block's key (None for the first block)
    tokens: tuple       # the block's token ids, checked on lookup so that a hash collision is a miss
    kv: list            # per layer (keys, values), each [1, H, block_size, D]
    ref_count: int = 0  # requests using the block now; only blocks at 0 can be evicted

    @property
    def nbytes(self):
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


def block_key(parent, tokens):
    """The chained hash of a block (Python's hash of a tuple of ints is deterministic)."""
    return hash((parent, tokens))


def chain_keys(tokens, block_size):
    """The keys of the full blocks of `tokens` (a list of ints), from the first block."""
    keys, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tuple(tokens[start:start + block_size]))
        keys.append(parent)
    return keys


@dataclass
class Generated:
    tokens: torch.Tensor  # [1, S + n_tokens] the prompt (its last seqlen tokens), then the new tokens
    prompt_tokens: int    # tokens of the prompt (after keeping the last seqlen)
    hit_tokens: int       # of them, taken from the store
    fallback: bool        # the prompt was longer than seqlen: no reuse


class PrefixCache:
    """KV blocks of past requests, reused by later requests that start with the same tokens.

    model: a GPTlite_KVCache; block_size: tokens per block (vLLM's default is 16);
    capacity_tokens: the most tokens held (a multiple of block_size); least recently used blocks
    that no request uses are evicted to make room. Batch 1: one request at a time."""

    def __init__(self, model, block_size=16, capacity_tokens=4096):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(capacity_tokens, int) or capacity_tokens < block_size:
            raise ValueError(f"capacity_tokens must be an integer of at least block_size={block_size}, "
                             f"got {capacity_tokens!r}")
        self.model = model
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self.blocks = OrderedDict()  # key -> Block, least recently used first
        self.counts = dict(requests=0, lookups=0, prompt_tokens=0, hit_tokens=0, evictions=0, not_stored=0,
                           fallbacks=0)

    # -- bookkeeping --------------------------------------------------------------------------------
    def __len__(self):  # blocks held
        return len(self.blocks)

    @property
    def n_tokens(self):
        return len(self.blocks) * self.block_size

    @property
    def nbytes(self):
        return sum(block.nbytes for block in self.blocks.values())

    def stats(self):
        """Counters since creation: requests, lookups (requests without fallback), prompt and hit tokens,
        hit rate (hit / prompt tokens), evictions, blocks not stored for lack of room, bytes."""
        c = self.counts
        return dict(c, hit_rate=c["hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
                    blocks=len(self.blocks), cached_tokens=self.n_tokens, cache_bytes=self.nbytes)

    def _touch(self, chain):
        """Mark a chain as just used, the first block last: a parent is always more recent than its
        children, so LRU eviction takes leaves first and never leaves an unreachable child behind."""
        for block in reversed(chain):
            self.blocks.move_to_end(block.key)

    def release(self, chain, touch=True):
        for block in chain:
            block.ref_count -= 1
        if touch:
            self._touch(chain)

    def _evict_one(self):
        for key, block in self.blocks.items():  # least recently used first
            if block.ref_count == 0:
                del self.blocks[key]
                self.counts["evictions"] += 1
                return True
        return False  # every block is in use

    # -- lookup and insert --------------------------------------------------------------------------
    def lookup(self, tokens, max_blocks=None, touch=True):
        """The cached chain of the longest prefix of `tokens` (a list of ints) in whole blocks, at most
        `max_blocks`. The blocks are referenced (kept from eviction) until `release(chain)`;
        touch=False leaves the LRU order as it is."""
        chain, parent = [], None
        n_full = len(tokens) // self.block_size
        for i in range(n_full if max_blocks is None else min(n_full, max_blocks)):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            key = block_key(parent, block_tokens)
            block = self.blocks.get(key)
            if block is None or block.parent != parent or block.tokens != block_tokens:
                break  # the first miss ends the walk: later blocks name other prefixes
            chain.append(block)
            parent = key
        for block in chain:
            block.ref_count += 1
        if touch:
            self._touch(chain)
        return chain

    def insert(self, tokens, kv_cache):
        """Store the full blocks of `tokens` (a list of ints) whose keys and values are the first
        len(tokens) entries of the dynamic `kv_cache` (batch 1). Blocks already held are reused;
        when the store is full and every block is in use, the rest of the chain is not stored.
        Returns the chain stored (referenced: release it)."""
        chain, parent = [], None
        bs = self.block_size
        for i, key in enumerate(chain_keys(tokens, bs)):
            block = self.blocks.get(key)
            if block is None:
                if len(self.blocks) >= self.capacity_blocks and not self._evict_one():
                    self.counts["not_stored"] += len(tokens) // bs - i
                    break
                kv = [(k[:, :, i * bs:(i + 1) * bs].clone(), v[:, :, i * bs:(i + 1) * bs].clone())
                      for k, v in kv_cache]  # [1, H, bs, D] per layer, own memory
                block = self.blocks[key] = Block(key, parent, tuple(tokens[i * bs:(i + 1) * bs]), kv)
            block.ref_count += 1  # held while the rest of the chain is inserted
            chain.append(block)
            parent = key
        return chain

    @staticmethod
    def assemble(chain):
        """A dynamic cache from a chain of blocks: per layer (keys, values) [1, H, n*bs, D] (new tensors)."""
        if not chain:
            return None
        n_layers = len(chain[0].kv)
        return [(torch.cat([b.kv[layer][0] for b in chain], dim=2), torch.cat([b.kv[layer][1] for b in chain], dim=2))
                for layer in range(n_layers)]

    # -- generation ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt, n_tokens, seqlen=None, update=True):
        """Greedy generation of `n_tokens` after `prompt` (1-D or [1, S] token ids), the same tokens as
        generate_kvcache(model, prompt[None, -seqlen:], n_tokens, seqlen), reusing cached blocks.

        The longest cached prefix in whole blocks is reused (at least one prompt token is prefilled,
        for its logits); the rest is prefilled on top, then the prompt and the generated tokens are
        stored, so that the next turn of a conversation prefills only its new message.
        update=False leaves the store exactly as it was (no insert, no statistics, no LRU change):
        a request timed against a fixed state of the store. Returns a `Generated`."""
        seqlen = self.model.seqlen if seqlen is None else seqlen
        if not isinstance(seqlen, int) or not 1 <= seqlen <= self.model.seqlen:
            raise ValueError(f"seqlen must be an integer between 1 and the model's seqlen={self.model.seqlen}, "
                             f"got {seqlen!r}")
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            prompt = prompt[None]
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[0] != 1:
            raise ValueError(f"PrefixCache serves one request at a time: give one prompt, got a batch of "
                             f"{prompt.shape[0]}")
        fallback = isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[1] > seqlen
        if fallback:
            prompt = prompt[:, -seqlen:]  # the window generate_kvcache asks for; it starts elsewhere
        check_generation_args(self.model, prompt, n_tokens, seqlen)
        tokens = prompt[0].tolist()
        if update:
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += len(tokens)
            self.counts["fallbacks"] += fallback
            self.counts["lookups"] += not fallback
        if fallback:
            return Generated(generate_kvcache(self.model, prompt, n_tokens, seqlen), len(tokens), 0, True)

        chain = self.lookup(tokens, max_blocks=(len(tokens) - 1) // self.block_size, touch=update)
        n_hit = len(chain) * self.block_size
        first, prompt_cache = prefill(self.model, prompt[:, n_hit:], self.assemble(chain), seqlen)
        new, cache = decode_n_tokens(self.model, first, prompt_cache, n_tokens - 1, seqlen)
        out = torch.cat([prompt, first] + new, dim=1)  # [1, S + n_tokens], as generate_kvcache returns
        if update:
            self.counts["hit_tokens"] += n_hit
            # the cache holds the prompt and every new token but the last; exact while nothing was dropped
            seen = out[0, :-1].tolist()
            stored = self.insert(seen, cache) if len(seen) <= seqlen else self.insert(tokens, prompt_cache)
            self.release(stored)
        self.release(chain, touch=update)
        return Generated(out, len(tokens), n_hit, False)
