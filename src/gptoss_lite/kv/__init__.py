"""KV-cache storage and engineering: mixed ring/growing cache, paged pool, prefix cache, eviction."""
