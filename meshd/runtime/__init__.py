"""Model execution: layer-range shards, their KV state, and sampling."""
