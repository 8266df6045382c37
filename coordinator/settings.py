"""The coordinator's flags (each also SPECDEC_<FLAG>), as one settings dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.serving.security import APIKeys, ClientTLS, SecurityFlags, ServerTLS
from specdec.serving.settings import LOG_LEVELS, opt


@dataclass(frozen=True)
class CoordinatorSettings(SecurityFlags):
    tokenizer: str = opt(
        "smollm2-135m-instruct",
        "the target model's tokenizer: its directory, or a catalogued model name",
    )
    host: str = opt("127.0.0.1", "address to bind (0.0.0.0 in a container)")
    port: int = opt(50051, "gRPC port of the public API (0 = pick a free one)")
    redis_timeout_s: float = opt(
        1.0,
        "each Redis command and connect gives up after this long (at most half of --lease-s); "
        "a failed one is UNAVAILABLE to the client, which resumes",
    )
    redis_url: str = opt(
        "", "Redis for sessions and the worker registry (empty = embedded redis-server)"
    )
    draft_addr: str = opt(
        "", "comma-separated static draft worker addresses (besides the registry)"
    )
    target_addr: str = opt(
        "", "comma-separated static target worker addresses (besides the registry)"
    )
    discovery: str = opt(
        "redis",
        "where workers are found besides --draft-addr/--target-addr: redis (the registry they "
        "heartbeat into), kubernetes (the ready endpoints of EndpointSlices, --k8s-*), static "
        "(nowhere)",
        choices=["redis", "kubernetes", "static"],
    )
    kubeconfig: str = opt(
        "",
        "with --discovery kubernetes: kubeconfig file of the API server (empty = the pod's "
        "service account in a pod, else $KUBECONFIG or ~/.kube/config)",
    )
    k8s_namespace: str = opt(
        "", "namespace of the workers' EndpointSlices (empty = the pod's own, else default)"
    )
    k8s_draft_selector: str = opt(
        "",
        "label selector of the draft tier's EndpointSlices, e.g. "
        "kubernetes.io/service-name=specdec-draft-worker (required with --discovery kubernetes)",
    )
    k8s_target_selector: str = opt(
        "",
        "label selector of the target tier's EndpointSlices, e.g. "
        "kubernetes.io/service-name=specdec-target-worker (required with --discovery kubernetes)",
    )
    k8s_port_name: str = opt("grpc", "name of the EndpointSlice port the workers serve gRPC on")
    max_sessions: int = opt(
        256, "concurrent sessions this coordinator runs (RESOURCE_EXHAUSTED beyond)"
    )
    max_prompt_tokens: int = opt(4096, "longest prompt accepted (INVALID_ARGUMENT beyond)")
    max_prompt_bytes: int = opt(
        262144,
        "longest text prompt (or all chat messages' content) in UTF-8 bytes, checked before "
        "tokenising",
    )
    max_messages: int = opt(256, "most chat messages per request")
    max_stop_sequences: int = opt(16, "most stop strings per request")
    max_stop_length: int = opt(256, "longest stop string, in characters")
    max_stop_token_ids: int = opt(64, "most stop token ids per request")
    max_streams: int = opt(
        1024, "concurrent Generate/GenerateStream calls (RESOURCE_EXHAUSTED beyond)"
    )
    max_streams_per_session: int = opt(
        4, "concurrent streams attached to one session_id (RESOURCE_EXHAUSTED beyond)"
    )
    max_message_mb: int = opt(
        4, "largest gRPC message a client may send (RESOURCE_EXHAUSTED beyond)"
    )
    max_new_tokens: int = opt(4096, "largest sampling.max_new_tokens accepted")
    default_max_new_tokens: int = opt(256, "max_new_tokens when a request leaves it 0")
    max_speculative_tokens: int = opt(
        8, "largest γ: the adaptive policy's bound and the request limit"
    )
    lease_s: float = opt(
        3.0, "session lease TTL; another coordinator may take over after it expires"
    )
    session_ttl_s: int = opt(
        3600,
        "a session's keys expire this long after its last commit, lease renewal or takeover: "
        "a finished session stays readable this long, an abandoned running one goes away",
    )
    worker_timeout_s: float = opt(
        30.0, "deadline of a Verify call and of finding another target worker"
    )
    draft_timeout_s: float = opt(5.0, "deadline of a Propose call; past it the session fails over")
    fixed_gamma_wait_s: float = opt(
        30.0,
        "a session with a fixed γ whose draft tier is out waits this long for a draft before "
        "a target-only round (once per outage), so its γ schedule — and its seeded sampled "
        "text — stays that of a run without the outage (0 = never wait)",
    )
    pipeline: str = opt(
        "auto",
        "auto | on | off: draft the next block while the target verifies this one, used when "
        "every candidate and the guessed bonus token are accepted (auto: while this "
        "coordinator's verify batches average under 1.5 sessions, when the draft would idle)",
        ["auto", "on", "off"],
    )
    draft_confidence: float = opt(
        0.0,
        "the draft stops a block early after a candidate it gave less than this probability "
        "(q̃ of the candidate when sampling; its softmax at the argmax when greedy), so a "
        "round asks the target to verify only what the draft is sure of; lossless; 0 = off, "
        "always the whole γ (Hugging Face's assistant_confidence_threshold is this idea)",
    )
    worker_streams: bool = opt(
        True,
        "carry Propose and Verify calls on one long-lived stream per worker (about half the "
        "cost of a unary call at one request); --no-worker-streams makes unary calls",
    )
    prefill_threshold: int = opt(
        32,
        "a target that lacks more committed tokens than this gets a chunked Prefill first "
        "(so a new prompt does not pad a whole batch of decoding sessions to its length)",
    )
    max_starting: int = opt(
        16,
        "sessions in their first round (prompt prefill and first verify) at once; more wait "
        "their turn here, so a burst of new prompts never queues on a target past its deadline",
    )
    shed_verify_s: float = opt(
        10.0,
        "refuse new sessions (RESOURCE_EXHAUSTED) while verify steps (prefill included) take "
        "longer than this on average over the last 5 s: the target tier is past its capacity "
        "(0 = never)",
    )
    coordinator_id: str = opt("", "owner id in session leases (default: random)")
    grace_s: float = opt(10.0, "on SIGTERM, how long in-flight streams may finish")
    metrics_port: int = opt(0, "Prometheus metrics port (0 = off)")
    http_port: int = opt(
        -1,
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health); -1 = off, 0 = pick a free one",
    )
    served_model_name: str = opt(
        "", "the model id of the HTTP API (default: the --tokenizer name or directory name)"
    )
    log_level: str = opt("info", "debug | info | warning | error", choices=LOG_LEVELS)
    tls_client_ca: str = opt(
        "", "with --tls-cert: public-API clients must present a certificate signed by this CA"
    )
    worker_tls_cert: str = opt(
        "", "client certificate presented to workers with --tls-ca (default: --tls-cert)"
    )
    worker_tls_key: str = opt("", "private key of --worker-tls-cert (default: --tls-key)")
    tls_server_name: str = opt(
        "",
        "name every worker certificate must carry (default: the host of the worker's address; "
        "set it where workers register under pod IPs)",
    )
    api_keys_file: str = opt(
        "",
        "public RPCs need 'authorization: Bearer <key>' with a key of this file (one per line, "
        "or sha256:<hex>; re-read when it changes); empty = no keys",
    )

    def public_tls(self) -> ServerTLS | None:
        """The public API's TLS (mutual with --tls-client-ca), or None for plaintext."""
        if not self.tls_cert:
            return None
        return ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca)

    def worker_tls(self) -> ClientTLS | None:
        """How the coordinator calls workers: mTLS when --tls-ca is set, else plaintext."""
        if not self.tls_ca:
            return None
        return ClientTLS(
            ca=self.tls_ca,
            cert=self.worker_tls_cert or self.tls_cert,
            key=self.worker_tls_key or self.tls_key,
            server_name=self.tls_server_name,
        )

    def api_keys(self) -> APIKeys | None:
        return APIKeys(self.api_keys_file) if self.api_keys_file else None
