"""GPTlite in llama.cpp: the model written as a GPT-2 GGUF file, quantized by llama.cpp to Q8_0 and Q4_0, decoded
greedily through llama-cpp-python.

Blog: part 2 (quantization). llama.cpp's GPT-2 graph (its src/models/gpt2.cpp) is GPTlite's but for three things,
each made exact here, on the same weights:
- Its MLP is GELU, hard-coded; GPTlite's is ReLU. ggml's GELU returns x itself for x >= 10 and 0 for x <= -10,
  so the residual stream is carried SCALE = 2^14 times larger: the embeddings, the attention's output projection
  and the MLP's first layer (weights and biases) and the MLP's second bias are multiplied by SCALE, every
  LayerNorm's epsilon by SCALE^2 (LN(s x, eps s^2) = LN(x, eps): the norms give the unscaled values). The
  GELU then sees s z, equal to ReLU's s max(z, 0) unless |z| < 10 / s (6e-4), and the second layer returns
  s times GPTlite's output. A power of two scales every float exactly. Q8_0 and Q4_0 keep one float16 scale
  per 32 weights; 2^14 keeps those scales inside float16's range.
- GPT-2's head has no bias: folded into the final LayerNorm's shift (lib/engines.folded_norm_bias).
- Its heads are d_model / d_head wide in all: GPTlite's gptlite preset has 6 heads of 64 in a model 512 wide, so
  zero heads are added (zero query, key and value rows, zero output columns): 8 heads of 64, the extra two
  contributing exactly nothing, and llama.cpp reads their zeros (bytes_per_token counts them).
The vocabulary is the 65 characters, written as a SentencePiece-style list (space as U+2581, newline as the
byte token <0x0A>); llama.cpp's tokenizer is never used: prompts go in as token ids.
"""
import os
import signal
import subprocess
import sys

import numpy as np
import torch

import inference_utils as iu
from lib import engines

SCALE = 2.0**14
FTYPES = {"f32": 0, "q8_0": 7, "q4_0": 2}  # llama.cpp's LLAMA_FTYPE_ALL_F32, MOSTLY_Q8_0, MOSTLY_Q4_0
INSTALL = "-r requirements-llamacpp.txt"
SOURCE_KEY = "gptlite.source"  # the GGUF key naming the model a file was written from


def check_portable(config):
    """A ValueError when llama.cpp's GPT-2 graph cannot express this GPTlite config."""
    if config.d_model % config.d_head or config.n_heads * config.d_head > config.d_model:
        raise ValueError(f"llama.cpp's GPT-2 heads are d_model / d_head wide: {config.n_heads} heads of {config.d_head} "
                         f"do not pad to a model {config.d_model} wide")
    if config.vocab_size > config.d_model:
        raise ValueError("the head's bias folds into the final LayerNorm only when vocab_size <= d_model")


def padded_heads(config):
    """The heads llama.cpp runs: d_model / d_head (GPTlite's heads, then zero heads)."""
    return config.d_model // config.d_head


@torch.no_grad()
def gguf_tensors(model, scale=SCALE):
    """{GGUF tensor name: float32 array} of GPTlite `model` in llama.cpp's GPT-2 layout (arrays [out, in], as
    nn.Linear's: GGUF lists the dimensions the other way round), scaled, padded and folded as the docstring says."""
    c = model.config
    check_portable(c)
    width = padded_heads(c) * c.d_head  # = d_model

    def pad_rows(t):  # [H * D, ...] -> [d_model, ...]: zero heads after GPTlite's
        return torch.cat([t, t.new_zeros(width - t.shape[0], *t.shape[1:])])

    out = {"token_embd.weight": model.token_embedding.weight * scale,  # [V, d]
           "position_embd.weight": model.position_embedding.weight * scale,  # [seqlen, d]
           "output_norm.weight": model.ln.weight, "output_norm.bias": engines.folded_norm_bias(model),
           "output.weight": model.fc_out.weight}  # [V, d]
    for i, block in enumerate(model.blocks):
        mha, (fc1, _, fc2, _) = block.mha, block.ffwd.net
        qkv = (mha.query_proj, mha.key_proj, mha.value_proj)
        out |= {f"blk.{i}.attn_norm.weight": block.ln1.weight, f"blk.{i}.attn_norm.bias": block.ln1.bias,
                f"blk.{i}.attn_qkv.weight": torch.cat([pad_rows(p.weight) for p in qkv]),  # [3 d, d]
                f"blk.{i}.attn_qkv.bias": torch.cat([pad_rows(p.bias) for p in qkv]),
                f"blk.{i}.attn_output.weight": pad_rows(mha.out_proj.weight.T).T * scale,  # [d, d]
                f"blk.{i}.attn_output.bias": mha.out_proj.bias * scale,
                f"blk.{i}.ffn_norm.weight": block.ln2.weight, f"blk.{i}.ffn_norm.bias": block.ln2.bias,
                f"blk.{i}.ffn_up.weight": fc1.weight * scale, f"blk.{i}.ffn_up.bias": fc1.bias * scale,  # [4 d, d]
                f"blk.{i}.ffn_down.weight": fc2.weight, f"blk.{i}.ffn_down.bias": fc2.bias * scale}  # [d, 4 d]
    return {name: t.detach().float().cpu().contiguous().numpy() for name, t in out.items()}


def vocab_pieces(vocab):
    """(pieces, token types) of the characters `vocab` in SentencePiece's spelling (1: normal, 6: byte)."""
    pieces = ["<0x0A>" if ch == "\n" else "\u2581" if ch == " " else ch for ch in vocab]
    return pieces, [6 if ch == "\n" else 1 for ch in vocab]


def write_gguf(model, vocab, path, source="GPTlite", scale=SCALE):
    """Write GPTlite `model` as a float32 GPT-2 GGUF file at `path` (a temporary file, then renamed): its
    hyperparameters, the characters `vocab` and `source` (a name for the weights, checked by read_config)."""
    import gguf
    c = model.config
    if len(vocab) != c.vocab_size:
        raise ValueError(f"the vocabulary has {len(vocab)} characters, the model {c.vocab_size} tokens")
    if not source:
        raise ValueError("source names the weights in the file: give a non-empty string")
    tensors = gguf_tensors(model, scale)
    tmp = f"{path}.tmp"
    writer = gguf.GGUFWriter(tmp, arch="gpt2")
    writer.add_name("GPTlite")
    writer.add_context_length(c.seqlen)
    writer.add_embedding_length(c.d_model)
    writer.add_block_count(c.n_layers)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(padded_heads(c))
    writer.add_layer_norm_eps(model.ln.eps * scale**2)
    writer.add_file_type(FTYPES["f32"])
    writer.add_string(SOURCE_KEY, source)
    pieces, types = vocab_pieces(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * len(pieces))
    writer.add_token_types(types)
    writer.add_add_bos_token(False)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, path)
    return path


def read_config(path):
    """(the GGUF file's gpt2 hyperparameters as a dict, its source string, {tensor name: bytes}); a ValueError that
    names the file when it is not a GGUF file of this module's writing."""
    import gguf
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001 (a damaged file raises whatever its first bad field gives)
        raise ValueError(f"{path} is not a readable GGUF file ({type(error).__name__}: {error}); delete it") from None

    def value(key):
        field = reader.fields.get(key)
        if field is None:
            raise ValueError(f"{path} has no {key}: not a GPTlite GGUF file of lib/llamacpp.write_gguf")
        return field.contents()

    config = {key: value(f"gpt2.{key}") for key in ("context_length", "embedding_length", "block_count",
                                                    "feed_forward_length", "attention.head_count")}
    config["vocab_size"] = len(value("tokenizer.ggml.tokens"))
    return config, value(SOURCE_KEY), {t.name: int(t.n_bytes) for t in reader.tensors}


def quantize(src, dst, kind, threads=2):
    """llama.cpp's own quantizer (llama_model_quantize, the llama-quantize tool's call) from the float32 file `src`
    to `dst` in `kind` (a key of FTYPES), written to a temporary file, then renamed. It picks each tensor's type
    as llama-quantize does (the head, for one, in Q6_K or a fallback where its rows do not split into 256)."""
    if kind not in FTYPES:
        raise ValueError(f"llama.cpp quantization {kind!r}: choose one of {', '.join(FTYPES)}")
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = FTYPES[kind], threads
    tmp = f"{dst}.tmp"
    with iu.stderr_silenced():  # llama.cpp logs every tensor from C
        status = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params)
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {kind} (status {status})")
    os.replace(tmp, dst)
    return dst


def load(path, n_ctx, threads):
    """A llama_cpp.Llama over the GGUF file `path`: a window of n_ctx tokens, `threads` threads, a float32 KV cache
    (as ours), no flash attention, one batch for the whole prompt."""
    from llama_cpp import Llama
    with iu.stderr_silenced():  # llama.cpp logs every tensor from C
        return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                     n_threads_batch=threads, type_k=0, type_v=0, flash_attn=False, verbose=False)


PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]), verbose=False)
llm.eval([0, 1])
"""


def probe(path, n_ctx, threads, timeout=120):
    """None when llama.cpp decodes two tokens of the GGUF file `path` in a child process, else the line that says
    how it failed. A native build can crash outright (on this project's Intel machines with AMX, llama.cpp's AMX
    kernels stop with a general protection fault on Q8_0 and Q4_0): a crash there must not take the script with it."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, path, str(n_ctx), str(threads)], capture_output=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not decode {os.path.basename(path)} within {timeout} s"
    if done.returncode == 0:
        return None
    how = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
           else f"exit status {done.returncode}: {done.stderr.decode(errors='replace').strip().splitlines()[-1:]}")
    return f"llama.cpp failed to decode {os.path.basename(path)} ({how})"


def last_logits(llm):
    """The logits [vocab] of the last token llm evaluated (llama.cpp's own buffer: Llama.eval keeps them only with
    logits_all)."""
    import llama_cpp
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def generate(llm, prompt, n_tokens):
    """Greedy decoding with llama.cpp: prompt [B, P] -> [B, P + n_tokens], one sequence at a time (its cache
    cleared before each), the argmax of the logits of the last token evaluated."""
    rows = []
    for row in prompt.tolist():
        llm.reset()
        llm.eval(row)
        new = []
        for i in range(n_tokens):
            new.append(int(np.argmax(last_logits(llm))))
            if i + 1 < n_tokens:
                llm.eval(new[-1:])
        rows.append(row + new)
    return torch.tensor(rows, dtype=torch.long)


def bytes_per_token(tensor_bytes, config, context):
    """Bytes a llama.cpp decoding step reads at batch 1: every tensor but the two embedding tables, one row of
    each of those, and the float32 KV cache of `context` tokens (its padded heads included)."""
    weights = sum(n for name, n in tensor_bytes.items() if not name.endswith("embd.weight"))
    weights += tensor_bytes["token_embd.weight"] // config["vocab_size"]
    weights += tensor_bytes["position_embd.weight"] // config["context_length"]
    kv = context * config["block_count"] * 2 * config["embedding_length"] * 4
    return weights, kv
