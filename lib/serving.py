"""What every batching scheduler of this repository shares: request checks, a request trace, the
serving clock, and the per-request latency figures (TTFT and TPOT from arrival, p50 and p99).

Blog section: "Batching and scheduling". A request is `(prompt, n_tokens)`: a 1-D LongTensor of token ids and the
number of new tokens to generate greedily. A trace adds an arrival time (seconds) to each request.

The serving clock. Arrivals are simulated against the engine's own clock, without sleeping: the
clock advances by the measured wall time of every scheduler step (CUDA synchronized, `iu.Timer`),
and when the engine has nothing to do it jumps to the next arrival (the time a real server would
spend waiting). A request can join a batch only once the clock has passed its arrival, so it waits
for the steps that run before it, exactly as it would on a live server whose requests come at those
times. Each new token is stamped with the clock at the end of the step that produced it:
TTFT = first token - arrival, TPOT = (last token - first token) / (n_tokens - 1). Throughput counts
the generated tokens over the busy time (the sum of the step times; waiting is not work).
"""
import math
from contextlib import contextmanager

import numpy as np
import torch

import inference_utils as iu
from gptlite import check_generation_args
from gptlite_kvcache import generate_kvcache
from lib import harness


def check_requests(model, requests, batch_size, seqlen):
    """Clear errors before any work; returns the requests as a list of (1-D prompt, n_tokens)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer of at least 1, got {batch_size!r}")
    if len(requests) == 0:
        raise ValueError("no requests: give a list of (prompt, n_tokens)")
    checked = []
    for i, request in enumerate(requests):
        prompt, n_tokens = request
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1:
            raise ValueError(f"request {i}: the prompt must be a 1-D LongTensor of token ids, "
                             f"got {type(prompt).__name__} {tuple(getattr(prompt, 'shape', ()))}")
        try:
            check_generation_args(model, prompt[None], n_tokens, seqlen)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
        if len(prompt) + n_tokens > seqlen:
            raise ValueError(f"request {i}: a prompt of {len(prompt)} tokens plus {n_tokens} new tokens is longer "
                             f"than the window seqlen={seqlen} (positions are absolute); ask for at most "
                             f"{seqlen - len(prompt)} new tokens or shorten the prompt")
        checked.append((prompt, n_tokens))
    return checked


def make_trace(source, n_requests, rate, seqlen, prompt_median, output_median, seed=0, sigma_prompt=0.6,
               sigma_output=1.0, device="cpu"):
    """A serving trace: Poisson arrivals at `rate` requests/s (inf: all at time 0), and log-normal
    (long-tailed) prompt and output lengths around their medians, cut so that each request fits the
    window (prompt + output <= seqlen). Prompts are windows of `source`, a 1-D tensor of token ids.
    Returns (requests, arrivals): a list of (prompt [P], n_tokens) and a list of seconds."""
    if n_requests < 1 or not rate > 0 or not 1 <= prompt_median < seqlen or not 1 <= output_median < seqlen:
        raise ValueError(f"a trace needs n_requests >= 1, rate > 0 and medians in [1, {seqlen}), got "
                         f"{n_requests}, {rate}, {prompt_median}, {output_median}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, n_requests) / rate  # rate inf: all at 0, and the same lengths as any rate
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at time 0
    prompt_lens = np.clip(np.rint(rng.lognormal(np.log(prompt_median), sigma_prompt, n_requests)), 1, seqlen - 1)
    output_lens = np.rint(rng.lognormal(np.log(output_median), sigma_output, n_requests))
    output_lens = np.clip(output_lens, 1, seqlen - prompt_lens)
    starts = rng.integers(0, len(source) - seqlen, n_requests)
    requests = [(source[s:s + int(p)].to(device), int(n)) for s, p, n in zip(starts, prompt_lens, output_lens)]
    return requests, [float(a) for a in arrivals]


def make_shared_prefix_trace(source, n_requests, rate, seqlen, system_len, prompt_median, output_median, seed=0,
                             device="cpu"):
    """make_trace's requests, each after the same system prompt: `system_len` tokens of `source` at a
    seeded place. The questions and outputs are drawn in the window left after it (seqlen - system_len).
    Returns (requests, arrivals) as make_trace does."""
    if not 1 <= system_len < seqlen - 1:
        raise ValueError(f"the system prompt needs 1 to seqlen-2={seqlen - 2} tokens, got {system_len}")
    requests, arrivals = make_trace(source, n_requests, rate, seqlen - system_len, prompt_median, output_median,
                                    seed=seed, device=device)
    start = int(np.random.default_rng(seed + 1).integers(0, len(source) - system_len))
    system = source[start:start + system_len].to(device)
    return [(torch.cat([system, question]), n) for question, n in requests], arrivals


def make_multi_turn_trace(cached_model, source, n_conversations, n_turns, rate, think_time, seqlen, output_len,
                          seed=0, device="cpu"):
    """Conversations of n_turns turns. A turn's prompt is the previous turn's prompt and answer (generated
    greedily by `cached_model` with generate_kvcache, the tokens every engine must return) followed
    by a new message, a window of `source`; each turn asks for output_len tokens, and its message
    fills the rest of its share of the window (seqlen // n_turns). Conversations start with Poisson
    arrivals at `rate`; each turn arrives think_time seconds after the previous one.
    Returns (requests, arrivals, previous) in arrival order; previous[i]: the index of request i's
    previous turn (None for a first turn)."""
    message_len = seqlen // n_turns - output_len
    if n_conversations < 1 or n_turns < 1 or output_len < 1 or message_len < 1 or not rate > 0 or not think_time > 0:
        raise ValueError(f"a multi-turn trace needs conversations, turns and output_len >= 1, output_len below "
                         f"seqlen // n_turns = {seqlen // n_turns}, rate and think_time > 0; got {n_conversations}, "
                         f"{n_turns}, {output_len}, {rate}, {think_time}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, n_conversations) / rate
    starts = np.cumsum(gaps) - gaps[0]
    offsets = rng.integers(0, len(source) - message_len, (n_turns, n_conversations))
    turns, contexts = [], [source[:0].to(device)] * n_conversations  # contexts: each conversation so far
    for turn in range(n_turns):
        prompts = [torch.cat([c, source[o:o + message_len].to(device)]) for c, o in zip(contexts, offsets[turn])]
        contexts = reference_outputs(cached_model, [(p, output_len) for p in prompts], seqlen)  # prompt + answer
        turns += [(float(s) + turn * think_time, turn, c, p) for c, (s, p) in enumerate(zip(starts, prompts))]
    turns.sort(key=lambda t: t[0])  # stable: a tie keeps turn order
    index = {(turn, c): i for i, (_, turn, c, _) in enumerate(turns)}
    return ([(p, output_len) for *_, p in turns], [a for a, *_ in turns],
            [index[(turn - 1, c)] if turn else None for _, turn, c, _ in turns])


def early_turns(clock, previous):
    """Turns of a multi-turn trace that arrived before the previous turn's answer ended on `clock`
    (arrivals are fixed in advance: a think time too short for the engine shows here)."""
    return sum(clock.last[j] > clock.arrivals[i] for i, j in enumerate(previous) if j is not None)


class ServingClock:
    """The engine's clock (see the module docstring): measured step times plus skipped idle gaps."""

    def __init__(self, arrivals, n_tokens, device="cpu"):
        self.arrivals, self.n_tokens, self.device = list(arrivals), list(n_tokens), device
        self.now = 0.0        # seconds since the trace started
        self.busy = 0.0       # seconds spent in steps
        self.n_steps = 0
        self.slot_steps = 0   # batch rows computed, summed over steps
        self.first = [None] * len(self.arrivals)   # clock at each request's first token
        self.last = [None] * len(self.arrivals)    # clock at each request's last token

    @classmethod
    def offline(cls, requests, device="cpu"):
        """Every request there at time 0 (an offline batch job)."""
        return cls([0.0] * len(requests), [n for _, n in requests], device)

    def arrived(self, i):
        return self.arrivals[i] <= self.now

    def wait_for(self, i):
        """Nothing to run: skip to request i's arrival."""
        self.now = max(self.now, self.arrivals[i])

    @contextmanager
    def step(self, rows):
        """Time one scheduler step that computes `rows` batch rows."""
        with iu.Timer(self.device) as timer:
            yield
        self.now += timer.seconds
        self.busy += timer.seconds
        self.n_steps += 1
        self.slot_steps += rows

    def token(self, i, n_generated):
        """Request i now has `n_generated` tokens; stamp its first and last."""
        if n_generated == 1:
            self.first[i] = self.now
        if n_generated == self.n_tokens[i]:
            self.last[i] = self.now


def latency_figures(clock):
    """p50/p99 TTFT from arrival and TPOT (ms), throughput (tokens per busy second) and the mean step (ms) of a
    finished run."""
    if None in clock.last:
        raise RuntimeError(f"{clock.last.count(None)} requests never finished; this is a bug")
    ttft = [(f - a) * 1e3 for f, a in zip(clock.first, clock.arrivals)]
    tpot = [(l - f) * 1e3 / (n - 1) for f, l, n in zip(clock.first, clock.last, clock.n_tokens) if n > 1]
    tpot = tpot or [0.0]
    n_generated = sum(clock.n_tokens)
    ms = lambda values, q: round(float(np.percentile(values, q)), 3)  # noqa: E731  (all rounded alike: p50 <= p99 stays true)
    return dict(ttft_arrival_ms=ms(ttft, 50), ttft_arrival_p99_ms=ms(ttft, 99), tpot_ms=ms(tpot, 50),
                tpot_p99_ms=ms(tpot, 99), tokens_per_s=n_generated / clock.busy if clock.busy > 0 else None,
                steps=clock.n_steps, step_ms=clock.busy * 1e3 / clock.n_steps if clock.n_steps else None,
                wasted_slot_steps=max(clock.slot_steps - n_generated, 0))


def median_figures(runs):
    """The median of each figure over several runs of the same trace (a list of dicts of numbers):
    iu.median, the repository's one median; a figure that some run could not measure (None) is None."""
    if not runs:
        raise ValueError("no runs: give at least one dict of figures")
    return {key: None if any(run[key] is None for run in runs) else iu.median([run[key] for run in runs])
            for key in runs[0]}


def forward_bytes(preset, n_sequences, length=None):
    """Estimated peak bytes of one forward pass of `n_sequences` sequences of `length` tokens (default:
    the window) through a model of `preset`, without a cache: float32 logits over the vocabulary, the keys
    and values of every layer, one layer's attention scores and a few d_model-wide activations, and the
    token ids. What a size flag (batch size, request count) makes a script allocate, told before any work."""
    length = preset.seqlen if length is None else length
    per_token = 4 * (preset.vocab_size + 2 * preset.n_layers * preset.n_heads * preset.d_head
                     + preset.n_heads * length + 8 * preset.d_model) + 8
    return n_sequences * length * per_token


def trace_bytes(preset, n_requests, copies=1):
    """Estimated bytes of a trace of `n_requests` requests whose prompts and outputs fill at most the
    window: the token ids (int64) of `copies` sets of outputs plus the requests and arrival times."""
    return n_requests * ((copies + 1) * preset.seqlen * 8 + 64)


def reference_outputs(cached_model, requests, seqlen):
    """Each request generated alone with generate_kvcache (greedy), its prompt followed by its new tokens
    (1-D): what every scheduler must return."""
    return [generate_kvcache(cached_model, prompt[None], n, seqlen)[0] for prompt, n in requests]


def same_outputs(outputs, reference):
    """'yes' when every request's tokens equal the reference, else how many differ."""
    wrong = sum(not torch.equal(o.to(r.device), r) for o, r in zip(outputs, reference))
    return "yes" if wrong == 0 and len(outputs) == len(reference) else f"NO ({wrong} differ)"


def arrival_rate(text):
    """An argparse type: a Poisson arrival rate in requests per second, above 0 and at most 1e6, or inf."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    return RATE(text)


RATE = harness.float_in(0.0, 1e6, low_open=True)


def add_trace_args(parser, n_requests=64, rate=None):
    """The trace's flags; rate=None: an offline trace, every request at time 0 (no --rate flag)."""
    parser.add_argument("--n-requests", type=harness.int_at_least(1, 10**8), default=n_requests,
                        help="requests in the trace")
    if rate is not None:
        parser.add_argument("--rate", type=arrival_rate, default=rate,
                            help="Poisson arrival rate, requests per second (inf: every request at time 0)")
    parser.add_argument("--prompt-median", type=harness.int_at_least(1, harness.MAX_SIZE), default=32,
                        help="median prompt length (log-normal)")
    parser.add_argument("--output-median", type=harness.int_at_least(1, harness.MAX_SIZE), default=16,
                        help="median output length (log-normal, long tail)")
    parser.add_argument("--repeats", type=harness.repeats, default=3,
                        help="runs of the trace per variant, round-robin, after a warm-up; each figure is the median")


def check_trace_args(parser, seqlen, prompt_median, output_median, rate=None):
    """The trace's flags against the window (rate None: an offline trace, no --rate flag); parser.error."""
    if rate is not None and not rate > 0:  # inf is allowed: every request at time 0
        parser.error(f"--rate must be above 0 requests per second, got {rate}")
    for flag, value in [("--prompt-median", prompt_median), ("--output-median", output_median)]:
        if value >= seqlen:
            parser.error(f"{flag} must be between 1 and seqlen-1={seqlen - 1}, got {value}")


def add_sharing_args(parser):
    """The flags of the prefix-sharing traces (make_shared_prefix_trace, make_multi_turn_trace)."""
    parser.add_argument("--system-len", type=harness.int_at_least(1, harness.MAX_SIZE), default=64,
                        help="--prefix-sharing: system prompt tokens")
    parser.add_argument("--turns", type=harness.int_at_least(2), default=4,
                        help="--prefix-sharing: turns per conversation (conversations: --n-requests / --turns)")
    parser.add_argument("--think-time", type=harness.float_in(0.0, 3600.0, low_open=True), default=2.0,
                        help="--prefix-sharing: seconds between a conversation's turns")


def check_sharing_args(parser, seqlen, system_len, turns, n_requests, prompt_median, output_median):
    """The prefix-sharing traces' flags against the window; parser.error."""
    window = seqlen - system_len  # what the system prompt leaves to a question and its answer
    if not prompt_median < window > output_median:
        parser.error(f"--system-len {system_len} leaves {window} tokens of seqlen={seqlen}: --prompt-median "
                     "and --output-median must be below it")
    if output_median >= seqlen // turns:
        parser.error(f"--output-median must be below seqlen / --turns = {seqlen // turns} so that every turn "
                     "has a message")
    if n_requests < turns:
        parser.error(f"--n-requests must be at least --turns={turns} (one conversation)")
