"""Worker plumbing shared by the draft and target tiers: the session table (base checks, sync,
eviction), the dynamic batcher, the gRPC service base, settings and the process lifecycle.
Built on `specdec.engine` (models, KV) and `specdec.serving` (gRPC, settings, telemetry)."""
