"""A small serving engine in nano-vllm's shape: a paged KV cache, chunked prefill, preemption.

Blog section: "PagedAttention: memory management for the KV cache". Four small classes:
- `BlockManager`: a pool of fixed-size physical KV blocks and a block table per sequence; blocks are
  allocated on demand as a sequence grows and freed when it finishes (vLLM's PagedAttention paper).
  Prefix sharing (on by default; vLLM's automatic prefix caching): every full block whose keys and
  values are computed is cached under the parent-chained hash of prefix_cache.py, and a sequence
  admitted later with the same first tokens shares those blocks, read-only and reference-counted,
  instead of computing them again. Cached blocks outlive their sequences and are evicted least
  recently used when the pool needs room. Only full blocks are shared and a sequence writes only
  after its computed tokens, so the one write into a shared block would be the recompute of the
  last token of a sequence whose tokens are all cached (its logits are needed): that block is
  copied first (copy-on-write).
- `Scheduler`: which tokens of which sequences run in the next step. Running sequences go first, one
  decode token each; prompts are prefilled in chunks of at most `chunk_size` tokens per step, in the
  same step as the decodes (Sarathi-Serve; None: whole prompts). A waiting sequence is admitted when a
  batch slot and the blocks for its tokens are free. When a running sequence needs a block and the
  pool is empty, the most recently admitted sequence is preempted: its blocks are freed and it goes
  back to the front of the queue, to be recomputed (prompt + tokens so far) when it is readmitted;
  with prefix sharing, its full blocks still cached are shared again instead.
- `ModelRunner`: runs the model's own cached forward pass over the packed tokens of a step, with the
  step as its cache (`PagedStep`, gptlite_kvcache's interface): each layer writes the new keys and
  values into the pool, gathers each sequence's keys and values through its block table, then attends
  (PagedAttention's idea, written as a gather in PyTorch).
- `PagedEngine`: the loop: arrivals in, schedule, run, append the new tokens, free finished sequences.
  Its statistics (`EngineStats`) and the tests' invariant checks are observers of the steps, not code
  in the loop.

Greedy decoding is deterministic, so every request gets exactly the tokens of generating it alone,
however its prompt was chunked, however often it was preempted, and whichever blocks it shared.
"""
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import torch

from gptlite_kvcache import KVCache, kv_cache_view
from lib import serving
from lib.prefix_cache import block_key, chain_keys


class BlockManager:
    """Physical blocks 0..n_blocks-1 of `block_size` token slots; token t of a sequence lives in slot
    block_table[t // block_size] * block_size + t % block_size.

    With `prefix_sharing` (vLLM's automatic prefix caching), every full block whose keys and values are
    computed is cached under the parent-chained hash of prefix_cache.py (`block_key`: it names the
    whole prefix up to the block). A sequence admitted later shares the blocks of its longest cached
    prefix: one physical block, a reference count, read-only. A block whose count falls to zero stays
    cached ("evictable") and is reused for a new block, least recently used first, only when no free
    block is left. n_free counts both: the blocks a sequence can be given."""

    def __init__(self, n_blocks, block_size, prefix_sharing=True):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_blocks, self.block_size, self.prefix_sharing = n_blocks, block_size, prefix_sharing
        self.free_blocks = deque(range(n_blocks))  # empty blocks: nothing cached in them
        self.block_tables = {}  # sequence id -> [physical block ids]
        self.ref_counts = [0] * n_blocks  # sequences whose table holds the block
        self.cached = {}  # chained hash -> block id
        self.block_hash = {}  # block id -> (its hash, its parent's hash, its tokens): checked on a match
        self.evictable = OrderedDict()  # cached blocks no sequence holds, least recently used first
        self.chains = {}  # sequence id -> hashes of its computed full blocks, from the first
        self.copies = []  # (source, destination) blocks to copy before the next step writes (copy-on-write)
        self.n_evictions = self.n_copies = 0

    def blocks_for(self, n_tokens):
        return -(-n_tokens // self.block_size)  # ceil

    @property
    def n_free(self):
        return len(self.free_blocks) + len(self.evictable)

    @property
    def n_used(self):  # blocks held by sequences (a shared block counts once)
        return self.n_blocks - self.n_free

    def can_grow(self, seq_id, n_tokens):
        """Could the sequence hold `n_tokens` tokens with the free blocks?"""
        return self.blocks_for(n_tokens) - len(self.block_tables.get(seq_id, ())) <= self.n_free

    def _allocate(self):
        """An empty block if there is one, else the least recently used evictable one, uncached."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._uncache(block)
            self.n_evictions += 1
        self.ref_counts[block] = 1
        return block

    def _uncache(self, block):
        del self.cached[self.block_hash.pop(block)[0]]

    def _release(self, block):
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0 and block in self.block_hash:
            self.evictable[block] = None  # kept for a later match, as the most recently used
        elif self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def grow(self, seq_id, n_tokens):
        """Allocate blocks on demand so that the sequence's table holds `n_tokens` tokens."""
        if not self.can_grow(seq_id, n_tokens):
            raise RuntimeError(f"sequence {seq_id} needs more blocks than the {self.n_free} free; check can_grow first")
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self._allocate() for _ in range(self.blocks_for(n_tokens) - len(table)))

    def free(self, seq_id):
        for block in reversed(self.block_tables.pop(seq_id, ())):  # the first block is released last: a
            self._release(block)  # prefix outlives its continuations in the LRU order
        self.chains.pop(seq_id, None)

    # -- prefix sharing ------------------------------------------------------------------------------
    def match(self, tokens):
        """The cached blocks of the longest prefix of `tokens` (a list of ints) in full blocks."""
        blocks, parent, bs = [], None, self.block_size
        for i, key in enumerate(chain_keys(tokens, bs) if self.prefix_sharing else ()):
            block = self.cached.get(key)
            if block is None or self.block_hash[block] != (key, parent, tuple(tokens[i * bs:(i + 1) * bs])):
                break  # the first miss ends the walk (a hash collision is a miss)
            blocks.append(block)
            parent = key
        return blocks

    def admit(self, seq_id, tokens):
        """Start the table of a sequence (new, or readmitted after preemption) whose tokens so far are
        `tokens`: it shares the blocks of its longest cached prefix. Returns how many of its tokens
        have their keys and values in its blocks already (at most all but the last, which is computed
        for its logits), or None, doing nothing, when the free blocks cannot hold all its tokens."""
        hit = self.match(tokens)
        n_cached = min(len(hit) * self.block_size, len(tokens) - 1)
        rewrite = n_cached < len(hit) * self.block_size  # its last token is in a shared block
        copy = rewrite and self.ref_counts[hit[-1]] > 0  # ... held by another sequence: a copy needs a block
        taken = sum(self.ref_counts[b] == 0 for b in hit)  # evictable blocks the hit takes out of the free ones
        if self.blocks_for(len(tokens)) - len(hit) + copy > self.n_free - taken:
            return None
        for block in hit:
            self.ref_counts[block] += 1
            self.evictable.pop(block, None)
        self.block_tables[seq_id] = list(hit)
        self.chains[seq_id] = [self.block_hash[b][0] for b in hit]
        if rewrite:
            self.copy_on_write(seq_id, n_cached)
        return n_cached

    def copy_on_write(self, seq_id, position):
        """Make the block that holds `position` the sequence's own before it writes there: a block
        another sequence holds is copied (the copy is made by the runner before the next step
        writes anything); a cached block only this sequence holds is uncached (cached again once full)."""
        index, table = position // self.block_size, self.block_tables[seq_id]
        block = table[index]
        if self.ref_counts[block] > 1:
            table[index] = self._allocate()
            self.copies.append((block, table[index]))
            self._release(block)
            self.n_copies += 1
        elif block in self.block_hash:
            self._uncache(block)
        del self.chains[seq_id][index:]  # the block's hash is recorded again once it is computed

    def cache(self, seq_id, tokens, n_computed):
        """Cache the sequence's full blocks among its first `n_computed` tokens (keys and values
        computed) that are not cached yet. A block whose hash another block holds stays private."""
        if not self.prefix_sharing:
            return
        chain, table, bs = self.chains.setdefault(seq_id, []), self.block_tables[seq_id], self.block_size
        for i in range(len(chain), n_computed // bs):
            parent, block_tokens = chain[-1] if chain else None, tuple(tokens[i * bs:(i + 1) * bs])
            chain.append(block_key(parent, block_tokens))
            if chain[-1] not in self.cached:
                self.cached[chain[-1]] = table[i]
                self.block_hash[table[i]] = (chain[-1], parent, block_tokens)

    # -- slots and checks ------------------------------------------------------------------------------
    def slots(self, seq_id, start, stop):
        """Physical slots of the sequence's tokens start..stop-1, a list of ints."""
        table, size = self.block_tables[seq_id], self.block_size
        return [table[t // size] * size + t % size for t in range(start, stop)]

    def utilization(self, tokens_held):
        """Tokens held / slots in allocated blocks; tokens_held: {sequence id: tokens in its blocks}."""
        reserved = self.n_used * self.block_size
        return sum(tokens_held.values()) / reserved if reserved else 1.0

    def check_invariants(self, tokens_held=None):
        """Every block is free, evictable (cached, held by no sequence) or held; its reference count is
        the number of tables that hold it; a block in two tables is a cached one (shared read-only);
        tables hold no more blocks than needed."""
        held = Counter(b for table in self.block_tables.values() for b in table)
        if any(n > 1 and b not in self.block_hash for b, n in held.items()):
            raise RuntimeError("a block has two owners and is not a cached block")
        if any(self.ref_counts[b] != held.get(b, 0) for b in range(self.n_blocks)):
            raise RuntimeError("a reference count differs from the number of tables that hold the block")
        free, evictable = list(self.free_blocks), list(self.evictable)
        if len(set(free)) != len(free) or (set(free) | set(evictable)) & set(held) or set(free) & set(evictable):
            raise RuntimeError("a block is free twice, or free and owned")
        if sorted(list(held) + free + evictable) != list(range(self.n_blocks)):
            raise RuntimeError("a block was lost or invented")
        if any(b not in self.block_hash for b in evictable) or any(b in self.block_hash for b in free):
            raise RuntimeError("an evictable block is not cached, or an empty one is")
        if len(self.cached) != len(self.block_hash) or any(self.cached.get(key) != b
                                                           for b, (key, _, _) in self.block_hash.items()):
            raise RuntimeError("the hash table and the blocks' hashes disagree")
        for seq_id, n in (tokens_held or {}).items():
            if len(self.block_tables.get(seq_id, ())) != self.blocks_for(n):
                raise RuntimeError(f"sequence {seq_id} holds {len(self.block_tables.get(seq_id, ()))} blocks "
                                   f"for {n} tokens")

    def check_writable(self, seq_id, start, stop):
        """The blocks the sequence writes tokens start..stop-1 into are its own and not cached."""
        for index in range(start // self.block_size, self.blocks_for(stop)):
            block = self.block_tables[seq_id][index]
            if self.ref_counts[block] != 1 or block in self.block_hash:
                raise RuntimeError(f"sequence {seq_id} would write into block {block}, shared or cached")


@dataclass(eq=False)  # sequences compare by identity
class Sequence:
    seq_id: int
    prompt: list
    max_tokens: int
    output: list = field(default_factory=list)
    n_computed: int = 0  # tokens whose keys and values are in the pool

    @property
    def tokens(self):
        return self.prompt + self.output

    @property
    def n_to_compute(self):  # the last token's keys and values are computed with the next step
        return len(self.prompt) + len(self.output) - self.n_computed

    @property
    def done(self):
        return len(self.output) == self.max_tokens


class Scheduler:
    """Continuous batching with chunked prefill and preemption by recompute (see the module docstring)."""

    def __init__(self, block_manager, max_seqs, chunk_size=None):
        if max_seqs < 1 or (chunk_size is not None and chunk_size < 1):
            raise ValueError(f"max_seqs must be >= 1 and chunk_size None or >= 1, got {max_seqs}, {chunk_size}")
        self.block_manager, self.max_seqs, self.chunk_size = block_manager, max_seqs, chunk_size
        self.waiting, self.running = deque(), []  # running: oldest admitted first
        self.n_preemptions = 0
        self.n_admitted_tokens = self.n_cached_tokens = 0  # tokens of admitted sequences; of them, cached

    def add(self, seq):
        self.waiting.append(seq)

    def preempt(self, seq):
        """Free the sequence's blocks; it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.n_computed = 0
        self.waiting.appendleft(seq)
        self.n_preemptions += 1

    def schedule(self):
        """The next step's work: a list of (sequence, number of its next tokens to compute)."""
        bm, budget = self.block_manager, self.chunk_size or float("inf")  # prefill tokens this step
        batch = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted for an older sequence in this loop
                continue
            n = seq.n_to_compute
            prefill = n > 1  # a prompt (or a recompute) being prefilled: a chunk within the budget
            if prefill:
                n = min(n, budget)
                if n == 0:
                    continue
            while not bm.can_grow(seq.seq_id, seq.n_computed + n):  # no free block: preempt the newest
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                bm.grow(seq.seq_id, seq.n_computed + n)
                batch.append((seq, n))
                budget -= n if prefill else 0
        while self.waiting and len(self.running) < self.max_seqs and budget > 0:
            seq = self.waiting[0]
            n_cached = bm.admit(seq.seq_id, seq.tokens)  # shares its cached prefix's blocks
            if n_cached is None:  # admission by free blocks: all its tokens must fit
                break
            seq.n_computed = n_cached
            self.n_cached_tokens += n_cached
            self.n_admitted_tokens += len(seq.tokens)
            n = min(seq.n_to_compute, budget)
            bm.grow(seq.seq_id, seq.n_computed + n)
            self.running.append(self.waiting.popleft())
            batch.append((seq, n))
            budget -= n
        return batch

    def update(self, batch, next_tokens):
        """Account for a step that computed `batch`; a chunk that reaches the end of a sequence's tokens
        yields its next token. Returns the sequences that got a token."""
        got_token = []
        for (seq, n), token in zip(batch, next_tokens):
            seq.n_computed += n
            self.block_manager.cache(seq.seq_id, seq.tokens, seq.n_computed)  # its newly full blocks
            if seq.n_computed == len(seq.tokens):
                seq.output.append(token)
                got_token.append(seq)
                if seq.done:
                    self.running.remove(seq)
                    self.block_manager.free(seq.seq_id)
        return got_token


@dataclass
class StepInput:
    """The tensors of one step: N sequences, their new tokens packed into T_new rows."""
    tokens: torch.Tensor     # [T_new] token ids
    positions: torch.Tensor  # [T_new] absolute positions
    write_slots: torch.Tensor  # [T_new] pool slot of each new token's keys and values
    read_slots: torch.Tensor   # [N, Tk] pool slots of each sequence's keys 0..Tk-1 (padded with slot 0)
    query_rows: torch.Tensor   # [T_new] sequence index of each new token
    query_cols: torch.Tensor   # [T_new] its index among that sequence's new tokens
    mask: torch.Tensor       # [N, 1, Tq, Tk] True = attend
    last_rows: torch.Tensor  # [N] the packed row of each sequence's last new token


class PagedStep(KVCache):
    """One step as a cache of gptlite_kvcache's interface: the model's forward pass runs over the step's
    packed new tokens [1, T_new]; each layer writes their keys and values into the runner's pool and
    reads each sequence's keys and values through its block table. No window: the engine checks that
    every request fits seqlen before it starts."""

    def __init__(self, runner, step):
        self.runner, self.step = runner, step

    def __len__(self):  # the packed tokens are not one sequence: nothing for the model to split
        return 0

    def positions(self, T, device):
        return self.step.positions  # [T_new], each token's position in its own sequence

    def update(self, layer, k, v):
        """k, v [1, H, T_new, D] -> the sequences' keys and values [N, H, Tk, D] and the mask [N, 1, Tq, Tk]."""
        step, k_pool, v_pool = self.step, self.runner.k_pool[layer], self.runner.v_pool[layer]  # [slots, H, D]
        k_pool[step.write_slots] = k[0].transpose(0, 1)  # store the new keys and values in their blocks
        v_pool[step.write_slots] = v[0].transpose(0, 1)
        K = k_pool[step.read_slots].transpose(1, 2)  # gather through the block tables: [N, H, Tk, D]
        V = v_pool[step.read_slots].transpose(1, 2)
        return K, V, step.mask

    def attend(self, layer, attention, q, K, V, mask):
        """Unpack the queries [1, H, T_new, D] per sequence, [N, H, Tq, D], attend, pack the outputs back."""
        step, q = self.step, q[0].transpose(0, 1)  # [T_new, H, D]
        N, Tq = mask.shape[0], mask.shape[2]
        Q = q.new_zeros(N, Tq, *q.shape[1:])
        Q[step.query_rows, step.query_cols] = q  # unpack: [N, Tq, H, D]
        out = attention(Q.transpose(1, 2), K, V, mask)  # [N, H, Tq, D]
        return out.transpose(1, 2)[step.query_rows, step.query_cols].transpose(0, 1)[None]  # [1, H, T_new, D]


class ModelRunner:
    """The model's own cached forward pass over a paged KV pool [L, n_blocks * block_size, H, D]."""

    def __init__(self, model, n_blocks, block_size):
        self.model = kv_cache_view(model)  # a GPTlite (its modules and weights, shared) or a GPTlite_KVCache
        config, weight = model.config, model.fc_out.weight
        shape = (config.n_layers, n_blocks * block_size, config.n_heads, config.d_head)
        self.k_pool = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
        self.v_pool = torch.zeros(shape, device=weight.device, dtype=weight.dtype)

    @property
    def nbytes(self):
        return self.k_pool.nbytes + self.v_pool.nbytes

    def prepare(self, batch, block_manager):
        tokens, positions, write_slots, read_slots, rows, cols, limits = [], [], [], [], [], [], []
        for row, (seq, n) in enumerate(batch):
            start = seq.n_computed
            tokens += seq.tokens[start:start + n]
            positions += range(start, start + n)
            read = block_manager.slots(seq.seq_id, 0, start + n)
            write_slots += read[start:]
            read_slots.append(read)
            rows += [row] * n
            cols += range(n)
            limits.append([start + i for i in range(n)])  # query i sees keys 0 .. start+i
        Tq, Tk = max(n for _, n in batch), max(len(r) for r in read_slots)
        limits = [lim + [lim[-1]] * (Tq - len(lim)) for lim in limits]  # padded queries: harmless copies
        read_slots = [r + [0] * (Tk - len(r)) for r in read_slots]
        device = self.k_pool.device
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        limits = as_tensor(limits)  # [N, Tq]
        mask = torch.arange(Tk, device=device) <= limits[..., None]  # [N, Tq, Tk]
        last_rows = as_tensor([n for _, n in batch]).cumsum(0) - 1
        return StepInput(as_tensor(tokens), as_tensor(positions), as_tensor(write_slots), as_tensor(read_slots),
                         as_tensor(rows), as_tensor(cols), mask[:, None], last_rows)

    def copy_blocks(self, block_manager):
        """Copy-on-write: the blocks the scheduler copied since the last step, copied before anything writes."""
        if block_manager.copies:
            bs, device = block_manager.block_size, self.k_pool.device
            slots = lambda blocks: (torch.tensor(blocks, device=device)[:, None] * bs  # noqa: E731
                                    + torch.arange(bs, device=device)).flatten()
            src, dst = (slots(blocks) for blocks in zip(*block_manager.copies))  # [n_copies * bs] each
            self.k_pool[:, dst] = self.k_pool[:, src]  # [L, n * bs, H, D]
            self.v_pool[:, dst] = self.v_pool[:, src]
            block_manager.copies.clear()

    @torch.inference_mode()
    def run(self, batch, block_manager):
        """Compute the batch's new tokens; returns the greedy next token after each sequence's chunk, [N]."""
        self.copy_blocks(block_manager)
        step = self.prepare(batch, block_manager)
        logits, _ = self.model(step.tokens[None], kv_cache=PagedStep(self, step))  # [1, T_new, vocab]
        return logits[0, step.last_rows].argmax(dim=-1)


class EngineStats:
    """An observer of PagedEngine's steps that collects its statistics over one generate call: KV memory
    held against the slots of allocated blocks and against a contiguous cache that reserves seqlen slots
    per running sequence, tokens computed, blocks used, and the scheduler's and block manager's counters."""

    def __init__(self, engine, seqlen):
        self.scheduler, self.block_manager, self.seqlen = engine.scheduler, engine.block_manager, seqlen
        self.before = self.counters()
        self.held = self.reserved_paged = self.reserved_contiguous = self.computed = 0
        self.blocks_used = self.blocks_peak = self.n_steps = 0

    def counters(self):
        sched, bm = self.scheduler, self.block_manager
        return sched.n_preemptions, sched.n_admitted_tokens, sched.n_cached_tokens, bm.n_evictions, bm.n_copies

    def scheduled(self, batch):
        """The step's work is chosen, not run: the KV memory after this step."""
        bm, running = self.block_manager, self.scheduler.running
        scheduled = {seq.seq_id: n for seq, n in batch}
        self.held += sum(s.n_computed + scheduled.get(s.seq_id, 0) for s in running)
        self.reserved_paged += bm.n_used * bm.block_size
        self.reserved_contiguous += len(running) * self.seqlen
        self.computed += sum(scheduled.values())
        self.blocks_used, self.blocks_peak = self.blocks_used + bm.n_used, max(self.blocks_peak, bm.n_used)
        self.n_steps += 1

    def stepped(self):
        pass

    def summary(self):
        preemptions, admitted, cached, evictions, copies = (now - then for now, then in zip(self.counters(),
                                                                                            self.before))
        # kv_util counts a shared block's tokens once per sequence that holds it: above 1 with sharing
        return dict(kv_util=self.held / self.reserved_paged, kv_util_contiguous=self.held / self.reserved_contiguous,
                    preemptions=preemptions, token_steps=self.held, paged_slot_steps=self.reserved_paged,
                    contiguous_slot_steps=self.reserved_contiguous, computed_tokens=self.computed,
                    blocks_used=self.blocks_used / self.n_steps, blocks_peak=self.blocks_peak,
                    hit_rate=cached / admitted, cached_tokens=cached, evictions=evictions, cow_copies=copies)


class InvariantChecks:
    """An observer for tests (PagedEngine.check_invariants = True): a step writes only into blocks that
    are its sequences' own, and the block manager's invariants hold after every step."""

    def __init__(self, engine):
        self.scheduler, self.block_manager = engine.scheduler, engine.block_manager

    def scheduled(self, batch):
        for seq, n in batch:
            self.block_manager.check_writable(seq.seq_id, seq.n_computed, seq.n_computed + n)

    def stepped(self):
        self.block_manager.check_invariants({s.seq_id: s.n_computed for s in self.scheduler.running})


def admit_arrivals(pending, scheduler, clock):
    """Move the requests whose arrival has passed from `pending` (in arrival order) to the scheduler; with
    nothing to serve, wait for the next arrival instead. True when a step has work to do."""
    while pending and clock.arrived(pending[0].seq_id):
        scheduler.add(pending.popleft())
    if scheduler.waiting or scheduler.running:
        return True
    clock.wait_for(pending[0].seq_id)
    return False


class PagedEngine:
    """The scheduler, the block manager and the model runner in one loop. stats=True (the default: the
    scripts report them) fills `self.stats` after each generate call through an EngineStats observer;
    stats=False runs without it (`self.stats` is None)."""

    def __init__(self, model, n_blocks, block_size, max_seqs, chunk_size=None, prefix_sharing=True, stats=True):
        self.model = model
        self.block_manager = BlockManager(n_blocks, block_size, prefix_sharing)
        self.scheduler = Scheduler(self.block_manager, max_seqs, chunk_size)
        self.runner = ModelRunner(model, n_blocks, block_size)
        self.collect_stats, self.stats = stats, None
        self.check_invariants = False  # tests turn it on: the block manager is checked after every step

    def check_pool(self, requests):
        bm = self.block_manager
        for i, (prompt, n_tokens) in enumerate(requests):
            need = bm.blocks_for(len(prompt) + n_tokens - 1)  # the last token's keys are never stored
            if need > bm.n_blocks:
                raise ValueError(f"request {i} needs {need} blocks of {bm.block_size} tokens, more than the pool's "
                                 f"{bm.n_blocks}: give the pool at least {need} blocks")

    def observers(self, seqlen):
        return ([EngineStats(self, seqlen)] if self.collect_stats else []) + \
            ([InvariantChecks(self)] if self.check_invariants else [])

    def generate(self, requests, seqlen, clock=None):
        """Serve every request (prompt, n_tokens); `clock`: a serving.ServingClock (None: all at time 0).

        Returns (outputs, n_steps) like the post's batching functions (outputs[i]: request i's prompt
        followed by its new tokens, 1-D), and fills `self.stats` (with stats=True)."""
        requests = serving.check_requests(self.model, requests, self.scheduler.max_seqs, seqlen)
        self.check_pool(requests)
        if self.scheduler.waiting or self.scheduler.running:
            raise RuntimeError("the engine is still serving another call's requests")
        clock = clock or serving.ServingClock.offline(requests, self.runner.k_pool.device)
        seqs = [Sequence(i, prompt.tolist(), n) for i, (prompt, n) in enumerate(requests)]
        pending = deque(sorted(seqs, key=lambda s: clock.arrivals[s.seq_id]))
        observers, scheduler, n_steps = self.observers(seqlen), self.scheduler, 0
        while pending or scheduler.waiting or scheduler.running:
            if not admit_arrivals(pending, scheduler, clock):
                continue
            with clock.step(rows=0):  # no row computes a token that is thrown away
                got_token = self.step(observers)
            for observer in observers:
                observer.stepped()
            for seq in got_token:
                clock.token(seq.seq_id, len(seq.output))
            n_steps += 1
        self.stats = observers[0].summary() if self.collect_stats else None
        outputs = [torch.tensor(seq.tokens, dtype=torch.long, device=requests[0][0].device) for seq in seqs]
        return outputs, n_steps

    def step(self, observers=()):
        """Schedule, run and account for one step; returns the sequences that got a token."""
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("the scheduler made no progress; this is a bug")
        for observer in observers:
            observer.scheduled(batch)
        next_tokens = self.runner.run(batch, self.block_manager).tolist()
        return self.scheduler.update(batch, next_tokens)
