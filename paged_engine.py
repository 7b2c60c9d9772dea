"""A small serving engine in nano-vllm's shape: a paged KV cache, chunked prefill, preemption.

Blog section: "Batching / beyond the post: what serving engines do". Four small classes:
- `BlockManager`: a pool of fixed-size physical KV blocks and a block table per sequence; blocks are
  allocated on demand as a sequence grows and freed when it finishes (vLLM's PagedAttention paper).
- `Scheduler`: which tokens of which sequences run in the next step. Running sequences go first, one
  decode token each; prompts are prefilled in chunks of at most `chunk_size` tokens per step, in the
  same step as the decodes (Sarathi-Serve; None: whole prompts). A waiting sequence is admitted when a
  batch slot and the blocks for its tokens are free. When a running sequence needs a block and the
  pool is empty, the most recently admitted sequence is preempted: its blocks are freed and it goes
  back to the front of the queue, to be recomputed (prompt + tokens so far) when it is readmitted.
- `ModelRunner`: runs GPTlite's own modules and weights over the packed tokens of a step; attention
  writes the new keys and values into the pool, gathers each sequence's keys and values through its
  block table, then attends (PagedAttention's idea, written as a gather in PyTorch).
- `PagedEngine`: the loop: arrivals in, schedule, run, append the new tokens, free finished sequences.

Greedy decoding is deterministic, so every request gets exactly the tokens of generating it alone,
however its prompt was chunked and however often it was preempted.
"""
from collections import deque
from dataclasses import dataclass, field

import torch

import serving
from gptlite_kvcache import scaled_dot_product_attention_kv_cache


class BlockManager:
    """Physical blocks 0..n_blocks-1 of `block_size` token slots; token t of a sequence lives in slot
    block_table[t // block_size] * block_size + t % block_size."""

    def __init__(self, n_blocks, block_size):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free_blocks = deque(range(n_blocks))
        self.block_tables = {}  # sequence id -> [physical block ids]

    def blocks_for(self, n_tokens):
        return -(-n_tokens // self.block_size)  # ceil

    @property
    def n_free(self):
        return len(self.free_blocks)

    @property
    def n_used(self):
        return self.n_blocks - len(self.free_blocks)

    def can_grow(self, seq_id, n_tokens):
        """Could the sequence hold `n_tokens` tokens with the free blocks?"""
        return self.blocks_for(n_tokens) - len(self.block_tables.get(seq_id, ())) <= self.n_free

    def grow(self, seq_id, n_tokens):
        """Allocate blocks on demand so that the sequence's table holds `n_tokens` tokens."""
        if not self.can_grow(seq_id, n_tokens):
            raise RuntimeError(f"sequence {seq_id} needs more blocks than the {self.n_free} free; check can_grow first")
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self.free_blocks.popleft() for _ in range(self.blocks_for(n_tokens) - len(table)))

    def free(self, seq_id):
        self.free_blocks.extend(self.block_tables.pop(seq_id, ()))

    def slots(self, seq_id, start, stop):
        """Physical slots of the sequence's tokens start..stop-1, a list of ints."""
        table, size = self.block_tables[seq_id], self.block_size
        return [table[t // size] * size + t % size for t in range(start, stop)]

    def utilization(self, tokens_held):
        """Tokens held / slots in allocated blocks; tokens_held: {sequence id: tokens in its blocks}."""
        reserved = self.n_used * self.block_size
        return sum(tokens_held.values()) / reserved if reserved else 1.0

    def check_invariants(self, tokens_held=None):
        """Every block is free or owned by exactly one sequence; tables hold no more blocks than needed."""
        owned = [b for table in self.block_tables.values() for b in table]
        if len(set(owned)) != len(owned):
            raise RuntimeError("a block has two owners")
        if len(set(self.free_blocks)) != len(self.free_blocks) or set(owned) & set(self.free_blocks):
            raise RuntimeError("a block is free twice, or free and owned")
        if sorted(owned + list(self.free_blocks)) != list(range(self.n_blocks)):
            raise RuntimeError("a block was lost or invented")
        for seq_id, n in (tokens_held or {}).items():
            if len(self.block_tables.get(seq_id, ())) != self.blocks_for(n):
                raise RuntimeError(f"sequence {seq_id} holds {len(self.block_tables.get(seq_id, ()))} blocks "
                                   f"for {n} tokens")


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
            if bm.blocks_for(seq.n_to_compute) > bm.n_free:  # admission by free blocks
                break
            n = min(seq.n_to_compute, budget)
            bm.grow(seq.seq_id, n)
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


class ModelRunner:
    """GPTlite's modules and weights over a paged KV pool [L, n_blocks * block_size, H, D]."""

    def __init__(self, model, n_blocks, block_size):
        self.model = model  # a GPTlite or GPTlite_KVCache: only its modules are used
        mha, weight = model.blocks[0].mha, model.fc_out.weight
        shape = (len(model.blocks), n_blocks * block_size, mha.n_heads, mha.d_head)
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

    def attention(self, layer, mha, x, step):
        H, D = mha.n_heads, mha.d_head
        q, k, v = (proj(x).view(-1, H, D) for proj in (mha.query_proj, mha.key_proj, mha.value_proj))  # [T_new, H, D]
        self.k_pool[layer, step.write_slots] = k  # store the new keys and values in their blocks
        self.v_pool[layer, step.write_slots] = v
        K = self.k_pool[layer, step.read_slots].transpose(1, 2)  # gather through the block tables: [N, H, Tk, D]
        V = self.v_pool[layer, step.read_slots].transpose(1, 2)
        N, Tq = step.mask.shape[0], step.mask.shape[2]
        Q = q.new_zeros(N, Tq, H, D)
        Q[step.query_rows, step.query_cols] = q  # unpack: [N, Tq, H, D]
        out = scaled_dot_product_attention_kv_cache(Q.transpose(1, 2), K, V, causal_mask=step.mask)  # [N, H, Tq, D]
        out = out.transpose(1, 2)[step.query_rows, step.query_cols]  # pack: [T_new, H, D]
        return mha.out_proj(out.reshape(-1, H * D))  # [T_new, d_model]

    @torch.inference_mode()
    def run(self, batch, block_manager):
        """Compute the batch's new tokens; returns the greedy next token after each sequence's chunk, [N]."""
        step, model = self.prepare(batch, block_manager), self.model
        x = model.token_embedding(step.tokens) + model.position_embedding(step.positions)  # [T_new, d_model]
        for layer, block in enumerate(model.blocks):
            x = x + self.attention(layer, block.mha, block.ln1(x), step)
            x = x + block.ffwd(block.ln2(x))
        logits = model.fc_out(model.ln(x[step.last_rows]))  # [N, vocab]
        return logits.argmax(dim=-1)


class PagedEngine:
    """The scheduler, the block manager and the model runner in one loop."""

    def __init__(self, model, n_blocks, block_size, max_seqs, chunk_size=None):
        self.model = model
        self.block_manager = BlockManager(n_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_seqs, chunk_size)
        self.runner = ModelRunner(model, n_blocks, block_size)
        self.check_invariants = False  # tests turn it on: the block manager is checked after every step

    def check_pool(self, requests):
        bm = self.block_manager
        for i, (prompt, n_tokens) in enumerate(requests):
            need = bm.blocks_for(len(prompt) + n_tokens - 1)  # the last token's keys are never stored
            if need > bm.n_blocks:
                raise ValueError(f"request {i} needs {need} blocks of {bm.block_size} tokens, more than the pool's "
                                 f"{bm.n_blocks}: give the pool at least {need} blocks")

    def generate(self, requests, seqlen, clock=None):
        """Serve every request (prompt, n_tokens); `clock`: a serving.ServingClock (None: all at time 0).

        Returns (outputs, n_steps) like the post's batching functions (outputs[i]: request i's prompt
        followed by its new tokens, 1-D), and fills `self.stats`."""
        requests = serving.check_requests(self.model, requests, self.scheduler.max_seqs, seqlen)
        self.check_pool(requests)
        if self.scheduler.waiting or self.scheduler.running:
            raise RuntimeError("the engine is still serving another call's requests")
        clock = clock or serving.ServingClock.offline(requests, self.runner.k_pool.device)
        seqs = [Sequence(i, prompt.tolist(), n) for i, (prompt, n) in enumerate(requests)]
        pending = deque(sorted(seqs, key=lambda s: clock.arrivals[s.seq_id]))
        held = reserved_paged = reserved_contiguous = 0
        preemptions_before, n_steps = self.scheduler.n_preemptions, 0
        while pending or self.scheduler.waiting or self.scheduler.running:
            while pending and clock.arrived(pending[0].seq_id):
                self.scheduler.add(pending.popleft())
            if not (self.scheduler.waiting or self.scheduler.running):
                clock.wait_for(pending[0].seq_id)
                continue
            with clock.step(rows=0):  # no row computes a token that is thrown away
                batch = self.scheduler.schedule()
                if not batch:
                    raise RuntimeError("the scheduler made no progress; this is a bug")
                # KV memory after this step: tokens held against allocated slots, and against a
                # contiguous cache that reserves seqlen slots per running sequence
                scheduled = {seq.seq_id: n for seq, n in batch}
                held += sum(s.n_computed + scheduled.get(s.seq_id, 0) for s in self.scheduler.running)
                reserved_paged += self.block_manager.n_used * self.block_manager.block_size
                reserved_contiguous += len(self.scheduler.running) * seqlen
                next_tokens = self.runner.run(batch, self.block_manager).tolist()
                got_token = self.scheduler.update(batch, next_tokens)
            if self.check_invariants:
                self.block_manager.check_invariants({s.seq_id: s.n_computed for s in self.scheduler.running})
            for seq in got_token:
                clock.token(seq.seq_id, len(seq.output))
            n_steps += 1
        self.stats = dict(kv_util=held / reserved_paged, kv_util_contiguous=held / reserved_contiguous,
                          preemptions=self.scheduler.n_preemptions - preemptions_before,
                          token_steps=held, paged_slot_steps=reserved_paged, contiguous_slot_steps=reserved_contiguous)
        outputs = [torch.tensor(seq.tokens, dtype=torch.long, device=requests[0][0].device) for seq in seqs]
        return outputs, n_steps
