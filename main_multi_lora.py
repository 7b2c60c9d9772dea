"""Multi-LoRA serving: many fine-tuned adapters on one base model, merged copies against one mixed batch.

    python main_multi_lora.py                               # cpu preset on CPU, gptlite on CUDA
    python main_multi_lora.py --rank 16 --targets query_proj value_proj --json lora.json --plot lora.png
    python main_multi_lora.py --untrained --lora-steps 2 --n-tokens 8 --repeats 1   # a quick smoke run

Blog section: "Other serving techniques" (multi-LoRA serving: S-LoRA, Punica). One LoRA adapter per speaker
(--speakers; rank and target modules as flags, the attention projections by default) is fine-tuned
with peft on the first 80% of that speaker's turns in tiny Shakespeare's validation split, text the base
model never trained on, and saved as checkpoints/<preset>_lora_<speaker>_r<rank>_<targets>.pt (later
runs load it). Its loss on the last 20% is compared with the base model's. Then a batch of
--batch-size requests, request i using adapter i mod N, is served two ways with the repository's code
(gptlite_lora.py):
- merged: one copy of the model per adapter with W + s B A folded in, the requests grouped by adapter,
  one generate_kvcache per group;
- batched (Punica's BGMV): one GPTlite_KVCache whose targeted linears add `(x @ A[ids]) @ B[ids]` to the
  shared base weight's output, one generate_kvcache for the whole mixed batch.
Throughput and weight memory are measured for N = 1 .. 32 distinct adapters; beyond the trained ones the
adapters are random (a stand-in: the cost of an adapter does not depend on its values).

Checks first: with every adapter in the batch, both ways give the tokens of each request generated alone
with its merged adapter, and the adapters taken out of peft give peft's logits (when trained in this run).
"""
import copy
import dataclasses

import torch

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from gptlite_lora import (ATTENTION_TARGETS, LORA_TARGETS, LoRAAdapter, check_lora_args, generate_merged,
                          generate_multi_lora, merge_adapter, multi_lora_model, random_adapter)
from lib.lora_peft import adapter_from_peft, divergence_hint, peft_model
from lib import corpus, files, harness, training

SPEAKERS = ("PETRUCHIO", "PROSPERO", "TRANIO", "KATHARINA")  # the most lines in the validation split


def adapter_path(preset, speaker, rank, targets):
    code = "".join(t[0] for t in targets if not t.startswith("ffwd")) + "".join(
        "m" + t[-1] for t in targets if t.startswith("ffwd"))  # qkvo, qv, qkvom0m2
    return files.checkpoint_path(f"{preset.name}_lora_{corpus.slug(speaker)}_r{rank}_{code}")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How each adapter is made: its shape (rank, alpha, target modules) and its fine-tuning."""
    rank: int
    alpha: float
    targets: tuple
    steps: int
    batch_size: int
    lr: float
    seed: int = 0


def train_adapter(base, slice_data, recipe, seqlen, speaker):
    """Fine-tune a LoRA adapter on one speaker's turns with peft; the base weights stay frozen.
    Returns the adapter and the max |logit difference| between peft's model and the adapter merged."""
    model = peft_model(copy.deepcopy(base), recipe.rank, list(recipe.targets), recipe.alpha)
    training.train_steps(model, slice_data, recipe.steps, recipe.batch_size, seqlen, recipe.lr, seed=recipe.seed,
                         eval_interval=recipe.steps, desc=f"LoRA {speaker}",
                         hint=divergence_hint(recipe.rank, recipe.alpha, recipe.lr))
    adapter = adapter_from_peft(model, base)
    x = corpus.get_batch(slice_data.val, 4, seqlen, torch.Generator().manual_seed(0), base.fc_out.weight.device)[0]
    with torch.no_grad():
        peft_diff = (training.logits_of(model(x)) - training.logits_of(merge_adapter(base, adapter)(x))).abs().max().item()
    return adapter, peft_diff


def load_or_train(base, data, slice_data, recipe, preset, speaker, rebuild, save=True):
    """The saved adapter when its file has this recipe; else train one (and save it when `save`: a trained
    base). `rebuild`: the command named in the file. Returns the adapter and {source, peft_diff}."""
    config = dict(rank=recipe.rank, alpha=recipe.alpha, targets=list(recipe.targets))
    stamp = dict(speaker=speaker, steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr, seed=recipe.seed,
                 base_sha256=files.checkpoint_sha256(preset.gptlite_kwargs(), data.vocab, base.state_dict()))
    path = adapter_path(preset, speaker, recipe.rank, recipe.targets) if save else None  # random base: not saved
    peft_diff = {}

    def train(adapter):
        trained, peft_diff["max"] = train_adapter(base, slice_data, recipe, preset.seqlen, speaker)
        adapter.load_state_dict(trained.state_dict())
    with torch.random.fork_rng(devices=[]):  # an empty adapter to load into: it draws nothing from the seed
        adapter = LoRAAdapter(base, recipe.rank, list(recipe.targets), recipe.alpha).to(base.fc_out.weight.device)
    adapter, seconds = iu.cached_model(adapter, config, path, train, data.vocab, rebuild, stamp=stamp)
    if seconds is None:
        return adapter, dict(source=f"loaded {path.name}", peft_diff=None)
    return adapter, dict(source=f"trained in {seconds:.0f} s", peft_diff=peft_diff["max"])


def all_adapters(base, data, slices, recipe, preset, n_max, rebuild, save):
    """One adapter per speaker (loaded or trained), then random ones up to n_max. Returns the adapters,
    the trained ones' infos and the seconds spent loading or training."""
    with iu.Timer() as t:
        trained = [load_or_train(base, data, slices[s], recipe, preset, s, rebuild, save) for s in slices]
    adapters = [a for a, _ in trained]
    adapters += [random_adapter(base, recipe.rank, list(recipe.targets), recipe.alpha, seed=1000 + i)
                 for i in range(len(adapters), n_max)]
    return adapters, [i for _, i in trained], t.seconds


def adapter_losses(base, data, adapters, slices, infos, n_batches):
    """Each trained adapter's validation loss on its speaker's held-out turns against the base model's."""
    loss = lambda model, d: training.validation_loss(model, d, n_batches=n_batches)  # noqa: E731
    seen = corpus.Data(vocab=data.vocab, train=data.train, val=data.train)  # the base model's own training text
    rows, seen_base = [], loss(base, seen)
    for (speaker, slice_data), adapter, info in zip(slices.items(), adapters, infos):
        merged = merge_adapter(base, adapter)
        base_loss, adapter_loss = loss(base, slice_data), loss(merged, slice_data)
        rows.append(dict(speaker=speaker, train_chars=len(slice_data.train), val_chars=len(slice_data.val),
                         val_loss=adapter_loss, base_val_loss=base_loss, gain=base_loss - adapter_loss,
                         train_split_loss=loss(merged, seen), train_split_base=seen_base,
                         adapter=info["source"]))
    return rows


def check_tokens(base, adapters, merged_kv, prompts, n_tokens, seqlen):
    """Every adapter in one batch: batched and merged tokens against each request alone, merged."""
    ids = torch.arange(prompts.shape[0], device=prompts.device) % len(adapters)
    alone = torch.cat([generate_kvcache(merged_kv[a], prompts[i:i + 1], n_tokens, seqlen)
                       for i, a in enumerate(ids.tolist())])
    batched = generate_multi_lora(multi_lora_model(base, adapters), prompts, ids, n_tokens, seqlen)
    merged = generate_merged(merged_kv, prompts, ids, n_tokens, seqlen)
    return {"batched (BGMV) = each request alone": torch.equal(batched, alone),
            "merged, grouped = each request alone": torch.equal(merged, alone)}


def sweep(base, adapters, merged_kv, prompts, counts, n_tokens, seqlen, device, repeats):
    """Throughput against the number of distinct adapters in the batch; every variant timed round-robin."""
    fns, memory = {"base model, no adapter": lambda n: generate_kvcache(base, prompts, n, seqlen)}, {}
    memory["base model, no adapter"] = iu.model_size_mb(base)
    for k in counts:
        ids = torch.arange(prompts.shape[0], device=device) % k
        served = multi_lora_model(base, adapters[:k])
        fns[f"merged, {k}"] = lambda n, k=k, ids=ids: generate_merged(merged_kv[:k], prompts, ids, n, seqlen)
        fns[f"batched, {k}"] = lambda n, s=served, ids=ids: generate_multi_lora(s, prompts, ids, n, seqlen)
        memory[f"merged, {k}"] = sum(iu.model_size_mb(m) for m in merged_kv[:k])  # k full copies
        memory[f"batched, {k}"] = iu.model_size_mb(served)  # base weights once + k stacked adapters
    timings = iu.compare_generation(fns, n_tokens, prompts.shape[0], device, warmup=1, repeats=repeats)
    rows = []
    for name, t in timings.items():
        kind, _, k = name.partition(", ")
        k = int(k) if k.isdigit() else 0
        variant = name if not k else f"{kind}, {k} adapter{'s' if k > 1 else ''}"
        rows.append(harness.make_row(variant, n_adapters=k, batch_size=prompts.shape[0], **t, weights_mb=memory[name]))
    for row in rows:
        if row["variant"].startswith("batched"):
            merged = next(r for r in rows if r["variant"].startswith("merged") and r["n_adapters"] == row["n_adapters"])
            row["vs_merged"] = iu.ratio(row["tokens_per_s"], merged["tokens_per_s"])
    return rows


def plot_results(rows, losses, preset, device):
    fig, (ax_tput, ax_mem, ax_loss) = harness.new_figure(3)
    for kind in ("merged", "batched"):
        points = [r for r in rows if r["variant"].startswith(kind)]
        ks = [r["n_adapters"] for r in points]
        ax_tput.plot(ks, [r["tokens_per_s"] for r in points], marker="o", label=kind)
        ax_mem.plot(ks, [r["weights_mb"] for r in points], marker="o", label=kind)
    base = rows[0]
    ax_tput.axhline(base["tokens_per_s"], color="gray", linestyle="--", label="base model, no adapter")
    for ax in (ax_tput, ax_mem):
        ax.set_xscale("log", base=2)
        ax.legend()
    ax_tput.set(xlabel="distinct adapters in the batch", ylabel="tokens/s", ylim=(0, None),
                title=f"batch {base['batch_size']}, preset {preset.name} ({device})")
    ax_mem.set(xlabel="adapters served", ylabel="weights (MB)", title="N merged copies against base + N adapters")
    x = range(len(losses))
    figures = [r[k] for r in losses for k in ("base_val_loss", "val_loss")]
    ax_loss.bar([i - 0.2 for i in x], [r["base_val_loss"] for r in losses], width=0.4, label="base model")
    ax_loss.bar([i + 0.2 for i in x], [r["val_loss"] for r in losses], width=0.4, label="its LoRA adapter")
    ax_loss.set_xticks(list(x), [r["speaker"] for r in losses], rotation=20)
    ax_loss.set(ylabel="validation loss (nats/char), axis cut", ylim=(0.9 * min(figures), 1.02 * max(figures)),
                title="each adapter on its speaker's held-out turns")
    ax_loss.legend(loc="lower right")
    return fig


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--rank", type=harness.int_at_least(1), default=8, help="LoRA rank r of every adapter")
    add("--alpha", type=harness.float_in(0.0, 1024.0, low_open=True), default=None, help="LoRA alpha; the update is scaled by alpha / r "
        "(default: 2 * rank)")
    add("--targets", nargs="+", choices=LORA_TARGETS, default=list(ATTENTION_TARGETS), metavar="MODULE",
        help=f"linear layers the adapters change, in every block: some of {', '.join(LORA_TARGETS)} "
             "(default: the four attention projections)")
    add("--speakers", nargs="+", default=list(SPEAKERS), metavar="NAME",
        help="one adapter per speaker, trained on that speaker's turns (names as in the text, upper case)")
    add("--lora-steps", type=harness.steps, default=200, help="fine-tuning steps of each adapter")
    add("--lora-batch-size", type=harness.int_at_least(1), default=8, help="fine-tuning batch, in windows of seqlen")
    add("--lr", type=harness.learning_rate, default=1e-3,
        help="peak learning rate of fine-tuning (3e-3 overfits the smaller speakers within 200 steps)")
    harness.add_generation_flags(parser, batch_size=32, prompt_len=16, n_tokens=32, repeats=3)
    add("--adapter-counts", nargs="+", type=harness.int_at_least(1), default=[1, 2, 4, 8, 16, 32], metavar="N",
        help="distinct adapters in the batch, one point each (at most --batch-size)")
    add("--val-batches", type=harness.batches, default=20,
        help="validation batches (32 windows each) per loss figure")
    args = parser.parse_args(argv)
    args.alpha = args.alpha if args.alpha is not None else 2.0 * args.rank
    args.targets = sorted(set(args.targets), key=LORA_TARGETS.index)

    def check_args(preset):
        if max(args.adapter_counts) > args.batch_size:
            parser.error(f"--adapter-counts: at most --batch-size={args.batch_size} distinct adapters fit in the batch")
        if len(set(args.speakers)) != len(args.speakers):
            parser.error("--speakers: name each speaker once")
        with torch.device("meta"):  # the preset's layer widths, without weights
            shape = GPTlite_KVCache(**preset.gptlite_kwargs())
        try:
            check_lora_args(args.rank, args.targets, args.alpha, shape)
        except ValueError as e:
            parser.error(f"--rank: {e}")
        if args.prompt_len + args.n_tokens > preset.seqlen:
            parser.error(f"--prompt-len + --n-tokens must be at most seqlen={preset.seqlen} (the checks compare "
                         "tokens within the window)")
        check_sizes(parser, preset, args)
    return (args, *harness.setup(args, parser, check_args))


def weights_bytes(preset):
    """Bytes of one float32 GPTlite of `preset`: every block's attention and MLP, the embeddings and the head."""
    d, inner = preset.d_model, preset.n_heads * preset.d_head
    per_block = 4 * d * inner + 8 * d * d + 4 * inner + 9 * d
    return 4 * (preset.n_layers * per_block + 2 * preset.vocab_size * d + preset.seqlen * d)


def check_sizes(parser, preset, args):
    """The size flags against the machine, before any work: the merged copies of the largest adapter count,
    the mixed batch (its windows, caches and every request's gathered adapter matrices), the fine-tuning batch."""
    k = max(max(args.adapter_counts), len(args.speakers))
    harness.check_fits(parser, "--adapter-counts", (k + 1) * weights_bytes(preset), f"{k} merged copies of the model")
    gathered = preset.n_layers * len(args.targets) * args.rank * 5 * preset.d_model * 4  # A[ids] and B[ids]: <= 5 d
    harness.check_fits(parser, "--batch-size", training.activation_bytes(preset, args.batch_size) + args.batch_size
                       * gathered, f"a mixed batch of {args.batch_size} requests")
    harness.check_fits(parser, "--lora-batch-size", training.activation_bytes(preset, args.lora_batch_size, backward=True),
                       f"a fine-tuning batch of {args.lora_batch_size} windows")


def headline(rows, losses, rank):
    """The README's one-glance row, from this run's rows and adapter losses."""
    k = max(row["n_adapters"] for row in rows)
    merged, batched = (next(r for r in rows if r["variant"].startswith(kind) and r["n_adapters"] == k)
                       for kind in ("merged", "batched"))
    ratio = iu.ratio(batched["tokens_per_s"], merged["tokens_per_s"])
    gains = ", ".join(f"{a['speaker']} {a['gain']:+.3f}" for a in losses)
    return dict(technique=f"multi-LoRA serving, {merged['batch_size']} requests over {k} adapters of rank {rank}",
                figure=f"one batched forward (BGMV) {'-' if ratio is None else f'{ratio:.1f}x'} the throughput of {k} "
                       f"merged copies, weights {batched['weights_mb']:.1f} MB against {merged['weights_mb']:.1f} MB; "
                       f"loss on its speaker's held-out turns, base minus adapter (above 0: it learned): {gains} "
                       "nats/char; the same tokens")


def summary_lines(losses, checks, n_trained, n_max):
    random_note = (f"; adapters {n_trained + 1}-{n_max}: random (same rank and targets; only their cost is measured)"
                   if n_max > n_trained else "")
    return [f"adapters 1-{n_trained}: LoRA trained on one speaker each{random_note}. weights_mb: parameters and "
            "buffers held; vs_merged: batched / merged throughput at the same number of adapters",
            *(f"{r['speaker']}: validation loss on its held-out turns {r['val_loss']:.4f} with its adapter, "
              f"{r['base_val_loss']:.4f} base ({r['gain']:+.4f} nats/char better); on the base model's training "
              f"split {r['train_split_loss']:.4f} against {r['train_split_base']:.4f} ({r['adapter']})"
              for r in losses),
            "checks: " + ", ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks.items())]


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    slices = {s: corpus.speaker_data(data, s, preset.seqlen) for s in args.speakers}  # bad names fail before training
    base = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    recipe = Recipe(args.rank, args.alpha, tuple(args.targets), args.lora_steps, args.lora_batch_size, args.lr, args.seed)
    n_max = max(max(args.adapter_counts), len(args.speakers))
    adapters, infos, adapters_seconds = all_adapters(base, data, slices, recipe, preset, n_max, files.rebuild_command(
        "main_multi_lora.py", argv, preset), save=not args.untrained)
    losses = adapter_losses(base, data, adapters, slices, infos, args.val_batches)
    merged_kv = [merge_adapter(base, a) for a in adapters]  # GPTlite_KVCache copies

    prompts = corpus.sample_prompts(data, args.batch_size, args.prompt_len, seed=args.seed, device=device)
    checks = check_tokens(base, adapters, merged_kv, prompts, args.n_tokens, preset.seqlen)
    peft_diffs = [i["peft_diff"] for i in infos if i["peft_diff"] is not None]
    if peft_diffs:
        checks["adapters out of peft give peft's logits (atol 1e-4)"] = max(peft_diffs) <= 1e-4
    harness.require_checks(checks)  # before anything is timed or written
    rows = sweep(base, adapters, merged_kv, prompts, sorted(set(args.adapter_counts)), args.n_tokens,
                 preset.seqlen, device, args.repeats)

    print(f"\nbatch {args.batch_size} requests (request i uses adapter i mod N), prompts of {args.prompt_len}, "
          f"{args.n_tokens} new tokens, median of {args.repeats} runs; LoRA rank {args.rank}, alpha {args.alpha:g}, "
          f"targets {' '.join(args.targets)}")
    loss_rows = [harness.make_row(r["speaker"], **{k: v for k, v in r.items() if k != "speaker"}) for r in losses]
    loss_title = (f"each adapter ({args.lora_steps} steps of batch {args.lora_batch_size}) on its speaker's held-out "
                  "turns: the last 20% of the speaker's lines in tiny Shakespeare's validation split; "
                  "train_split: the base's own data")
    harness.report(args, "main_multi_lora.py", preset, device, rows, headline(rows, losses, args.rank),
                   summary=summary_lines(losses, checks, len(args.speakers), n_max),
                   tables=[harness.table(loss_title, loss_rows)], plot=lambda: plot_results(rows, losses, preset, device),
                   rank=args.rank, alpha=args.alpha, targets=args.targets, lora_steps=args.lora_steps,
                   n_trained=len(args.speakers), adapter_losses=losses, checks=checks,
                   adapters_seconds=adapters_seconds)


if __name__ == "__main__":
    harness.run(main)
