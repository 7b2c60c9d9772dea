"""GPTlite's prefill and decode step with static shapes, for torch.compile and AOTInductor.

Blog: part 2 ("kernel fusion and compilers"). GPTlite_KVCache with a StaticKVCache attends over
`keys.narrow(2, 0, n)`, a view whose length n grows every step: a compiler sees a new shape each token
and recompiles (or goes dynamic). `StaticStep` takes the whole preallocated buffers and the positions
as tensors instead, writes the new keys and values with index_copy_ and attends over every slot with a
mask (slot s is seen by the token at position p when s <= p): the shapes are the same at every step, so
one graph serves all of them (one for the prefill's T = prompt length, one for the decode's T = 1).
The module holds no weights of its own: it reads the GPTlite_KVCache it wraps.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import inference_utils as iu
from gptlite import decode_loop

# The compile variants: name -> (torch.compile's mode, Inductor config patches, needs CUDA).
# AOTInductor is not here: it is not torch.compile but export + an ahead-of-time package (aoti_package).
COMPILE_MODES = {
    "default": (None, {}, False),
    "cpp-wrapper+freezing": (None, {"cpp_wrapper": True, "freezing": True}, False),
    "max-autotune": ("max-autotune-no-cudagraphs", {}, False),
    "reduce-overhead": ("reduce-overhead", {}, True),  # CUDA graphs: CUDA only
}


class StaticStep(nn.Module):
    """One forward pass of T new tokens at static shapes: (tokens [B, T], positions [T], keys, values
    [L, B, H, S, D], written in place) -> the greedy next token [B, 1]."""

    def __init__(self, model):
        super().__init__()
        self.model = model  # a GPTlite_KVCache in eval mode: its modules and weights, nothing copied

    def forward(self, tokens, positions, keys, values):
        model = self.model
        S = keys.shape[3]
        # [T, S]: the token at position p sees slots 0 .. p (the causal mask over the whole buffer)
        mask = torch.arange(S, device=tokens.device)[None, :] <= positions[:, None]
        x = model.token_embedding(tokens) + model.position_embedding(positions)  # [B, T, d_model]
        for layer, block in enumerate(model.blocks):
            mha = block.mha
            h = block.ln1(x)
            q = mha.split_heads(mha.query_proj(h))  # [B, H, T, D]
            keys[layer].index_copy_(2, positions, mha.split_heads(mha.key_proj(h)))  # in place: [B, H, S, D]
            values[layer].index_copy_(2, positions, mha.split_heads(mha.value_proj(h)))
            scores = q @ keys[layer].transpose(-2, -1) / mha.d_head**0.5  # [B, H, T, S]
            weights = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            x = x + mha.out_proj(mha.merge_heads(weights @ values[layer]))  # [B, T, d_model]
            x = x + block.ffwd(block.ln2(x))
        logits = model.fc_out(model.ln(x[:, -1]))  # [B, vocab]: only the last token's
        return logits.argmax(dim=-1, keepdim=True)  # [B, 1]


def new_buffers(model, batch_size):
    """Zeroed key and value buffers [L, B, H, seqlen, D] for `model` (stale slots are masked out)."""
    c, p = model.config, model.fc_out.weight
    shape = (c.n_layers, batch_size, c.n_heads, c.seqlen, c.d_head)
    return torch.zeros(shape, device=p.device, dtype=p.dtype), torch.zeros(shape, device=p.device, dtype=p.dtype)


@torch.inference_mode()
def generate_static(step, prompt, n_tokens, keys, values):
    """Greedy decoding through `step` (StaticStep, compiled or not, or an AOTI runner taking the same
    arguments) on the preallocated buffers, overwritten from slot 0. prompt [B, P]; the prompt and the
    new tokens must fit the buffers. Returns [B, P + n_tokens], as generate_kvcache."""
    position = 0  # of the first token not yet in the buffers

    def step_at(tokens):  # [B, T] -> the next token [B, 1]: the step samples itself (greedy, in its graph)
        nonlocal position
        positions = torch.arange(position, position + tokens.shape[1], device=tokens.device)
        position += tokens.shape[1]
        return step(tokens, positions, keys, values)
    return torch.cat([prompt, decode_loop(step_at, prompt, n_tokens, sample=lambda token: token)], dim=1)


def compile_step(model, mode):
    """torch.compile of a StaticStep of `model` in one of COMPILE_MODES; the Inductor options apply to
    this function's compiles only (passed to torch.compile, not set globally)."""
    compile_mode, patches, _ = COMPILE_MODES[mode]
    step = StaticStep(model)
    if patches:
        return torch.compile(step, options=patches, fullgraph=True, dynamic=False)
    return torch.compile(step, mode=compile_mode, fullgraph=True, dynamic=False)


def compiled_generation(model, mode, prompt, n_tokens):
    """Compile `mode` on this prompt's shapes by running one generation: (generate(n) -> tokens, compile
    seconds, graphs compiled). The seconds are those of that first, cold generation (each graph compiles
    on its first call); graphs is the rise of torch._dynamo's unique_graphs counter: 2, prefill and
    decode, when no decode position recompiled."""
    import torch._dynamo
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    step = compile_step(model, mode)
    keys, values = new_buffers(model, prompt.shape[0])
    # every mode compiles StaticStep.forward again (its own module and backend): 2 graphs a mode, past
    # dynamo's default limit of 8 graphs per function when several modes run on one shape
    with iu.Timer() as compiling, torch._dynamo.config.patch(recompile_limit=64):
        generate_static(step, prompt, n_tokens, keys, values)
    return ((lambda n: generate_static(step, prompt, n, keys, values)), compiling.seconds,
            stats["unique_graphs"] - before)


def aoti_package(model, batch_size, prompt_len, path):
    """Export the prefill (T = prompt_len) and the decode step (T = 1) at batch `batch_size` and compile
    both ahead of time into AOTInductor packages path-prefill.pt2 and path-decode.pt2; returns the two
    loaded runners (C++ that runs without the Python model code) and the seconds it took."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package
    step = StaticStep(model).eval()
    keys, values = new_buffers(model, batch_size)
    device = keys.device
    runners = []
    with iu.Timer() as compiling:
        for name, T in (("prefill", prompt_len), ("decode", 1)):
            args = (torch.zeros(batch_size, T, dtype=torch.long, device=device), torch.arange(T, device=device),
                    keys, values)
            with torch.no_grad():
                program = torch.export.export(step, args, strict=False)
            runners.append(aoti_load_package(aoti_compile_and_package(program, package_path=f"{path}-{name}.pt2")))
    return runners, compiling.seconds


def aoti_generation(runners, prompt, keys, values):
    """generate(n) through the two AOTI runners: prefill for the prompt's length, decode for T = 1."""
    prefill, decode = runners

    def step(tokens, positions, keys, values):
        return (prefill if tokens.shape[1] > 1 else decode)(tokens, positions, keys, values)
    return lambda n: generate_static(step, prompt, n, keys, values)
