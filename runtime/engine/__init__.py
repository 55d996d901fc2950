"""The engine: continuous batching over a paged KV cache (after vLLM v1 and nano-vllm).

`Scheduler` and `KVCacheManager` are plain Python (no torch); `ModelRunner` alone touches
devices; `Engine.step()` ties them together; `LLM` is the offline API and `AsyncEngine` the
server's. `validation` checks requests at the boundary and `isolation` keeps a request that
fails anyway from taking the engine down.
"""
