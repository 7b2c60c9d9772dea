"""Speculative decoding (Leviathan et al. 2023, Chen et al. 2023): a cheap draft proposes gamma tokens,
the target scores all gamma + 1 positions in one forward pass on top of its cache, and a rule that keeps
the target's distribution decides how many to keep.

    tokens, stats = speculative_generate(target, drafter, prompt, n_tokens, gamma, temperature=0.8)

The round, for the pending token x (sampled from the target, not yet fed to it):
    draft, q = drafter.propose(...)             # d_1 .. d_g and the draft's distributions q_1 .. q_g
    logits = target([x, d_1 .. d_g])            # one pass, g + 1 positions: p_1 .. p_{g+1}
    k, correction = accept_draft(logits, draft, q, ...)
        d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection a token is drawn
        from norm(max(0, p_i - q_i)); when all g are kept a bonus token comes from p_{g+1}
    target cache and drafter rolled back to the kept tokens (StaticKVCache.truncate: by position)

Greedy (temperature None) keeps d_i while it is the target's argmax, so the tokens are exactly the target's
greedy tokens. A batch keeps the same number of tokens in every row, the fewest any row accepted, plus one
token per row (its correction, or its next accepted draft token): every token is still drawn from the
target's distribution given the tokens before it, and the caches keep one length; rows then wait for the
slowest, so a batch accepts less per call than one sequence.

Drafts (each an object with start / propose / commit / mark / reset_to): ModelDrafter (any GPTlite: a
distilled student, a smaller one, the target's first layers), LookupDrafter (n-gram match in the text so
far, no model), MedusaDrafter and FeatureDrafter (heads on the target's hidden states, lib/draft_heads.py:
Medusa, EAGLE, multi-token prediction).
"""
import copy
import dataclasses
import math

import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite import check_generation_args, decode_loop
from gptlite_kvcache import StaticKVCache, kv_cache_view
from lib.draft_heads import head_logits
from lib.training import logits_of

# ----------------------------------------------------------------------------------------------------
# Sampling and the acceptance rule.

def target_probs(logits, temperature):
    """softmax(logits / T) in float32 (float64 would not change a comparison of this size)."""
    return F.softmax(logits.float() / temperature, dim=-1)


def draw(logits, temperature=None, generator=None):
    """One token per row of logits [B, V] and the distribution it was drawn from: the argmax and None
    (temperature None), or a sample of softmax(logits / temperature) and that distribution."""
    if temperature is None:
        return logits.argmax(dim=-1), None
    probs = target_probs(logits, temperature)
    return torch.multinomial(probs, 1, generator=generator)[:, 0], probs


def accept_draft(logits, draft, q, temperature=None, generator=None):
    """The rule of speculative sampling, each row on its own.

    logits: [B, g+1, V] the target's at the pending token and the g draft tokens; draft: [B, g];
    q: [B, g, V] the distributions the draft tokens were sampled from (None: a deterministic draft, q
    one-hot at its token). temperature None: greedy (keep d_i while it is the target's argmax).
    Returns k [B], the draft tokens each row keeps (its first rejection, or g), and correction [B], the
    token at position k: drawn from norm(max(0, p_k - q_k)) after a rejection, from p_{g+1} (the bonus)
    when all g were kept."""
    B, g = draft.shape
    rows = torch.arange(B, device=draft.device)
    if temperature is None:
        best = logits.argmax(dim=-1)  # [B, g+1]
        kept = draft == best[:, :g]  # [B, g]
        k = kept.long().cumprod(dim=1).sum(dim=1)  # [B] leading accepts
        return k, best[rows, k]
    p = target_probs(logits, temperature)  # [B, g+1, V]
    if q is None:
        q = F.one_hot(draft, p.shape[-1]).to(p.dtype)  # [B, g, V]
    p_d = p[:, :g].gather(-1, draft[..., None])[..., 0]  # [B, g]
    q_d = q.gather(-1, draft[..., None])[..., 0]
    u = torch.rand(B, g, generator=generator, device=draft.device)
    kept = u * q_d < p_d  # u < p/q without dividing (q_d > 0: the draft drew d from q)
    k = kept.long().cumprod(dim=1).sum(dim=1)  # [B]
    residual = torch.cat([(p[:, :g] - q).clamp(min=0), p[:, g:]], dim=1)  # [B, g+1, V]: the last is p itself
    dist = residual[rows, k]  # [B, V]
    total = dist.sum(dim=-1, keepdim=True)
    dist = torch.where(total > 0, dist / total.clamp(min=1e-30), p[rows, k])  # p = q: no rejection can occur
    return k, torch.multinomial(dist, 1, generator=generator)[:, 0]


def accept_always(logits, draft, q, temperature=None, generator=None):
    """A deliberately wrong rule, for the statistical test's control: keep every draft token, then the
    bonus. Its tokens follow the draft's distribution, not the target's; the test must catch it."""
    B, g = draft.shape
    k = torch.full((B,), g, dtype=torch.long, device=draft.device)
    return k, draw(logits[:, g], temperature, generator)[0]


# ----------------------------------------------------------------------------------------------------
# The generation loop.

@dataclasses.dataclass
class SpecStats:
    """Counts of one generation, summed over rows: what the table's alpha and tau come from."""
    rounds: int = 0     # verification passes of the target (after the prefill)
    emitted: int = 0    # tokens per row produced by those passes
    accepted: int = 0   # draft tokens the rule kept, over rows (before a batch cuts to its fewest)
    judged: int = 0     # draft tokens the rule looked at: the kept ones and each row's first rejection

    @property
    def alpha(self):
        """Acceptance rate: the chance that the rule keeps a draft token it looks at."""
        return self.accepted / self.judged if self.judged else None

    @property
    def tau(self):
        """Mean tokens per target call (accepted draft tokens + the correction or bonus)."""
        return self.emitted / self.rounds if self.rounds else None


def check_speculation_args(target, prompt, n_tokens, gamma, temperature=None):
    """Clear errors before any decoding: the prompt and n_tokens (gptlite's check_generation_args), gamma
    (None: plain decoding), the window, the temperature."""
    check_generation_args(target, prompt, n_tokens, target.seqlen)
    P, seqlen = prompt.shape[1], target.seqlen
    if gamma is not None and (not isinstance(gamma, int) or gamma < 1):
        raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got {gamma!r}")
    if gamma is not None and P + gamma + 1 > seqlen:
        raise ValueError(f"gamma={gamma}: a prompt of {P} tokens and the gamma + 1 tokens of a verification pass "
                         f"exceed the window seqlen={seqlen}; use gamma <= {seqlen - P - 1}")
    if P + n_tokens - 1 > seqlen:
        raise ValueError(f"a prompt of {P} tokens and {n_tokens} new tokens exceed the window seqlen={seqlen}: "
                         "speculation rolls its cache back, so it stays within one window; generate fewer tokens")
    if temperature is not None and not (isinstance(temperature, (int, float)) and 0 < temperature < math.inf):
        raise ValueError(f"temperature must be a finite number > 0 for sampling (None: greedy), got {temperature!r}")


def prefill_target(target, prompt, temperature=None, generator=None):
    """The target's prefill on a new static cache: (cache, the prompt's hidden states [B, P, d], the first
    new token [B]). target: a model with a cached forward pass (kv_cache_view)."""
    cache = StaticKVCache.for_model(target, prompt.shape[0])
    hidden = target.hidden_states(prompt, cache)  # [B, P, d]
    return cache, hidden, draw(head_logits(target, hidden[:, -1]), temperature, generator)[0]


@torch.inference_mode()
def speculative_generate(target, drafter, prompt, n_tokens, gamma, temperature=None, generator=None,
                         accept=accept_draft):
    """Generate n_tokens after prompt [B, P] with the target, gamma draft tokens per round from `drafter`.
    temperature None: greedy; else sampling at that temperature with `generator`.
    Returns the prompt followed by the new tokens [B, P + n_tokens] and the SpecStats."""
    check_speculation_args(target, prompt, n_tokens, gamma, temperature)
    target = kv_cache_view(target)
    B, P = prompt.shape
    seq = torch.empty(B, P + n_tokens, dtype=torch.long, device=prompt.device)
    seq[:, :P] = prompt
    cache, hidden, seq[:, P] = prefill_target(target, prompt, temperature, generator)
    drafter.start(prompt, hidden)
    n, kept = P + 1, []  # seq[:, :n] is final; seq[:, n-1] is pending (not yet in the target's cache)
    while n < P + n_tokens:
        g = min(gamma, P + n_tokens - n - 1)  # never more tokens than are left
        draft, q = drafter.propose(seq, n, g, temperature, generator)  # [B, g], [B, g, V] or None
        seq[:, n:n + g] = draft  # provisional: what is rejected is overwritten later
        hidden = target.hidden_states(seq[:, n - 1:n + g], cache)  # [B, g+1, d]: one pass over g + 1 tokens
        k, correction = accept(head_logits(target, hidden), draft, q, temperature, generator)
        m = int(k.min())  # every row keeps m draft tokens, then one more of its own
        seq[:, n + m] = correction if m == g else torch.where(k > m, draft[:, m], correction)
        cache.truncate(n + m)  # the pending token and the m kept drafts; the rest is rolled back
        drafter.commit(n, m, hidden[:, :m + 1])
        kept.append((k, g, m))
        n += m + 1
    stats = SpecStats(rounds=len(kept), emitted=sum(m + 1 for _, _, m in kept))
    if kept:  # counted after the loop, in two reductions: no device sync per round
        ks = torch.stack([k for k, _, _ in kept]).cpu()  # [rounds, B]
        gs = torch.tensor([g for _, g, _ in kept])[:, None]
        stats.accepted, stats.judged = int(ks.sum()), int(torch.minimum(ks + 1, gs).sum())
    return seq, stats


@torch.inference_mode()
def plain_generate(target, prompt, n_tokens, temperature=None, generator=None):
    """The baseline: plain cached decoding of the target, one token per forward pass, on the same static
    cache and sampler as speculative_generate. Returns [B, P + n_tokens]."""
    check_speculation_args(target, prompt, n_tokens, None, temperature)
    target = kv_cache_view(target)
    cache, _, token = prefill_target(target, prompt, temperature, generator)
    new = decode_loop(lambda t: target.forward_cache(t, cache)[:, -1], token[:, None], n_tokens - 1,
                      sample=lambda logits: draw(logits, temperature, generator)[0][:, None])
    return torch.cat([prompt, token[:, None], new], dim=1)


def expected_tau(alpha, gamma):
    """Tokens per target call when each draft token is kept independently with probability alpha:
    (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan et al., eq. 1)."""
    if alpha is None:
        return None
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha, gamma, draft_cost):
    """Leviathan et al.'s wall-time improvement (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), with
    draft_cost = gamma c, the draft's time per round over one target decoding step (a verification pass is
    taken to cost one step)."""
    tau = expected_tau(alpha, gamma)
    return None if tau is None or draft_cost is None else tau / (1 + draft_cost)


# ----------------------------------------------------------------------------------------------------
# Drafts. Each: start(prompt, hidden) after the target's prefill; propose(seq, n, g, temperature,
# generator) -> (draft [B, g], q [B, g, V] or None); commit(n, m, hidden) after a round kept m drafts
# (hidden: the target's states of the pending token and the m kept, [B, m+1, d]); mark() / reset_to(mark)
# to time a proposal and undo it.

def stack_draft(tokens, dists, B, device):
    draft = torch.stack(tokens, dim=1) if tokens else torch.empty(B, 0, dtype=torch.long, device=device)
    return draft, (torch.stack(dists, dim=1) if dists and dists[0] is not None else None)


class ModelDrafter:
    """A small GPTlite drafts autoregressively on its own static cache, rolled back by position."""

    def __init__(self, model):
        self.model = kv_cache_view(model)

    def start(self, prompt, hidden):
        self.cache = StaticKVCache.for_model(self.model, prompt.shape[0])

    def propose(self, seq, n, g, temperature, generator):
        dists = []

        def sample(logits):  # [B, V] -> [B, 1], its distribution kept for the acceptance rule
            token, q = draw(logits, temperature, generator)
            dists.append(q)
            return token[:, None]
        new = seq[:, self.cache.n_tokens:n]  # what it has not seen, the pending token last
        draft = decode_loop(lambda t: self.model.forward_cache(t, self.cache)[:, -1], new, g, sample)  # [B, g]
        # the last draft token was never fed: it is fed next round if kept
        return stack_draft(list(draft.unbind(1)), dists, seq.shape[0], seq.device)

    def commit(self, n, m, hidden):
        self.cache.truncate(min(self.cache.n_tokens, n + m))

    def mark(self):
        return self.cache.n_tokens

    def reset_to(self, mark):
        self.cache.truncate(mark)


def early_exit_model(target, n_layers):
    """Self-speculation (LayerSkip's draft): the target's first n_layers blocks, then its own final
    LayerNorm and head. Shares the target's modules (nothing copied), with a cache of its own."""
    target = kv_cache_view(target)
    if not 1 <= n_layers < len(target.blocks):
        raise ValueError(f"early exit needs 1 <= layers < the target's {len(target.blocks)}, got {n_layers}")
    view = copy.copy(target)
    view.__dict__["_modules"] = dict(target._modules, blocks=torch.nn.Sequential(*target.blocks[:n_layers]))
    view.config = dataclasses.replace(target.config, n_layers=n_layers)
    return view


class LookupDrafter:
    """Prompt lookup decoding: find the last `ngram` tokens earlier in the text so far (the longest
    n-gram size first, down to 1) and propose what followed them; no match: repeat the last token. The
    proposals are deterministic (q one-hot)."""

    def __init__(self, ngram=3):
        if not isinstance(ngram, int) or ngram < 1:
            raise ValueError(f"the n-gram size must be an integer >= 1, got {ngram!r}")
        self.ngram = ngram

    def start(self, prompt, hidden):
        pass

    def propose(self, seq, n, g, temperature, generator):
        rows = [self.lookup(row[:n].tolist(), g) for row in seq]
        return torch.tensor(rows, dtype=torch.long, device=seq.device).reshape(len(rows), g), None

    def lookup(self, tokens, g):
        if g == 0:
            return []
        text = "".join(map(chr, tokens))  # one character per token id: str.rfind does the search
        for size in range(min(self.ngram, len(text) - 1), 0, -1):
            start = text.rfind(text[-size:], 0, len(text) - 1)  # the most recent match with a token after it
            if start >= 0:
                follow = tokens[start + size:start + size + g]
                return follow + [follow[-1]] * (g - len(follow))
        return [tokens[-1]] * g

    def commit(self, n, m, hidden):
        pass

    def mark(self):
        return None

    def reset_to(self, mark):
        pass


class MedusaDrafter:
    """Medusa: K heads on the target's hidden state at the last kept position, head k predicting the k-th
    token after the pending one; all g drafts come from one call, independent of each other."""

    def __init__(self, heads, target):
        self.heads, self.target = heads, kv_cache_view(target)

    def start(self, prompt, hidden):
        self.last = hidden[:, -1]  # [B, d]: the state that produced the pending token

    def propose(self, seq, n, g, temperature, generator):
        if g > len(self.heads.heads):
            raise ValueError(f"gamma={g} needs {g} Medusa heads; these are {len(self.heads.heads)}")
        tokens, dists = [], []
        if g:
            logits = self.heads(self.last, self.target, g)  # [B, g, V]
            for i in range(g):
                token, q = draw(logits[:, i], temperature, generator)
                tokens.append(token)
                dists.append(q)
        return stack_draft(tokens, dists, seq.shape[0], seq.device)

    def commit(self, n, m, hidden):
        self.last = hidden[:, -1]

    def mark(self):
        return self.last

    def reset_to(self, mark):
        self.last = mark


class FeatureDrafter:
    """EAGLE and multi-token prediction: a head of one block over [embedding of token t+1, hidden state
    at t] predicts the state at t+1, and the target's head reads the next token from it. Drafting
    continues on its own predicted states; after each round its cache is rolled back to the positions
    built from the target's true states, and the newly kept ones are fed."""

    def __init__(self, head, target):
        self.head, self.target = head, kv_cache_view(target)

    def start(self, prompt, hidden):
        B, P = prompt.shape
        d = hidden.shape[-1]
        self.states = torch.empty(B, self.target.seqlen, d, dtype=hidden.dtype, device=hidden.device)
        self.states[:, :P] = hidden  # the target's states of the final tokens
        self.cache = self.head.new_cache(B, self.target.seqlen)

    def propose(self, seq, n, g, temperature, generator):
        dists, fed = [], self.cache.n_tokens  # positions 0 .. n-2 can be built from true states
        states = self.states[:, fed:n - 1]  # the states under the tokens fed first: the target's, true

        def step(tokens):  # the head's state of the next position, read by the target's head: [B, V]
            nonlocal states
            states = self.head.step(tokens, states, self.target, self.cache)[:, -1:]  # then its own prediction
            return head_logits(self.target, states[:, -1])

        def sample(logits):
            token, q = draw(logits, temperature, generator)
            dists.append(q)
            return token[:, None]
        draft = decode_loop(step, seq[:, fed + 1:n], g, sample)  # [B, g]
        if g:
            self.cache.truncate(n - 1)  # forget the positions built from predicted states
        return stack_draft(list(draft.unbind(1)), dists, seq.shape[0], seq.device)

    def commit(self, n, m, hidden):
        self.states[:, n - 1:n + m] = hidden  # the pending token's and the kept drafts' true states

    def mark(self):
        return self.cache.n_tokens

    def reset_to(self, mark):
        self.cache.truncate(mark)


# ----------------------------------------------------------------------------------------------------
# The statistical test of sampling: the next k tokens after a prompt, counted over many samples, against
# the target's exact probabilities (the full forward pass over every continuation).

@torch.inference_mode()
def exact_continuations(target, prompt, k, temperature):
    """The target's probability of each of the V^k continuations of prompt [P] at `temperature`,
    continuation (t_1 .. t_k) at index sum t_i V^(k-i). Returns [V^k] float64."""
    V = target.config.vocab_size
    seqs = prompt[None]  # [1, P]
    probs = torch.ones(1, dtype=torch.float64, device=prompt.device)
    for _ in range(k):
        logits = logits_of(target(seqs))  # [N, P + i, V]: the full forward pass of every continuation
        step = target_probs(logits[:, -1], temperature).double()  # [N, V]
        probs = (probs[:, None] * step).reshape(-1)  # [N * V]
        seqs = torch.cat([seqs.repeat_interleave(V, dim=0),
                          torch.arange(V, device=prompt.device).repeat(len(seqs))[:, None]], dim=1)
    return probs


def continuation_index(tokens, vocab_size):
    """tokens [N, k] -> [N] index sum t_i V^(k-i), as exact_continuations orders them."""
    index = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    for i in range(tokens.shape[1]):
        index = index * vocab_size + tokens[:, i]
    return index


def chi_square_test(counts, probs, min_expected=5.0):
    """Pearson's goodness of fit of `counts` [C] to `probs` [C]: the cells expected below `min_expected`
    pooled into one. Returns dict(statistic, dof, p_value, tv) (tv: total variation distance between the
    empirical and exact distributions); p_value None when fewer than two cells remain (too few samples
    for these probabilities: the test cannot judge)."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    statistic = float(((obs - exp) ** 2 / exp.clamp(min=1e-300)).sum())
    dof = len(exp) - 1
    p_value = None if dof < 1 else float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                                                 torch.tensor(statistic / 2, dtype=torch.float64)))
    tv = 0.5 * float((counts / n - probs).abs().sum())
    return dict(statistic=statistic, dof=dof, p_value=p_value, tv=tv)


# ----------------------------------------------------------------------------------------------------
# Measuring: every draft and gamma of one batch and decoding mode, timed round-robin with plain decoding.

def seeded(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def run_once(target, drafter, prompts, n_tokens, gamma, temperature, seed, accept=accept_draft):
    """One generation with its own seeded generator: the same tokens and counts every time."""
    return speculative_generate(target, drafter, prompts, n_tokens, gamma, temperature,
                                seeded(prompts.device, seed), accept)


@torch.inference_mode()
def draft_costs(target, drafters, prompts, gammas, temperature, device, repeats, seed=0):
    """Seconds of one target decoding step, of a verification pass of gamma + 1 tokens, and of each
    drafter's proposal of gamma tokens (its whole round: gamma model steps, one call of the Medusa heads,
    one n-gram search), each after a prompt and one decoded token, timed round-robin and undone after each
    call (caches rolled back). Returns (step seconds, {gamma: verify seconds}, {(name, gamma): seconds})."""
    target = kv_cache_view(target)
    B, P = prompts.shape
    cache, hidden, first = prefill_target(target, prompts)
    seq = torch.cat([prompts, first[:, None],
                     torch.zeros(B, max(gammas) + 1, dtype=torch.long, device=prompts.device)], dim=1)
    n = P + 1
    for drafter in drafters.values():  # the state after a round that kept nothing: one token decoded
        drafter.start(prompts, hidden)
        drafter.propose(seq, n, 1, temperature, seeded(device, seed))
    step_hidden = target.hidden_states(seq[:, n - 1:n], cache)
    for drafter in drafters.values():
        drafter.commit(n, 0, step_hidden)
    seq[:, n] = draw(head_logits(target, step_hidden[:, -1]))[0]
    n += 1

    def target_pass(T):
        target.forward_cache(seq[:, n - 1:n - 1 + T], cache)
        cache.truncate(n - 1)

    def proposal(drafter, gamma):
        mark = drafter.mark()
        drafter.propose(seq, n, gamma, temperature, seeded(device, seed))
        drafter.reset_to(mark)
    fns = {("verify", g): (lambda g=g: target_pass(g + 1)) for g in [0] + list(gammas)}
    fns |= {(name, g): (lambda d=d, g=g: proposal(d, g)) for name, d in drafters.items() for g in gammas}
    times = {key: iu.median(t) for key, t in iu.time_round_robin(fns, device, warmup=1, repeats=repeats).items()}
    verify = {g: times.pop(("verify", g)) for g in gammas}
    return times.pop(("verify", 0)), verify, times


def measure_group(targets, drafts, prompts, gammas, n_tokens, temperature, device, repeats, seed=0):
    """Plain decoding of each target and speculative decoding with every draft at every gamma, for one
    batch of prompts and one decoding mode (temperature None: greedy), all timed round-robin.

    targets: {name: GPTlite}; drafts: {name: (target name, drafter)}. Each draft's gammas are timed
    round-robin with plain decoding of its target (a few seconds a round, so that a slow moment of the
    machine falls on the baseline and the variants alike). Returns, per draft, one dict of plain decoding
    (draft "plain", `beside` the draft) and one per gamma: TTFT/TPOT/throughput (compare_generation);
    alpha and tau (counted in the timed runs, which are seeded: every repeat the same tokens) and tau's
    formula; the draft's cost c per draft token and the verification pass's cost, both over one target
    decoding step; the speedup (plain TPOT / TPOT)
    against Leviathan's formula (a verification pass costing one step) and against tau / (gamma c + verify)."""
    B, counted, timings = prompts.shape[0], {}, {}

    def plain(n, t):
        plain_generate(targets[t], prompts, n, temperature, seeded(device, seed))

    def speculate(n, t, drafter, g, key):
        counted[key, n] = run_once(targets[t], drafter, prompts, n, g, temperature, seed)[1]
    for name, (t, drafter) in drafts.items():  # each draft's gammas round-robin with plain decoding of its
        fns = {"plain": lambda n, t=t: plain(n, t)}  # target: the baseline of a speedup is timed beside it
        fns |= {g: (lambda n, t=t, d=drafter, g=g, key=(name, g): speculate(n, t, d, g, key)) for g in gammas}
        group = iu.compare_generation(fns, n_tokens, B, device, warmup=1, repeats=repeats)
        timings |= {(name, key): figures for key, figures in group.items()}
    costs = {}
    for t, target in targets.items():
        ours = {name: d for name, (tt, d) in drafts.items() if tt == t}
        if ours:
            step, verify, rounds = draft_costs(target, ours, prompts, gammas, temperature, device, repeats, seed)
            costs |= {(name, g): (s / step, verify[g] / step) for (name, g), s in rounds.items()}
    results = []
    for name, (t, drafter) in drafts.items():
        baseline = timings[(name, "plain")]
        results.append(dict(draft="plain", target=t, beside=name, gamma=0, **baseline, speedup=1.0))
        for g in gammas:
            stats, (draft_cost, verify) = counted[(name, g), n_tokens], costs[(name, g)]
            figures = timings[(name, g)]
            tau = expected_tau(stats.alpha, g)
            results.append(dict(draft=name, target=t, gamma=g, **figures, alpha=stats.alpha, tau=stats.tau,
                                tau_formula=tau, c=draft_cost / g, verify=verify,
                                plain_tpot_ms=baseline["tpot_ms"],
                                speedup=iu.ratio(baseline["tpot_ms"], figures["tpot_ms"]),
                                speedup_formula=expected_speedup(stats.alpha, g, draft_cost),
                                speedup_formula_verify=None if tau is None else tau / (draft_cost + verify)))
    return results


@torch.inference_mode()
def sampling_test(target, drafter, prompt, probs, gamma, temperature, n_samples, seed=0, accept=accept_draft,
                  batch_size=None):
    """The statistical check of speculative sampling: the first k tokens after `prompt` [P] (k >= 2: the
    first comes from the prefill), drawn n_samples times in batches of batch_size copies of the prompt
    (default: all at once), gamma draft tokens per round, against `probs`, the target's exact probabilities
    of every continuation of k tokens (exact_continuations). drafter None: plain sampling, the control
    that a correct sampler passes. Returns chi_square_test's dict."""
    V = target.config.vocab_size
    k = round(math.log(len(probs), V))
    if k < 2:
        raise ValueError("the test needs k >= 2 tokens: the first one is the prefill's, never a draft's")
    generator, outs, batch_size = seeded(prompt.device, seed), [], batch_size or n_samples
    for start in range(0, n_samples, batch_size):
        rows = prompt[None].repeat(min(batch_size, n_samples - start), 1)
        if drafter is None:
            seq = plain_generate(target, rows, k, temperature, generator)
        else:  # k + gamma - 1 tokens: the first round drafts gamma of them
            seq, _ = speculative_generate(target, drafter, rows, k + gamma - 1, gamma, temperature, generator, accept)
        outs.append(seq[:, len(prompt):len(prompt) + k])
    counts = torch.bincount(continuation_index(torch.cat(outs), V), minlength=len(probs))
    return chi_square_test(counts, probs)
