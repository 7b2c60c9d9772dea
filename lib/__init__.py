"""The mechanisms and the scaffolding behind the scripts, each module named by what it is, one line each.

Mechanisms:
- attention_benchmark: the long-context attention functions alone (main_flash_attention.py).
- attention_summary: the post's summary of attention methods, one measured row per method.
- compiled: the static-shape prefill and decode step, for torch.compile and AOTInductor.
- disaggregation: prefill and decode on separate workers, the KV cache handed over.
- distributed: torch.distributed helpers of the multi-process scripts (torchrun, gloo or NCCL).
- draft_heads: Medusa's heads and EAGLE's one-block head, reading the target's hidden states.
- dsa, moba, nsa, sla: the sparse attentions beside their models (gptlite_dsa.py, ...): training, costs, decode steps.
- engines: GPTlite's weights in Hugging Face transformers and CTranslate2.
- fast_decode (and fast_decode.cpp): the fast decode path, the cached forward pass as one C++ call.
- kv_budget: window, sinks, H2O, SnapKV, Quest: which cached tokens a decode step attends to.
- llamacpp: GPTlite as a GPT-2 GGUF file for llama.cpp (exact through its GELU graph), quantized and decoded there.
- lora_peft: LoRA adapters trained with peft, taken out into gptlite_lora's LoRAAdapter.
- memory_bound: read bandwidth, the last-level cache, decode steps over a filled cache, TPOT against bytes.
- offload: weights in a slow tier, each block streamed in (ZeRO-Inference's way).
- paged_engine: the serving engine (block manager, scheduler, model runner) over a paged KV cache.
- prefix_cache: the keys and values of a prompt's beginning reused across requests.
- quantization: weights, activations and KV cache in fewer bits (RTN, GPTQ, AWQ, W8A8, FP8, KIVI).
- recall: multi-query associative recall, the task that tells softmax from linear attention.
- semantic_cache: answers reused for queries that mean the same (FAISS, sentence-transformers).
- serving: what every batching scheduler shares: request checks, traces, the clock, latency figures.
- speculative: speculative decoding's loop and its drafters (a model, heads, lookup).
- structured_decoding: XGrammar grammars over GPTlite's characters.
- vllm_peer, vllm_worker: vLLM's CPU engine on the same weights and traces, run in its own environment.

Scaffolding:
- corpus: tiny Shakespeare at character level, its batches and prompts.
- errors: the repository's errors, each saying what to do.
- files: atomic files (temp file, then rename) and checkpoint integrity.
- harness: the script skeleton: flags checked before any work, set-up, checks, the report (table, JSON, plot).
- presets: the model presets, and the student of a preset.
- training: the one AdamW training loop, the validation loss, and the losses of trained variants (MoE).
- variant_checkpoints: the model variants' checkpoints (rotary, start-token, MoE, GQA): trained, loaded.

Model loading, timing and evaluation are inference_utils.py, at the top level.
"""
