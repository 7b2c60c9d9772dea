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
    if c in "xu":
        n = 2 if c == "x" else 4
        return chr(int(src[i + 2:i + 2 + n], 16)), i + 2 + n
    return ESCAPES.get(c, c), i + 2


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
            negated = printed[i + 1] == "^"
            i += 2 if negated else 1
            members = []
            while printed[i] != "]":
                low, i = read_char(printed, i)
                high = low
                if printed[i] == "-" and printed[i + 1] != "]":
                    high, i = read_char(printed, i + 1)
                members.append((low, high))
            i += 1
            if not negated:
                chars.update(chr(c) for low, high in members for c in range(ord(low), ord(high) + 1))
        else:
            i += 1
    return chars


class CharGrammar:
    """A grammar compiled by XGrammar for a character vocabulary (`vocab[i]` is token i).

    kind "ebnf" or "regex". Raises ValueError, before any decoding, when the grammar does not parse or
    writes a character outside the vocabulary (GPTlite could never produce it)."""

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
            raise ValueError(f"the grammar writes {outside}, characters outside GPTlite's vocabulary (the "
                             f"{len(vocab)} characters of tiny Shakespeare): write it with the corpus's characters")
        self.source, self.kind, self.vocab = source, kind, vocab
        info = xgr.TokenizerInfo(list(vocab), stop_token_ids=[])  # no end token: the grammar's end stops
        self.compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar)
        self.python_regex = re.compile(source) if kind == "regex" else None

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
        that is not a multiple of 32 (GPTlite's 65), writes -inf one element past the end of the row it
        masks (into the next row's newline logit, or past the tensor)."""
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
