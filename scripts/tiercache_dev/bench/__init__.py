"""Benchmarks, one measurement each, run as `python -m tiercache_dev.bench.<name>`: the prompt
cache against two floors (`make bench`), the semantic cache (`make bench-semantic`), LoRA
adapters (`make bench-lora`), prefix KV reuse, invalidation, Redis warm-up, replicas and the
native shared tables. Figures come from `tiercache_dev.stats`; servers from
`tiercache_dev.servers`."""
