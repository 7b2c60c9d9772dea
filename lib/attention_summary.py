"""The post's summary of attention methods, measured: one row per method the repository runs.

Blog section: "Summary of attention methods". The post closes its attention part with a table (method,
exact?, needs training?, what it reduces, best for). Here every cell is a figure of a script's own run:
each attention script puts its methods' rows in its JSON (`attention_methods`, built with `method_row`),
and reproduce.py renders them, in the order of its runs, on docs/attention_summary.md (`full_table`) and
in the README (`short_table`). A row says:
- exact: whether the method computes softmax attention's outputs, and the figure that shows it (the
  largest difference to exact attention, or the validation-loss change against the exact model);
- training: the training steps the method needed here (0: applied to the trained checkpoint as it is);
- reduces: what it makes smaller and by how much, measured (bytes, FLOPs, KV cache, time);
- pays: the context length from which it pays on the machine of the run, or why it does not there.
"""
ORDER = ("main_flash_attention.py", "main_flash_decoding.py", "main_gqa.py", "main_mla.py", "main_sage_attention.py",
         "main_sparse_attention.py", "main_trainable_sparse.py", "main_linear_attention.py", "main_sla.py")  # the post's


def method_row(method, exact, difference, training_steps, training, reduces, reduction, pays):
    """One method's row: `exact` a bool, `training_steps` an int (0 = none), the others short strings, each
    stating a figure of the run (difference, reduction, pays) or naming what it is (training, reduces)."""
    if not isinstance(exact, bool) or isinstance(training_steps, bool) or not isinstance(training_steps, int) \
            or training_steps < 0:
        raise ValueError(f"{method}: exact must be a bool and training_steps an int >= 0, got {exact!r}, "
                         f"{training_steps!r}")
    texts = dict(method=method, difference=difference, training=training, reduces=reduces, reduction=reduction,
                 pays=pays)
    empty = [name for name, text in texts.items() if not isinstance(text, str) or not text]
    if empty:
        raise ValueError(f"{method}: give a non-empty string for {', '.join(empty)}")
    return dict(texts, exact=exact, training_steps=training_steps)


def ms(value):
    """A time in a cell: '-' where the run could not measure it (a TPOT below the timer's noise is None)."""
    return "-" if value is None else f"{value:.2f} ms"


def first_context_below(contexts, times, base_times):
    """The first context at which `times` is below `base_times` and stays below at every longer one
    (None: never, or not from some context on)."""
    below = [t is not None and b is not None and t < b for t, b in zip(times, base_times)]  # None: not measured
    for i, context in enumerate(contexts):
        if all(below[i:]):
            return context
    return None


def pays_from(contexts, times, base_times, what="time"):
    """The `pays` cell from a timed sweep: from which context the method's time is below the baseline's."""
    context = first_context_below(contexts, times, base_times)
    if context is None:
        return f"not up to {contexts[-1]:,} tokens here ({what} above the baseline's)"
    return f"from {context:,} tokens (the baseline's {what} / its: {base_times[-1] / times[-1]:.2f}x at {contexts[-1]:,})"


def rows_of(results):
    """[(script, row)] from {script: its JSON result}, in the post's order (ORDER; others after it, as given);
    results without rows are skipped."""
    scripts = sorted(results, key=lambda s: ORDER.index(s) if s in ORDER else len(ORDER))
    return [(script, row) for script in scripts for row in results[script].get("attention_methods") or []]


def full_table(results):
    """The page's table, every cell with its figure: (columns [(key, header, format)], rows), rendered by
    reproduce.py's markdown_table."""
    rows = [dict(method=row["method"], exact=("yes, " if row["exact"] else "no, ") + row["difference"],
                 training="none" if row["training_steps"] == 0 else row["training"],
                 reduces=f"{row['reduces']}: {row['reduction']}", pays=row["pays"], script=f"`{script}`")
            for script, row in rows_of(results)]
    columns = [("method", "method", "{}"), ("exact", "exact? (measured)", "{}"),
               ("training", "needs training? (here)", "{}"), ("reduces", "what it reduces (measured)", "{}"),
               ("pays", "where it pays here", "{}"), ("script", "script", "{}")]
    return columns, rows


def short_table(results):
    """The README's version, yes/no columns and what each method reduces: (columns, rows)."""
    rows = [dict(method=row["method"], exact="yes" if row["exact"] else "no",
                 training="no" if row["training_steps"] == 0 else f"yes ({row['training_steps']:,} steps)",
                 reduces=row["reduces"], script=f"`{script}`") for script, row in rows_of(results)]
    columns = [("method", "method", "{}"), ("exact", "exact?", "{}"), ("training", "needs training?", "{}"),
               ("reduces", "reduces", "{}"), ("script", "script", "{}")]
    return columns, rows
