"""Data: tiny Shakespeare at character level (first 90% train, last 10%
validation), with fixed-seed batches and prompts."""
import functools
import hashlib
import http.client
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from lib.errors import DataError, GPTliteError
from lib.files import ROOT, atomic_write_bytes

DATA_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DATA_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DATA_BYTES = 1_115_394
DEFAULT_DATA = ROOT / "data" / "tinyshakespeare.txt"


def data_help():
    return ("Give the tiny Shakespeare file in one of three ways: --data PATH, the GPTLITE_DATA "
            f"environment variable, or {DEFAULT_DATA} (downloaded from {DATA_URL} when missing and online).")


@dataclass
class Data:
    vocab: str           # the sorted characters; token id = index
    train: torch.Tensor  # [N_train] token ids
    val: torch.Tensor    # [N_val] token ids

    def encode(self, text):
        unknown = sorted(set(text) - set(self.vocab))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the tiny Shakespeare vocabulary")
        index = {c: i for i, c in enumerate(self.vocab)}
        return [index[c] for c in text]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    @functools.cached_property
    def val_text(self):
        """The validation split as text, decoded once."""
        return self.decode(self.val.tolist())


def _download(path):
    """Fetch the canonical file into `path`; only a file with the right hash is ever put there."""
    try:
        with urllib.request.urlopen(DATA_URL, timeout=30) as response:
            raw = response.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise DataError(f"no data file found and the download failed ({e}). {data_help()}") from None
    if hashlib.sha256(raw).hexdigest() != DATA_SHA256:
        raise DataError(f"the downloaded file is not the canonical tiny Shakespeare (sha256 differs). {data_help()}")
    try:
        atomic_write_bytes(raw, path)
    except OSError as e:
        raise DataError(f"downloaded tiny Shakespeare but cannot write it to {path} ({e}). {data_help()}") from None


def load_data(path=None):
    """Load tiny Shakespeare from `path`, else $GPTLITE_DATA, else data/ (downloading it there)."""
    if path:
        path, source = Path(path), "--data"
    elif os.environ.get("GPTLITE_DATA"):
        path, source = Path(os.environ["GPTLITE_DATA"]), "GPTLITE_DATA"
    else:
        path, source = DEFAULT_DATA, None
    try:
        if not path.is_file():
            if source is not None:  # an explicit path that is wrong is an error, not a reason to download
                raise DataError(f"{source} points at {path}, which is not a file. {data_help()}")
            _download(path)
        raw = path.read_bytes()
    except OSError as e:  # permission denied, a folder in the way, ...
        raise DataError(f"cannot read {path} ({e}). {data_help()}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DATA_SHA256:  # before decoding: a file that is not UTF-8 fails here, with what to do
        raise DataError(f"{path} is not the canonical tiny Shakespeare ({len(raw):,} bytes, sha256 {digest}; "
                        f"expected {DATA_BYTES:,} bytes, sha256 {DATA_SHA256}). Replace it. {data_help()}")
    text = raw.decode("ascii")  # the canonical file is ASCII: the hash above guarantees it
    vocab = "".join(sorted(set(text)))
    table = torch.zeros(256, dtype=torch.long)  # byte -> token id (the canonical file is ASCII)
    for i, c in enumerate(vocab):
        table[ord(c)] = i
    tokens = table[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]
    n_train = int(0.9 * len(tokens))
    return Data(vocab=vocab, train=tokens[:n_train], val=tokens[n_train:])


def get_batch(tokens, batch_size, seqlen, generator=None, device="cpu"):
    """Random windows of `tokens`: inputs and next-token targets, each [batch_size, seqlen]."""
    starts = torch.randint(len(tokens) - seqlen - 1, (batch_size,), generator=generator)
    x = torch.stack([tokens[s:s + seqlen] for s in starts])
    y = torch.stack([tokens[s + 1:s + seqlen + 1] for s in starts])
    return x.to(device), y.to(device)


def sample_prompts(data, n_prompts, length, seed=0, device="cpu"):
    """`n_prompts` windows of `length` characters from the validation split: [n_prompts, length]."""
    if not 1 <= length < len(data.val):
        raise ValueError(f"prompt length must be between 1 and {len(data.val) - 1}, got {length}")
    generator = torch.Generator().manual_seed(seed)
    return get_batch(data.val, n_prompts, length, generator, device)[0]



# ----------------------------------------------------------------------------------------------------
# Documents with a start token, the way LLMs are trained (main_sparse_attention's start-token model):
# a document is a speaker turn, a blank-line-separated paragraph that begins "NAME:"; every training
# sequence starts with the reserved start token at position 0, then a document from its first character,
# and, when the document is shorter than the window, the next documents, each after its own start token.

IGNORE = -100  # F.cross_entropy's ignore_index: the target after a document, which would be the start token


def document_starts(tokens, newline_id):
    """Indices of `tokens` [N] where a document begins: right after a blank line ("\\n\\n"). The split's own
    first character is not one (it may be mid-turn); a turn is the text up to the next start. [n_docs]"""
    nl = tokens == newline_id
    after_blank = nl[:-2] & nl[1:-1] & ~nl[2:]  # "\n\n" then a character that is not "\n"
    return torch.nonzero(after_blank).flatten() + 2


def document_sequence(tokens, starts, doc, start_id, length):
    """`length` tokens: start token, document `doc` from its start, then the next documents, each after its own
    start token, cut at `length`. [length]"""
    pieces, n = [], 0
    while n < length:
        if doc >= len(starts):
            raise ValueError(f"the documents after document {doc - len(pieces) // 2} are shorter than {length} tokens")
        end = starts[doc + 1] if doc + 1 < len(starts) else len(tokens)
        pieces += [torch.tensor([start_id]), tokens[starts[doc]:end]]
        n += 1 + int(end - starts[doc])
        doc += 1
    return torch.cat(pieces)[:length]


def document_batch(tokens, starts, start_id, batch_size, seqlen, generator=None, device="cpu"):
    """Inputs and targets [batch_size, seqlen], each sequence packed from a random document (seeded by
    `generator`) among those followed by enough text: position 0 of every input is the start token; a target
    that would be the start token is IGNORE (the start token is never predicted)."""
    n_docs = int((starts + seqlen + 1 <= len(tokens)).sum())  # those with a whole sequence of text after them
    if n_docs == 0:
        raise ValueError(f"no document has {seqlen + 1} tokens of text after its start")
    docs = torch.randint(n_docs, (batch_size,), generator=generator)
    seqs = torch.stack([document_sequence(tokens, starts, int(d), start_id, seqlen + 1) for d in docs])
    x, y = seqs[:, :-1], seqs[:, 1:].clone()
    y[y == start_id] = IGNORE
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------------------------------
# Slices of the corpus: the turns of one speaker.

def speaker_turns(text, speaker):
    """Every turn of `speaker` ("NAME:\\n" then the lines), in corpus order, joined by blank lines."""
    turns = [t for t in text.split("\n\n") if t.startswith(f"{speaker}:\n")]
    return "\n\n".join(turns)


def speakers_by_text(text):
    """Speaker names by characters spoken, most first."""
    counts = {}
    for turn in text.split("\n\n"):
        m = re.match(r"([A-Za-z' ]+):\n", turn)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + len(turn)
    return sorted(counts, key=counts.get, reverse=True)


def speaker_data(data, speaker, seqlen, min_windows=8):
    """A Data of one speaker's turns in tiny Shakespeare's validation split (text the base model never
    trained on): the first 80% to fine-tune on, the last 20% to validate on. An unknown name or too little
    text is a clear error."""
    text = data.val_text
    turns = speaker_turns(text, speaker)
    if not turns:
        raise GPTliteError(f"no speaker {speaker!r} in tiny Shakespeare's validation split (names are upper case "
                              f"as in the text); the most lines: {', '.join(speakers_by_text(text)[:8])}")
    n_train = int(0.8 * len(turns))
    if len(turns) - n_train < min_windows + seqlen + 1:
        raise GPTliteError(f"speaker {speaker!r} has {len(turns):,} characters in the validation split, too few "
                              f"for held-out windows of {seqlen}; pick one with more lines, e.g. "
                              f"{', '.join(speakers_by_text(text)[:4])}")
    tokens = torch.tensor(data.encode(turns))
    return Data(vocab=data.vocab, train=tokens[:n_train], val=tokens[n_train:])


def slug(speaker):
    return re.sub(r"[^a-z0-9]+", "_", speaker.lower()).strip("_")
