"""The mechanisms and the scaffolding behind the scripts, each module named by what it is.

Mechanisms: paged_engine (block manager, scheduler, model runner), serving (request traces, the serving
clock, latency figures), prefix_cache and semantic_cache (the stores), kv_budget (window, sinks, H2O,
SnapKV, Quest), moba, structured_decoding (XGrammar for GPTlite's characters), distributed (torchrun
helpers), disaggregation (the prefill and decode workers), attention_benchmark, memory_bound (read bandwidth, the
last-level cache, decode steps over a filled cache, TPOT against bytes per step).

Scaffolding: harness (flags, set-up, checks and the report: table, JSON, plot), presets, corpus (tiny
Shakespeare), training (the one training loop and the validation loss), files (atomic files, checkpoint
integrity), errors. Model loading, timing and evaluation are inference_utils.py, at the top level.
"""
