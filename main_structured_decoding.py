"""Structured decoding: greedy decoding under a grammar (XGrammar), with and without jump-forward.

    python main_structured_decoding.py                        # cpu preset on CPU, gptlite on CUDA
    python main_structured_decoding.py --speakers PETRUCHIO KATHARINA --json sd.json --plot sd.png
    python main_structured_decoding.py --untrained --n-outputs 2 --repeats 1   # a quick smoke run

Blog section: "Other serving techniques". At every step the grammar engine (XGrammar, given GPTlite's 65
characters as its token list) says which characters may come next; the others' logits become -inf
before the argmax. Jump-forward (SGLang): when the grammar leaves exactly one way on, append that whole
string without asking the model, then feed it in one forward pass. With one token per character, the
forced characters are exactly those masked decoding picks, so both give the same text (checked).

Three grammars in the corpus's vocabulary (structured_decoding.py): a play turn and a stage direction
(EBNF), a one-line reply (regex). Per grammar, three variants on the same validation prompts:
unconstrained (stopped where the grammar's text would end), constrained, constrained + jump-forward.
Columns: outputs the grammar accepts (the engine; Python's re too for the regex), model calls per
output character, time per character, mask time per step against forward time per call, and the
validation loss of the corpus's own turns that fit the grammar, with and without the mask.
"""
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite import GPTlite
from gptlite_kvcache import generate_kvcache
from lib import attention_benchmark as ab
from lib import harness
from lib import structured_decoding as sd
from lib import training
from lib.errors import GPTliteError


@dataclass
class Decoded:
    tokens: list       # the new character ids
    calls: int         # model forward passes (the prefill included)
    mask_s: list       # seconds of each grammar mask (fill the bitmask, apply it)
    forward_s: list    # seconds of each forward pass after the prefill
    complete: bool = True  # False: max_chars cut the output before the grammar (or stop) ended it


@torch.inference_mode()
def constrained_generate(model, prompt, grammar, max_chars, seqlen, jump_forward=False, stop=None):
    """Greedy decoding of one prompt [1, S] with a cached model, under `grammar` (a CharGrammar; None:
    unconstrained, ended when `stop(tokens)` is true). Ends when the grammar is complete or after
    max_chars characters. Returns a Decoded: the new tokens, the model calls, the step times, and
    `complete`: whether the output is a sentence of the grammar (unconstrained: whether stop ended it).

    Refused before the prefill (GPTliteError): max_chars below 1 or below the grammar's shortest
    sentence (no output could be complete), a shortest sentence that does not fit in the window after
    the prompt, and a prompt plus max_chars past the window (S + max_chars - 1 positions: the last
    character is not fed back; past seqlen the cache only approximates the model). A cut by max_chars
    longer than that is not an error, as an LLM API's "length" finish: the text so far comes back with
    complete False, and a caller that needs a sentence of the grammar checks it."""
    n_prompt, shortest = prompt.shape[1], grammar.min_chars if grammar else 1
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise GPTliteError(f"max_chars must be an integer of at least 1, got {max_chars!r}")
    example = f", e.g. {grammar.shortest!r}" if grammar and grammar.shortest else ""
    if grammar and n_prompt + shortest - 1 > seqlen:
        raise GPTliteError(f"the grammar's shortest sentence ({shortest} characters{example}) does not fit after "
                              f"a prompt of {n_prompt} characters in the model's window of {seqlen}: shorten the "
                              f"prompt to at most {seqlen - shortest + 1} characters, or the grammar")
    if max_chars < shortest:
        raise GPTliteError(f"max_chars={max_chars} is shorter than the grammar's shortest sentence ({shortest} "
                              f"characters{example}): no output could be complete; give max_chars of at least "
                              f"{shortest}")
    if n_prompt + max_chars - 1 > seqlen:
        raise GPTliteError(f"a prompt of {n_prompt} characters and max_chars={max_chars} need "
                              f"{n_prompt + max_chars - 1} positions, past the model's window of {seqlen}: give "
                              f"max_chars of at most {seqlen - n_prompt + 1}, or a shorter prompt")
    device = prompt.device
    matcher = grammar.matcher() if grammar else None
    bitmask = grammar.new_bitmask() if grammar else None
    logits, kv_cache = model(prompt, max_seqlen=seqlen)  # prefill
    logits = logits[:, -1].float()  # [1, vocab]
    out = Decoded([], 1, [], [])
    while len(out.tokens) < max_chars:
        forced = matcher.find_jump_forward_string() if jump_forward else ""
        if forced:  # the only way on: appended without asking the model
            ids = grammar.encode(forced)
            matcher.accept_string(forced)
        else:
            if grammar:
                with iu.Timer() as masking:
                    grammar.mask_logits(matcher, logits, bitmask)  # forbidden characters -> -inf
                out.mask_s.append(masking.seconds)
            ids = [logits.argmax(dim=-1).item()]
            if grammar and not matcher.accept_token(ids[0]):
                raise GPTliteError("the grammar allows no character here; check it (a dead end)")
        out.tokens += ids
        if len(out.tokens) >= max_chars or (matcher.is_terminated() if grammar else stop(out.tokens)):
            break  # no forward pass for a character that nothing follows
        with iu.Timer(device) as forward:  # synchronized: the logits are ready when the clock is read
            logits, kv_cache = model(torch.tensor([ids], device=device), kv_cache, max_seqlen=seqlen)  # [1, T, vocab]
            logits = logits[:, -1].float()
        out.forward_s.append(forward.seconds)
        out.calls += 1
    out.complete = matcher.is_completed() if grammar else bool(stop(out.tokens))
    return out


# ----------------------------------------------------------------------------------------------------
# The experiment: three grammars, three variants, the same prompts.

VARIANTS = ("unconstrained", "constrained", "constrained + jump-forward")


@dataclass
class Task:
    name: str
    grammar: sd.CharGrammar
    end: str        # regex: where the unconstrained text stops (where the grammar's text would end)
    examples: list  # (offset, text) of the validation text that the grammar accepts, for the loss


def make_tasks(speakers, vocab, turns, seqlen, max_lines, max_line_chars):
    """The three grammars, each with the validation turns (offset, text) it accepts for the loss."""
    # a full window of validation text ends with the text: 32 characters of context at least
    fits = lambda g, i, text: i >= seqlen and len(text) <= seqlen - 32 and g.accepts(text)
    turn = sd.CharGrammar(sd.turn_grammar(speakers, max_lines, max_line_chars), vocab)
    direction = sd.CharGrammar(sd.stage_direction_grammar(speakers), vocab)
    reply = sd.CharGrammar(sd.reply_regex(speakers, max_line_chars), vocab, kind="regex")
    return [Task("play turn (EBNF)", turn, r"\n\n", [(i, t) for i, t in turns if fits(turn, i, t)]),
            Task("stage direction (EBNF)", direction, r"\n", []),  # the corpus has none
            Task("one-line reply (regex)", reply, r"\n.*\n", [(i, t[:-1]) for i, t in turns if fits(reply, i, t[:-1])])]


def turn_prompts(data, turns, n_prompts, prompt_len, seed, device):
    """The validation text just before n_prompts of its turns, chosen at random: [n_prompts, prompt_len]."""
    starts = [i for i, _ in turns if i >= prompt_len]
    pick = torch.randperm(len(starts), generator=torch.Generator().manual_seed(seed))[:n_prompts]
    return torch.stack([data.val[starts[i] - prompt_len:starts[i]] for i in pick.tolist()]).to(device)


def run_variant(model, prompts, task, variant, max_chars, seqlen, vocab):
    """Every prompt under one variant: a list of Decoded, and the seconds it all took."""
    stop = lambda ids: re.search(task.end, "".join(vocab[i] for i in ids)) is not None
    grammar = None if variant == "unconstrained" else task.grammar
    with iu.Timer() as running:
        outs = [constrained_generate(model, p[None], grammar, max_chars, seqlen, variant.endswith("jump-forward"), stop)
                for p in prompts]
    return outs, running.seconds


def check_outputs(model, prompts, task, outs, seqlen, vocab):
    """Unconstrained = generate_kvcache; jump-forward = masked decoding; the grammar accepts every output."""
    text = lambda d: "".join(vocab[i] for i in d.tokens)
    unconstrained, masked, jumped = (outs[v] for v in VARIANTS)
    return {
        "unconstrained = generate_kvcache": all(
            generate_kvcache(model, p[None], len(d.tokens), seqlen)[0, p.numel():].tolist() == d.tokens
            for p, d in zip(prompts, unconstrained)),
        "jump-forward = masked decoding": all(a.tokens == b.tokens for a, b in zip(masked, jumped)),
        "constrained outputs accepted": all(task.grammar.accepts(text(d)) for d in masked + jumped),
    }


@torch.inference_mode()
def grammar_loss(model, task, data, seqlen, masked):
    """Mean loss (nats per character) of the validation texts the grammar accepts, each read after the
    text before it (a full window); masked: the grammar's forbidden characters removed from the softmax."""
    if not task.examples:
        return None
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for offset, text in task.examples:
        end = offset + len(text)
        window = data.val[end - seqlen - 1:end].to(device)  # [seqlen + 1]: the inputs and their next characters
        logits = training.logits_of(model(window[None, :-1]))[0, -len(text):].float()  # [len, vocab]
        if masked:  # every row at once: the grammar's mask before each character of the text
            task.grammar.mask_logits_along(logits, text)
        total += F.cross_entropy(logits, window[-len(text):], reduction="sum").item()
        count += len(text)
    return total / count


def check_runs(model, prompts, tasks, max_chars, seqlen, vocab):
    """A first run of every (task, variant), whose outputs are checked (and which warms up the timing).
    Returns {(task, variant): outputs} and the checks."""
    outputs = {(t.name, v): run_variant(model, prompts, t, v, max_chars, seqlen, vocab)[0] for t in tasks
               for v in VARIANTS}
    checks = {f"{task.name}: {name}": ok for task in tasks for name, ok in check_outputs(
        model, prompts, task, {v: outputs[task.name, v] for v in VARIANTS}, seqlen, vocab).items()}
    return outputs, checks


def measure(model, prompts, tasks, max_chars, seqlen, vocab, repeats, device):
    """`repeats` timed rounds of every (task, variant), round-robin (iu.time_round_robin; check_runs
    warmed them up). Returns {(task, variant): [seconds]}."""
    runs = {(t.name, v): (lambda t=t, v=v: run_variant(model, prompts, t, v, max_chars, seqlen, vocab))
            for t in tasks for v in VARIANTS}
    return iu.time_round_robin(runs, device, warmup=0, repeats=repeats)


def make_rows(tasks, outputs, seconds, losses, vocab):
    rows = []
    for task in tasks:
        for variant in VARIANTS:
            outs = outputs[task.name, variant]
            texts = ["".join(vocab[i] for i in d.tokens) for d in outs]
            n_chars = sum(len(t) for t in texts)
            median_ms = lambda xs: iu.median(xs) * 1e3 if xs else None  # noqa: E731
            regex = task.grammar.python_regex
            rows.append(harness.make_row(
                variant, grammar=task.name, tokens_per_s=n_chars / iu.median(seconds[task.name, variant]),
                val_loss=losses[task.name, variant != "unconstrained"],
                accepted=sum(map(task.grammar.accepts, texts)) / len(texts),
                accepted_re=None if regex is None else sum(bool(regex.fullmatch(t)) for t in texts) / len(texts),
                chars=n_chars / len(texts), calls_per_char=sum(d.calls for d in outs) / n_chars,
                mask_ms=median_ms([s for d in outs for s in d.mask_s]),
                forward_ms=median_ms([s for d in outs for s in d.forward_s])))
    return rows


def plot_results(rows, preset, device):
    """Model calls per character and characters per second, by grammar and variant: the figure."""
    fig, (ax_calls, ax_speed) = harness.new_figure(2)
    grammars = list(dict.fromkeys(r["grammar"] for r in rows))
    width = 0.8 / len(VARIANTS)
    for k, variant in enumerate(VARIANTS):
        mine = [next(r for r in rows if r["grammar"] == g and r["variant"] == variant) for g in grammars]
        xs = [i + k * width for i in range(len(grammars))]
        ax_calls.bar(xs, [r["calls_per_char"] for r in mine], width, label=variant)
        ax_speed.bar(xs, [r["tokens_per_s"] for r in mine], width, label=variant)
    for ax in (ax_calls, ax_speed):
        ax.set_xticks([i + width for i in range(len(grammars))], [g.split(" (")[0] for g in grammars])
    ax_calls.set(ylabel="model calls per output character", title=f"structured decoding (preset {preset.name})")
    ax_speed.set(ylabel="output characters per second", title=f"greedy, batch 1 ({device})")
    ax_calls.legend(loc="lower left")
    return fig


def headline(rows):
    """The README's row: play turns accepted with and without the grammar, model calls per character."""
    row = {(r["variant"], r["grammar"]): r for r in rows}
    accepted = {v: row[v, "play turn (EBNF)"]["accepted"] for v in ("unconstrained", "constrained")}
    jump = [row["constrained + jump-forward", g]["calls_per_char"] for g in ("play turn (EBNF)", "stage direction (EBNF)")]
    return dict(technique="structured decoding (XGrammar), jump-forward",
                figure=f"play turns accepted: {accepted['unconstrained']:.0%} unconstrained, "
                       f"{accepted['constrained']:.0%} constrained; jump-forward: {jump[0]:.2f} model calls per "
                       f"character on play turns, {jump[1]:.2f} on stage directions; the same text")


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data); args.speakers is the list checked
    against the corpus (default: its 8 most frequent speakers of the validation text)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--speakers", nargs="+", default=None, metavar="NAME",
        help="speaker names the grammars allow, as the corpus writes them (default: the 8 who speak most "
             "in the validation text)")
    add("--n-outputs", type=harness.int_at_least(1), default=8, help="prompts (validation text before a turn) per variant")
    harness.add_generation_flags(parser, prompt_len=16, repeats=3)
    add("--max-lines", type=harness.int_at_least(1), default=2, help="most verse lines in a play turn")
    add("--max-line-chars", type=harness.int_at_least(4), default=48, help="most characters in a line")
    args = parser.parse_args(argv)

    def check_window(preset, max_chars):  # past the window the post's cache drifts (gptlite_kvcache.py)
        if args.prompt_len + max_chars > preset.seqlen:
            parser.error(f"a prompt of {args.prompt_len} and the longest turn ({max_chars} characters) exceed the "
                         f"window of {preset.seqlen}: lower --prompt-len, --max-lines or --max-line-chars")

    def check_args(preset):  # the speakers' names come with the data: the turn without them first
        check_window(preset, 3 + args.max_lines * (args.max_line_chars + 1))
        # every output of the 3 x 3 runs holds its tokens and per-step timings; the prompts, a cached forward each
        harness.check_fits(parser, "--n-outputs", 9 * args.n_outputs * preset.seqlen * 64
                           + ab.generation_bytes(preset, args.n_outputs, preset.seqlen), "the outputs and prompts")
    preset, device, data = harness.setup(args, parser, check_args)
    args.speakers = check_speakers(parser, args, data)
    check_window(preset, longest_turn(args.speakers, args.max_lines, args.max_line_chars))
    return args, preset, device, data


def longest_turn(speakers, max_lines, max_line_chars):
    """The most characters of a play turn: the longest name, ':' and newlines, the lines."""
    return max(map(len, speakers)) + 3 + max_lines * (max_line_chars + 1)


def check_speakers(parser, args, data):
    """--speakers against the corpus, or the default: the most frequent speakers of the validation text."""
    if args.speakers is None:
        return [name for name, _ in sd.corpus_speakers(data.val_text).most_common(8)]
    try:
        sd.check_speakers(args.speakers, sd.corpus_speakers(data.decode(data.train.tolist()) + data.val_text))
    except ValueError as e:
        parser.error(f"--speakers: {e}")
    return args.speakers


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    speakers, val_text = args.speakers, data.val_text
    max_chars = longest_turn(speakers, args.max_lines, args.max_line_chars)
    turns = sd.corpus_turns(val_text)
    tasks = make_tasks(speakers, data.vocab, turns, preset.seqlen, args.max_lines, args.max_line_chars)

    model = iu.kv_cache_model(iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed))
    prompts = turn_prompts(data, turns, args.n_outputs, args.prompt_len, args.seed, device)
    outputs, checks = check_runs(model, prompts, tasks, max_chars, preset.seqlen, data.vocab)
    harness.require_checks(checks)
    losses = {(t.name, masked): grammar_loss(model, t, data, preset.seqlen, masked)
              for t in tasks for masked in (False, True)}
    seconds = measure(model, prompts, tasks, max_chars, preset.seqlen, data.vocab, args.repeats, device)
    rows = make_rows(tasks, outputs, seconds, losses, data.vocab)
    decode = lambda ids: "".join(data.vocab[i] for i in ids)  # noqa: E731

    print(f"\nspeakers: {', '.join(speakers)}; {args.n_outputs} prompts of {args.prompt_len} characters (the text "
          f"before a validation turn), at most {max_chars} characters per output, median of {args.repeats} rounds")
    summary = [f"val loss: the validation turns each grammar accepts ({', '.join(f'{t.name}: {len(t.examples)}' for t in tasks)}), "
               "unconstrained vs. with the grammar's mask (renormalized over the allowed characters)",
               "accepted: outputs the grammar engine accepts; accepted_re: Python's re.fullmatch of the same regex",
               "calls_per_char: model forward passes (prefill included) per output character; mask_ms: median "
               "grammar mask per step; forward_ms: median forward pass per call",
               *(f"{t.name}, first constrained output: {decode(outputs[t.name, VARIANTS[1]][0].tokens)!r}"
                 for t in tasks),
               "checks: " + ", ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks.items())]
    harness.report(args, "main_structured_decoding.py", preset, device, rows, headline(rows), summary=summary,
                   plot=lambda: plot_results(rows, preset, device), speakers=speakers,
                   grammars={t.name: t.grammar.source for t in tasks}, checks=checks)


if __name__ == "__main__":
    harness.run(main)
