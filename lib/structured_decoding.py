"""Grammars over GPTlite's character vocabulary, compiled by XGrammar, for main_structured_decoding.py.

XGrammar (the post's reference engine) takes any token list: here it is the 65 characters of tiny
Shakespeare, one token per character. A compiled grammar gives, at every step, the bitmask of the
characters that may come next, and the jump-forward string: the characters that are the only way on.

The three grammars of the script, in the corpus's own vocabulary (it has no braces, so no JSON):
- a play turn (EBNF): `SPEAKER:` on its own line, a name from a list of the corpus's speakers, then one
  to four verse lines and the blank line that ends a turn;
- a stage direction (EBNF): `Enter PETRUCHIO and GRUMIO.` and the like (the corpus has none);
- a one-line reply (regex): a speaker, then one sentence that ends with `.`, `!` or `?`; Python's `re`
  reads the same regex, a second judge of the outputs.
"""
import difflib
import re
from collections import Counter

import torch
import xgrammar as xgr

SPEAKER_LINE = re.compile(r"^([A-Z][A-Za-z ]*):\n", re.MULTILINE)  # a turn's heading in the corpus


def corpus_speakers(text):
    """Speaker names of `text` with their number of turns, most frequent first."""
    return Counter(SPEAKER_LINE.findall(text))


TURN = re.compile(r"^[A-Z][A-Za-z ]*:\n(?:.+\n)+\n", re.MULTILINE)  # heading, lines, the blank line


def corpus_turns(text):
    """(offset, turn) of every turn of `text`: the heading, its lines and the blank line after them."""
    return [(m.start(), m.group()) for m in TURN.finditer(text)]


def check_speakers(speakers, known):
    """Every name must head a turn of the corpus: an unknown one is a clear error, with close names."""
    if not speakers:
        raise ValueError("give at least one speaker name")
    for name in speakers:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; names are upper case, e.g. PETRUCHIO"
            raise ValueError(f"speaker {name!r} never speaks in tiny Shakespeare{hint}")


def alternatives(names):
    return " | ".join(f'"{name}"' for name in names)


def turn_grammar(speakers, max_lines=4, max_line_chars=64):
    """EBNF: a speaker's heading, 1..max_lines lines of at most max_line_chars, then the blank line."""
    return (f'root ::= speaker ":\\n" line{{1,{max_lines}}} "\\n"\n'
            f"speaker ::= {alternatives(speakers)}\n"
            f"line ::= [A-Z'] [^\\n]{{0,{max_line_chars - 1}}} \"\\n\"")


def stage_direction_grammar(speakers):
    """EBNF: Enter/Exit/Exeunt, optionally with the names of up to three speakers, then a full stop."""
    return ('root ::= ("Enter" | "Exit" | "Exeunt") names? ".\\n"\n'
            'names ::= " " speaker ((", " speaker)? " and " speaker)?\n'
            f"speaker ::= {alternatives(speakers)}")


def reply_regex(speakers, max_chars=64):
    """Regex: a speaker's heading and a one-line sentence that ends with . ! or ?"""
    names = "|".join(speakers)  # names are letters and spaces: no regex metacharacters
    return f"({names}):\\n[A-Z][^\\n]{{0,{max_chars - 2}}}[.!?]\\n"


# ----------------------------------------------------------------------------------------------------
# The characters a grammar writes must be characters GPTlite can write.

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0"}


def read_char(src, i):
    """The character at src[i] of XGrammar's printed grammar (escapes decoded) and the next index."""
    if src[i] != "\\":
        return src[i], i + 1
    c = src[i + 1]
    if c in "xuU":
        n = {"x": 2, "u": 4, "U": 8}[c]
        return chr(int(src[i + 2:i + 2 + n], 16)), i + 2 + n
    return ESCAPES.get(c, c), i + 2


def read_class(src, i):
    """The character class `[...]` or `[^...]` that starts at src[i]: ([(low, high) ranges], negated, the
    index after its closing bracket)."""
    negated = src[i + 1] == "^"
    i += 2 if negated else 1
    ranges = []
    while src[i] != "]":
        low, i = read_char(src, i)
        high = low
        if src[i] == "-" and src[i + 1] != "]":
            high, i = read_char(src, i + 1)
        ranges.append((low, high))
    return ranges, negated, i + 1


def grammar_characters(printed):
    """Characters of the string literals and of the positive character classes of a printed grammar
    (XGrammar's normal form). Negated classes ([^\\n]) are left out: they need only some vocabulary."""
    chars, i = set(), 0
    while i < len(printed):
        if printed[i] == '"':
            i += 1
            while printed[i] != '"':
                c, i = read_char(printed, i)
                chars.add(c)
            i += 1
        elif printed[i] == "[":
            members, negated, i = read_class(printed, i)
            if not negated:
                chars.update(chr(c) for low, high in members for c in range(ord(low), ord(high) + 1))
        else:
            i += 1
    return chars


# ----------------------------------------------------------------------------------------------------
# The shortest sentence: a grammar must have a non-empty one that fits the window and max_chars.

RULE = re.compile(r"([A-Za-z_][A-Za-z0-9_\-]*) ::= ")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
REPEAT = re.compile(r"\{(\d+), (-?\d+)\}")


def parse_printed(printed, vocab):
    """XGrammar's printed normal form -> (root name, {rule: expression}, has lookahead). Expressions:
    ("text", s), ("class", the vocabulary characters it allows, star), ("ref", rule), ("repeat",
    expression, least, most: -1 for no bound), ("seq", [...]), ("alt", [...]). A lookahead assertion
    `(=(...))` after a rule is skipped. A construct it does not know is a ValueError that says so."""
    rules, root, lookahead = {}, None, False
    for line in printed.splitlines():
        if not line.strip():
            continue
        head = RULE.match(line)
        if head is None:
            raise ValueError(f"cannot read XGrammar's printed rule {line!r} (a construct structured_decoding.py "
                             f"does not know yet)")
        expr, i = parse_alt(line, head.end(), vocab)
        if line[i:].lstrip().startswith("(="):  # a lookahead: what may follow the rule, not part of it
            lookahead, i = True, len(line)
        if i != len(line):
            raise ValueError(f"cannot read XGrammar's printed rule {line!r} at {i} (a construct "
                             f"structured_decoding.py does not know yet)")
        rules[head.group(1)] = expr
        root = root or head.group(1)
    return root, rules, lookahead


def parse_alt(src, i, vocab):
    options = []
    while True:
        seq, i = parse_seq(src, i, vocab)
        options.append(seq)
        j = i
        while j < len(src) and src[j] == " ":
            j += 1
        if j < len(src) and src[j] == "|":
            i = j + 1
            continue
        return ("alt", options), i


def parse_seq(src, i, vocab):
    items = []
    while True:
        while i < len(src) and src[i] == " ":
            i += 1
        if i == len(src) or src[i] in "|)" or src.startswith("(=", i):
            return ("seq", items), i
        c = src[i]
        if c == '"':
            chars, i = [], i + 1
            while src[i] != '"':
                ch, i = read_char(src, i)
                chars.append(ch)
            items.append(("text", "".join(chars)))
            i += 1
        elif c == "[":
            ranges, negated, i = read_class(src, i)
            star = i < len(src) and src[i] == "*"
            i += star
            allowed = "".join(ch for ch in vocab if any(lo <= ch <= hi for lo, hi in ranges) != negated)
            items.append(("class", allowed, star))
        elif c == "(":
            inner, i = parse_alt(src, i + 1, vocab)
            if i == len(src) or src[i] != ")":
                raise ValueError(f"cannot read XGrammar's printed grammar at {src[i:i + 20]!r} (a construct "
                                 f"structured_decoding.py does not know yet)")
            items.append(inner)
            i += 1
        else:
            name = NAME.match(src, i)
            if name is None:
                raise ValueError(f"cannot read XGrammar's printed grammar at {src[i:i + 20]!r} (a construct "
                                 f"structured_decoding.py does not know yet)")
            items.append(("ref", name.group()))
            i = name.end()
        repeat = REPEAT.match(src, i)  # {least, most} after a rule (or a group)
        if repeat:
            items[-1], i = ("repeat", items[-1], int(repeat.group(1)), int(repeat.group(2))), repeat.end()


def shorter(a, b):
    """The shorter of two witnesses (None: no sentence)."""
    return b if a is None or (b is not None and len(b) < len(a)) else a


def shortest_of(expr, table):
    """(the shortest sentence of `expr`, the shortest non-empty one), each None when there is none, with
    the rules' current (shortest, shortest non-empty) in `table`."""
    kind = expr[0]
    if kind == "text":
        return expr[1], expr[1] or None
    if kind == "class":
        _, allowed, star = expr
        one = allowed[:1] or None
        return ("" if star else one), one
    if kind == "ref":
        return table[expr[1]]
    if kind == "repeat":
        _, inner, least, most = expr
        empty, nonempty = shortest_of(inner, table)
        copies = max(least, 1)  # one non-empty copy, the others as short as they go
        all_shortest = "" if least == 0 else (None if empty is None else empty * least)
        if nonempty is None or (most != -1 and most < copies) or (copies > 1 and empty is None):
            return all_shortest, None
        return all_shortest, nonempty + empty * (copies - 1)
    parts = [shortest_of(e, table) for e in expr[1]]
    if kind == "alt":
        best, best_nonempty = None, None
        for empty, nonempty in parts:
            best, best_nonempty = shorter(best, empty), shorter(best_nonempty, nonempty)
        return best, best_nonempty
    # a sequence: every part at its shortest, or one part non-empty and the others at their shortest
    if any(empty is None for empty, _ in parts):
        return None, None
    best = "".join(empty for empty, _ in parts)
    best_nonempty = best or None
    for k, (_, nonempty) in enumerate(parts):
        if nonempty is not None:
            best_nonempty = shorter(best_nonempty, "".join(parts[j][0] if j != k else nonempty
                                                           for j in range(len(parts))))
    return best, best_nonempty


def shortest_sentence(printed, vocab):
    """(the shortest non-empty sentence of a printed grammar written with the characters of `vocab`, or
    None when it has none; whether the grammar has a lookahead). A fixed point over the rules, from "no
    sentence", as in Knuth's shortest derivations: each round recomputes every rule from the others and
    keeps a shorter witness, until nothing changes (lengths only fall, so it ends). Character classes
    count only their characters in the vocabulary; a lookahead is not read, so with one the length is a
    lower bound and the witness may be refused."""
    root, rules, lookahead = parse_printed(printed, vocab)
    table = {name: (None, None) for name in rules}  # every referenced rule is defined: XGrammar checked
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            new = shortest_of(expr, table)
            old = table[name]
            merged = (shorter(old[0], new[0]), shorter(old[1], new[1]))
            if merged != old:
                table[name], changed = merged, True
    return table[root][1], lookahead


class CharGrammar:
    """A grammar compiled by XGrammar for a character vocabulary (`vocab[i]` is token i).

    kind "ebnf" or "regex". Raises ValueError, before any decoding, when the grammar does not parse,
    writes a character outside the vocabulary (GPTlite could never produce it), or has no non-empty
    sentence in the vocabulary (an empty regex, `root ::= ""`, a class of characters all outside it: the
    decoder would meet a dead end after the prefill).

    .shortest is a shortest non-empty sentence and .min_chars its length: shortest_sentence's length
    is never above the true one (equal without lookahead assertions, which it does not read), and the
    engine accepts its witness here, so it is exact; when the engine refuses it (a lookahead), min_chars
    is a lower bound and .shortest None. constrained_generate refuses a prompt, window and max_chars
    the shortest sentence cannot fit in."""

    def __init__(self, source, vocab, kind="ebnf"):
        if kind not in ("ebnf", "regex"):
            raise ValueError(f"kind must be 'ebnf' or 'regex', got {kind!r}")
        try:
            grammar = xgr.Grammar.from_ebnf(source) if kind == "ebnf" else xgr.Grammar.from_regex(source)
        except RuntimeError as e:
            reason = re.sub(r"^\[[^\]]*\] \S+: ", "", str(e).strip().splitlines()[-1])  # drop XGrammar's source location
            raise ValueError(f"the {kind} grammar does not parse: {reason}") from None
        outside = sorted(grammar_characters(str(grammar)) - set(vocab))
        if outside:
            shown = repr(outside) if len(outside) <= 12 else f"{repr(outside[:12])[:-1]}, ... {len(outside)} in all]"
            raise ValueError(f"the grammar writes {shown}, characters outside GPTlite's vocabulary (the "
                             f"{len(vocab)} characters of tiny Shakespeare): write it with the corpus's characters")
        shortest, lookahead = shortest_sentence(str(grammar), vocab)
        if shortest is None:
            raise ValueError(f"the {kind} grammar {source!r} has no non-empty sentence written with GPTlite's "
                             f"{len(vocab)} characters (it accepts only the empty string, or nothing: a character "
                             f"class whose characters are all outside the vocabulary, a rule that never ends): "
                             f"constrained decoding could write nothing it accepts; give it at least one sentence")
        self.source, self.kind, self.vocab = source, kind, vocab
        info = xgr.TokenizerInfo(list(vocab), stop_token_ids=[])  # no end token: the grammar's end stops
        self.compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar)
        self.python_regex = re.compile(source) if kind == "regex" else None
        self.min_chars, self.shortest = len(shortest), shortest
        if not self.accepts(shortest):
            if not lookahead:  # shortest_sentence read the grammar wrong
                raise RuntimeError(f"the engine refuses {shortest!r}, the shortest sentence read from the grammar "
                                   f"{str(grammar)!r}: this is a bug of shortest_sentence")
            self.shortest = None  # min_chars: a lower bound (the lookahead was not read)

    def matcher(self):
        """A fresh matcher: one per sequence; it ends (is_terminated) when the grammar is complete."""
        return xgr.GrammarMatcher(self.compiled, terminate_without_stop_token=True)

    def encode(self, text):
        return [self.vocab.index(c) for c in text]

    def accepts(self, text):
        """The engine's verdict: `text` is a complete sentence of the grammar."""
        matcher = self.matcher()
        return matcher.accept_string(text) and matcher.is_completed()

    def new_bitmask(self):
        """A buffer for mask_logits: XGrammar's packed bitmask [1, ceil(vocab / 32)] int32."""
        return xgr.allocate_token_bitmask(1, len(self.vocab))

    def mask_logits(self, matcher, logits, bitmask):
        """Set the logits [1, vocab] of the characters the grammar forbids next to -inf, in place.
        The bits are unpacked here: xgrammar 0.2.9's CPU apply_token_bitmask_inplace, with a vocabulary
        that is not a multiple of 32 (GPTlite's 65), writes -inf one element past a row whose last character
        ('z') is allowed (the matcher leaves the bitmask's padding bits zero): into the next row's newline
        logit, or past the tensor. tests/test_structured_decoding.py shows it with the pinned version."""
        matcher.fill_next_token_bitmask(bitmask)
        return logits.masked_fill_(~unpack_bits(bitmask, len(self.vocab)).to(logits.device), float("-inf"))

    def mask_logits_along(self, logits, text):
        """Mask the logits [len(text), vocab] of a text the grammar accepts: row j with the grammar's
        mask after text[:j], in place."""
        matcher, bitmask = self.matcher(), xgr.allocate_token_bitmask(len(text), len(self.vocab))
        for j, c in enumerate(text):
            matcher.fill_next_token_bitmask(bitmask, index=j)
            if not matcher.accept_string(c):
                raise ValueError(f"the grammar does not accept {text[:j + 1]!r}")
        return logits.masked_fill_(~unpack_bits(bitmask, len(self.vocab)).to(logits.device), float("-inf"))


def unpack_bits(bitmask, n):
    """XGrammar's bitmask [rows, words] int32 -> bool [rows, n]: bit j of word w is token 32 w + j."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :n].bool()
