"""The exact cache: canonical requests, scoped keys, the entry codec, stores, the tiered cache,
invalidation watermarks and messages, coalesced flights, cross-replica leases and the Redis tier."""
