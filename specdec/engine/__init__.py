"""The engine: Hugging Face models loaded from disk, and the KV state of their sessions.

How a session's KV is kept and rolled back, in one place:

- `kv.KVSession` — per worker and session: the token history the worker believes
  (`tokens`), and the KV of its first `kv_len` tokens in growable per-layer buffers. The
  committed length (what the coordinator's base says) and the computed-KV length are
  separate: the recovered/bonus token of a round is committed before its KV exists; it is
  fed, and its KV computed, at the start of the next round.
- Rollback is never a copy. `KVSession.sync(history)` adopts the committed history sent in
  a request's base and keeps KV only for the common prefix (rejected candidates are dropped
  there: invariant 3, no computation on a wrong history); `crop(n)` forgets everything past
  n after a verify pass. Both just move `kv_len` back, as gpt-fast indexes its cache by
  position.
- `session_attention` — on a CPU, a batched forward's attention reads each session's own
  buffers (one attention call per session and layer; the pass writes its new KV there
  first), so no batch copy of the KV exists: a batch whose sessions change from pass to
  pass copies nothing. Used where the model qualifies and a check at load agrees with the
  model's own attention (`--batch-attention`).
- `batch_kv.BatchKV` — otherwise (or `--batch-attention padded`) the batch's KV in
  [B, heads, capacity, dim] buffers kept across passes. A crop leaves holes that the
  attention mask hides; the same sessions coming back round after round copy nothing; any
  other batch is a fresh left-padded copy. A row is valid only while its session saw no
  other KV write (`KVSession.writes`).
- `model.ModelRuntime` — loads the model and tokenizer and runs ONE batched forward over
  sessions of different cached lengths.

Who calls what: `specdec.worker.session_table` resolves a request's base into a synced
`KVSession` (or refuses it: FAILED_PRECONDITION); the draft and target engines feed it and
crop it after verification.
"""
