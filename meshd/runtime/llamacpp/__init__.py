"""llama.cpp as a shard's compute engine: GGUF layer ranges computed by ggml (``make native``)."""
