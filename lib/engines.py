"""GPTlite's weights in inference engines: Hugging Face transformers (GPT2LMHeadModel) and CTranslate2.

Blog: part 2 ("kernel fusion and compilers"). GPTlite is a GPT-2 with a ReLU MLP and an untied head, so
GPT-2's classes express it when n_heads * d_head == d_model (GPT-2 derives the head width from n_embd;
both the cpu and the distilled presets qualify, the gptlite preset's 6 x 64 against 512 does not). One
difference remains: GPT-2's head has no bias and GPTlite's has one. Folded into the final LayerNorm's
shift: logits = W (ln(x) + beta') with W beta' = W beta + b, which has an exact solution when W
[vocab, d_model] has full row rank (vocab 65 < d_model): beta' = beta + pinv(W) b, in float64.
Each engine is optional: `missing(name)` names the package to install.
"""
import copy
import importlib.util
import os
import tempfile

import torch


def missing(package, install=None):
    """None when `package` imports, else the one line that says what to install (`install`: the pip
    arguments, default the package's name)."""
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install {install or package}): its rows are skipped"
    return None


def check_portable(config):
    """A ValueError when GPT-2 cannot express this GPTlite config."""
    if config.n_heads * config.d_head != config.d_model:
        raise ValueError(f"GPT-2 needs n_heads * d_head == d_model, got {config.n_heads} x {config.d_head} against "
                         f"{config.d_model}: this model has no GPT-2 port")
    if config.vocab_size > config.d_model:
        raise ValueError("the head's bias folds into the final LayerNorm only when vocab_size <= d_model")


@torch.no_grad()
def to_gpt2(model):
    """A transformers GPT2LMHeadModel (float32, eval) with the weights of the GPTlite `model`."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = model.config
    check_portable(c)
    hf_config = GPT2Config(vocab_size=c.vocab_size, n_positions=c.seqlen, n_embd=c.d_model, n_layer=c.n_layers,
                           n_head=c.n_heads, n_inner=c.d_ff, activation_function="relu", resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=model.ln.eps,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    hf = GPT2LMHeadModel(hf_config).eval()
    t = hf.transformer
    t.wte.weight.copy_(model.token_embedding.weight)
    t.wpe.weight.copy_(model.position_embedding.weight)
    for block, h in zip(model.blocks, t.h):
        mha, (fc1, _, fc2, _) = block.mha, block.ffwd.net
        for ours, theirs in ((block.ln1, h.ln_1), (block.ln2, h.ln_2)):
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
        # Conv1D stores weights [in, out], the transpose of nn.Linear's; c_attn is q, k, v side by side
        projections = (mha.query_proj, mha.key_proj, mha.value_proj)
        h.attn.c_attn.weight.copy_(torch.cat([p.weight.T for p in projections], dim=1))  # [d, 3 d]
        h.attn.c_attn.bias.copy_(torch.cat([p.bias for p in projections]))
        for ours, theirs in ((mha.out_proj, h.attn.c_proj), (fc1, h.mlp.c_fc), (fc2, h.mlp.c_proj)):
            theirs.weight.copy_(ours.weight.T)
            theirs.bias.copy_(ours.bias)
    t.ln_f.weight.copy_(model.ln.weight)
    t.ln_f.bias.copy_(folded_norm_bias(model))
    hf.lm_head.weight.copy_(model.fc_out.weight)
    return hf.to(model.fc_out.weight.device)


@torch.no_grad()
def folded_norm_bias(model):
    """The final LayerNorm's shift with the head's bias folded in: beta + pinv(W) b, computed in float64
    (logits = W (ln(x) + beta') equal W ln(x) + W beta + b when W [vocab, d_model] has full row rank)."""
    W, b = model.fc_out.weight.double(), model.fc_out.bias.double()  # [V, d], [V]
    return (model.ln.bias.double() + torch.linalg.pinv(W) @ b).to(model.ln.bias.dtype)


@torch.inference_mode()
def hf_generate(hf, prompt, n_tokens):
    """Greedy transformers generate: prompt [B, P] -> [B, P + n_tokens] (no end token: exactly n_tokens)."""
    prompt = prompt.to(hf.device)
    return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_tokens,
                       min_new_tokens=n_tokens, do_sample=False, num_beams=1).cpu()


def ct2_model(hf, quantization, out_dir):
    """Convert the GPT2LMHeadModel `hf` with CTranslate2's transformers loader (in memory: GPTlite has no
    tokenizer to save) into out_dir, "float32" or "int8" weights; returns out_dir. The vocabulary is the
    token ids written as strings."""
    from ctranslate2.converters.transformers import GPT2Loader
    # a copy: the spec's arrays share the weights' memory, and converting and quantizing them changes them
    spec = GPT2Loader().get_model_spec(copy.deepcopy(hf).cpu())
    spec.register_vocabulary([str(i) for i in range(hf.config.vocab_size)])
    spec.config.bos_token = spec.config.eos_token = spec.config.unk_token = "0"  # never ends: min_length below
    spec.validate()
    spec.optimize(quantization=quantization)
    os.makedirs(out_dir, exist_ok=True)
    spec.save(out_dir)
    return out_dir


def ct2_generator(model_dir, threads):
    import ctranslate2
    return ctranslate2.Generator(model_dir, device="cpu", intra_threads=threads)


def ct2_generate(generator, prompt, n_tokens):
    """Greedy CTranslate2 generation: prompt [B, P] (cpu LongTensor) -> [B, P + n_tokens]."""
    start = [[str(i) for i in row] for row in prompt.tolist()]
    results = generator.generate_batch(start, max_length=n_tokens, end_token=[], sampling_topk=1,
                                       include_prompt_in_result=False)
    new = torch.tensor([[int(t) for t in r.sequences[0]] for r in results], dtype=torch.long)  # [B, n_tokens]
    return torch.cat([prompt, new], dim=1)


def temp_dir():
    return tempfile.TemporaryDirectory(prefix="gptlite_engines_")
