"""The schema of the three specdec tiers: the keys every tier has (probes, PDB, autoscaling,
scheduling), the workers' and the coordinator's own flags and keys."""

from __future__ import annotations

from schema_builders import (
    METRICS_PORT,
    PORT,
    REPLICAS,
    Schema,
    boolean,
    integer,
    k8s_list,
    k8s_object,
    number,
    obj,
    resources,
    string,
    string_map,
)

LOG_LEVELS = ["debug", "info", "warning", "error"]


def image_override() -> Schema:
    return obj({"repository": string(), "tag": string()}, "per-tier image override")


def probe() -> Schema:
    return obj(
        {
            "initialDelaySeconds": integer(0),
            "periodSeconds": integer(1),
            "timeoutSeconds": integer(1),
            "failureThreshold": integer(1),
            "successThreshold": integer(1),
            "terminationGracePeriodSeconds": integer(1),
        },
        "probe timing; the gRPC handler is filled in by the chart",
    )


def probes() -> Schema:
    return obj(
        {"startup": probe(), "readiness": probe(), "liveness": probe()}, "gRPC health probes"
    )


def pdb() -> Schema:
    count_or_percent = {"type": ["integer", "string", "null"], "pattern": "^[0-9]+%$", "minimum": 0}
    return obj(
        {
            "enabled": boolean(),
            "maxUnavailable": count_or_percent,
            "minAvailable": count_or_percent,
        },
        "PodDisruptionBudget",
    )


def autoscaling(*, worker: bool = False) -> Schema:
    """The HPA of a tier; a worker's also scales on its in-flight calls (a custom metric)."""
    properties: dict[str, Schema] = {
        "enabled": boolean(),
        "minReplicas": integer(1),
        "maxReplicas": integer(1),
        "targetCPUUtilizationPercentage": integer(1, nullable=True),
        "targetMemoryUtilizationPercentage": integer(1, nullable=True),
        "metrics": k8s_list("extra autoscaling/v2 MetricSpecs"),
        "behavior": k8s_object("autoscaling/v2 HorizontalPodAutoscalerBehavior"),
    }
    if worker:
        properties["inFlightPerPod"] = number(positive=True, nullable=True)
    return obj(properties, "HorizontalPodAutoscaler")


def gpu() -> Schema:
    return obj({"count": integer(0), "resourceName": string()}, "GPUs per pod")


def tier(
    description: str,
    config: dict[str, Schema],
    specific: dict[str, Schema],
    *,
    worker: bool = False,
) -> Schema:
    """Keys every specdec tier has, plus the tier's own flags (`config`) and extra keys."""
    properties: dict[str, Schema] = {
        "replicas": REPLICAS,
        "image": image_override(),
        "port": PORT,
        "metricsPort": METRICS_PORT,
        "logLevel": string(LOG_LEVELS),
        "config": obj(config, "service flags, passed as SPECDEC_<FLAG>"),
        "extraEnv": k8s_list("extra EnvVars"),
        "resources": resources(),
        "strategy": k8s_object("Deployment strategy"),
        "terminationGracePeriodSeconds": integer(0),
        "probes": probes(),
        "pdb": pdb(),
        "autoscaling": autoscaling(worker=worker),
        "podLabels": string_map("pod labels"),
        "podAnnotations": string_map("pod annotations"),
        "nodeSelector": string_map("nodeSelector"),
        "tolerations": k8s_list("tolerations"),
        "affinity": k8s_object("affinity"),
        "topologySpreadConstraints": k8s_list("topology spread constraints"),
        "priorityClassName": string(),
        "extraVolumes": k8s_list("extra pod volumes"),
        "extraVolumeMounts": k8s_list("extra container volume mounts"),
    }
    properties.update(specific)
    return obj(properties, description)


def worker_config(role: str) -> dict[str, Schema]:
    """Flags shared by the draft and target workers; `role` adds the role's own."""
    config: dict[str, Schema] = {
        "threads": integer(1, nullable=True),
        "cpuBind": {"type": ["string", "null"], "pattern": "^(auto|off|[0-9][0-9,-]*)$"},
        "device": {"type": ["string", "null"], "pattern": "^(auto|cpu|cuda(:[0-9]+)?)$"},
        "dtype": string(["auto", "float32", "float16", "bfloat16"], nullable=True),
        "linearKernel": string(["auto", "compiled", "packed", "default"], nullable=True),
        "batchAttention": string(["auto", "sessions", "padded"], nullable=True),
        "attentionKernel": string(["auto", "compiled", "torch"], nullable=True),
        "modelForward": string(["auto", "lean", "hf"], nullable=True),
        "samplingKernel": string(["auto", "compiled", "torch"], nullable=True),
        "samplingGraphs": string(["auto", "on", "off"], nullable=True),
        "samplingGraphsMb": integer(1, nullable=True),
        "maxSessions": integer(1, nullable=True),
        "maxKvMb": integer(1, nullable=True),
        "maxSpeculativeTokens": integer(1, nullable=True),
        "maxBatchSize": integer(1, nullable=True),
        "maxWaitMs": number(nullable=True),
        "maxInFlight": integer(1, nullable=True),
        "heartbeatS": number(positive=True, nullable=True),
        "graceS": number(nullable=True),
    }
    if role == "draft":
        config["proposer"] = string(["model", "ngram"], nullable=True)
        config["wireTopK"] = integer(1, nullable=True)
        config["ngramMax"] = integer(1, nullable=True)
    else:
        config["maxBatchTokens"] = integer(1, nullable=True)
        config["prefillChunk"] = integer(1, nullable=True)
    return config


def worker(description: str, role: str) -> Schema:
    return tier(
        description,
        worker_config(role),
        {
            "model": obj({"path": string(nullable=True)}, "model directory on the model volume"),
            "advertiseAddr": string(),
            "gpu": gpu(),
            "service": obj({"headless": boolean(), "annotations": string_map("annotations")}),
            "runtimeClassName": string(),
        },
        worker=True,
    )


def coordinator() -> Schema:
    return tier(
        "coordinator tier",
        {
            "draftAddr": string(nullable=True),
            "targetAddr": string(nullable=True),
            "maxSessions": integer(1, nullable=True),
            "maxPromptTokens": integer(1, nullable=True),
            "maxNewTokens": integer(1, nullable=True),
            "defaultMaxNewTokens": integer(1, nullable=True),
            "maxSpeculativeTokens": integer(0, nullable=True),
            "leaseS": number(positive=True, nullable=True),
            "sessionTtlS": number(positive=True, nullable=True),
            "workerTimeoutS": number(positive=True, nullable=True),
            "pipeline": string(["auto", "on", "off"], nullable=True),
        },
        {
            "discovery": string(["kubernetes", "redis", "static"]),
            "tokenizerPath": {"type": "string", "minLength": 1},
            "httpPort": integer(0, 65535),  # 0 = off
            "service": obj(
                {
                    "type": string(["ClusterIP", "NodePort", "LoadBalancer"]),
                    "annotations": string_map("annotations"),
                }
            ),
        },
    )
