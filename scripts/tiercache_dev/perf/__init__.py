"""perf_analyzer runs against a real tritonserver: `run` (`make perf`), `kv_prefix` (TTFT with
prefix KV reuse on and off), `soak` (minutes on a realistic mix, and the three-server
comparison); `analyzer` holds the perf_analyzer helpers they share, `make_inputs` builds an
`--input-data` file."""
