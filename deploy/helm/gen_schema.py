"""Generate specdec/values.schema.json, the JSON schema Helm checks every values set against.

The three specdec tiers share most of their shape, so the schema is built from small
constructors here instead of being written by hand three times. Run after changing
values.yaml:

    python deploy/helm/gen_schema.py          # rewrite the schema
    python deploy/helm/gen_schema.py --check  # exit 1 when the committed file is stale

Draft-07 keeps the schema readable by Helm 3 (gojsonschema) as well as Helm 4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parent / "specdec" / "values.schema.json"

Schema = dict[str, Any]

LOG_LEVELS = ["debug", "info", "warning", "error"]


def obj(properties: dict[str, Schema], description: str = "", *, open_: bool = False) -> Schema:
    """An object with known keys; unknown keys are typos unless `open_`."""
    schema: Schema = {"type": "object", "properties": properties}
    if not open_:
        schema["additionalProperties"] = False
    if description:
        schema["description"] = description
    return schema


def integer(
    minimum: int | None = None, maximum: int | None = None, *, nullable: bool = False
) -> Schema:
    schema: Schema = {"type": ["integer", "null"] if nullable else "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def number(*, positive: bool = False, nullable: bool = False) -> Schema:
    """A non-negative (or strictly positive) number, e.g. seconds or milliseconds."""
    schema: Schema = {"type": ["number", "null"] if nullable else "number"}
    schema["exclusiveMinimum" if positive else "minimum"] = 0
    return schema


def string(enum: list[str] | None = None, *, nullable: bool = False) -> Schema:
    schema: Schema = {"type": ["string", "null"] if nullable else "string"}
    if enum is not None:
        schema["enum"] = enum + ([None] if nullable else [])
    return schema


def boolean() -> Schema:
    return {"type": "boolean"}


def k8s_object(description: str) -> Schema:
    """A Kubernetes structure passed through verbatim (affinity, securityContext, ...)."""
    return {"type": "object", "description": description}


def k8s_list(description: str) -> Schema:
    return {"type": "array", "items": {"type": "object"}, "description": description}


def string_map(description: str) -> Schema:
    return {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "description": description,
    }


PORT = integer(1, 65535)
METRICS_PORT = integer(0, 65535)
REPLICAS = integer(0)


def image_override() -> Schema:
    return obj({"repository": string(), "tag": string()}, "per-tier image override")


def resources() -> Schema:
    quantities = {"type": "object", "additionalProperties": {"type": ["string", "number"]}}
    return obj({"requests": quantities, "limits": quantities}, "container resources", open_=True)


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
        "device": {"type": ["string", "null"], "pattern": "^(auto|cpu|cuda(:[0-9]+)?)$"},
        "dtype": string(["auto", "float32", "float16", "bfloat16"], nullable=True),
        "linearKernel": string(["auto", "packed", "default"], nullable=True),
        "batchAttention": string(["auto", "sessions", "padded"], nullable=True),
        "attentionKernel": string(["auto", "compiled", "torch"], nullable=True),
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
        },
        {
            "discovery": string(["kubernetes", "redis"]),
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


KEY = {"type": "string", "minLength": 1}
# A Go duration as cert-manager takes it, e.g. 2160h or 1h30m.
DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(ns|us|ms|s|m|h))+$"}


def secret_key(description: str) -> Schema:
    """A {name, key} reference to one key of a Secret ("" name = not used)."""
    return obj({"name": string(), "key": KEY}, description)


def redis_auth() -> Schema:
    return obj(
        {
            "enabled": boolean(),
            "existingSecret": string(),
            "key": KEY,
            "username": {"type": "string", "pattern": "^[A-Za-z0-9._-]*$"},
            "aclRules": {"type": "string", "minLength": 1},
        },
        "Redis password (from a Secret) and the least-privilege ACL user",
    )


def tls() -> Schema:
    tier_secret = obj({"secretName": string()}, "a tier's TLS Secret")
    return obj(
        {
            "enabled": boolean(),
            "serverName": {"type": "string", "pattern": "^$|^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$"},
            "coordinator": obj(
                {"secretName": string(), "workerClientSecretName": string()},
                "the coordinator's TLS Secrets",
            ),
            "draftWorker": tier_secret,
            "targetWorker": tier_secret,
            "caSecret": secret_key("the cluster CA from a Secret of its own"),
            "clientCA": obj(
                {"enabled": boolean(), "secretName": string(), "key": KEY},
                "client certificates on the public API",
            ),
            "certManager": obj(
                {
                    "enabled": boolean(),
                    "issuerRef": obj(
                        {
                            "name": string(),
                            "kind": string(["Issuer", "ClusterIssuer"]),
                            "group": KEY,
                        }
                    ),
                    "caSecretName": string(),
                    "duration": DURATION,
                    "renewBefore": DURATION,
                    "clusterDomain": KEY,
                    "privateKey": obj(
                        {
                            "algorithm": string(["ECDSA", "RSA", "Ed25519"]),
                            "size": integer(256),
                            "rotationPolicy": string(["Always", "Never"]),
                        }
                    ),
                    "coordinatorDnsNames": {"type": "array", "items": KEY},
                },
                "cert-manager Certificates of the three tiers",
            ),
        },
        "TLS and mutual TLS of the three tiers",
    )


def network_policy() -> Schema:
    return obj(
        {
            "enabled": boolean(),
            "clients": k8s_list("NetworkPolicyPeers that may call the coordinator; [] = any"),
            "prometheus": k8s_list("NetworkPolicyPeers that may scrape metrics; [] = any"),
            "dns": k8s_list("NetworkPolicyPeers serving DNS on port 53; [] = any"),
            "redisEgress": k8s_list("NetworkPolicyPeers of an external Redis; [] = any"),
            "redisEgressPort": integer(1, 65535, nullable=True),
            "apiServerEgress": k8s_list("NetworkPolicyPeers of the Kubernetes API; [] = any"),
            "apiServerEgressPorts": {"type": "array", "items": PORT, "minItems": 1},
            "otelEgress": k8s_list("NetworkPolicyPeers of the OTLP collector; [] = any"),
            "otelEgressPort": integer(1, 65535, nullable=True),
        },
        "NetworkPolicies: default deny plus the tiers' flows",
    )


def redis() -> Schema:
    return obj(
        {
            "enabled": boolean(),
            "externalUrl": {
                "type": "string",
                "pattern": "^$|^(redis|rediss|unix|rediss?\\+cluster|rediss?\\+sentinel)://",
            },
            "externalUrlSecret": obj({"name": string(), "key": {"type": "string", "minLength": 1}}),
            "auth": redis_auth(),
            "caSecret": secret_key("CA of an external rediss:// Redis"),
            "database": integer(0, 15),
            "image": obj(
                {
                    "repository": string(),
                    "tag": {"type": ["string", "number"]},
                    "pullPolicy": string(["Always", "IfNotPresent", "Never"]),
                }
            ),
            "port": PORT,
            "args": {"type": "array", "items": {"type": "string"}},
            "resources": resources(),
            "podSecurityContext": k8s_object("pod securityContext"),
            "securityContext": k8s_object("container securityContext"),
            "podAnnotations": string_map("pod annotations"),
            "nodeSelector": string_map("nodeSelector"),
            "tolerations": k8s_list("tolerations"),
            "affinity": k8s_object("affinity"),
        },
        "in-cluster or external Redis",
    )


def values_schema() -> Schema:
    schema = obj(
        {
            "nameOverride": string(),
            "fullnameOverride": string(),
            "image": obj(
                {
                    "repository": {"type": "string", "minLength": 1},
                    "tag": {"type": ["string", "number"]},
                    "pullPolicy": string(["Always", "IfNotPresent", "Never"]),
                }
            ),
            "imagePullSecrets": k8s_list("LocalObjectReferences"),
            "serviceAccount": obj(
                {
                    "create": boolean(),
                    "name": string(),
                    "annotations": string_map("annotations"),
                    "automountServiceAccountToken": boolean(),
                }
            ),
            "podAnnotations": string_map("annotations on every specdec pod"),
            "podSecurityContext": k8s_object("pod securityContext"),
            "securityContext": k8s_object("container securityContext"),
            "model": obj(
                {
                    "mountPath": {"type": "string", "pattern": "^/"},
                    "volume": {
                        "type": "object",
                        "maxProperties": 1,
                        "description": "one Kubernetes volume source; {} = emptyDir placeholder",
                    },
                }
            ),
            "metrics": obj(
                {
                    "podAnnotations": boolean(),
                    "serviceMonitor": obj(
                        {
                            "enabled": boolean(),
                            "interval": string(),
                            "scrapeTimeout": string(),
                            "labels": string_map("labels"),
                        }
                    ),
                }
            ),
            "reflection": boolean(),
            "otel": obj(
                {
                    "endpoint": {"type": "string", "pattern": "^$|^https?://"},
                    "extraEnv": k8s_list("extra OTEL_* EnvVars of all three tiers"),
                },
                "OpenTelemetry trace export (OTLP/gRPC)",
            ),
            "tls": tls(),
            "apiKeys": obj(
                {"enabled": boolean(), "existingSecret": string(), "key": KEY},
                "API keys on the public API, from a Secret",
            ),
            "networkPolicy": network_policy(),
            "coordinator": coordinator(),
            "draftWorker": worker("draft worker tier", "draft"),
            "targetWorker": worker("target worker tier", "target"),
            "redis": redis(),
        },
        "values of the specdec chart",
    )
    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    # Helm passes the parent chart's globals down; allow them.
    schema["properties"]["global"] = {"type": "object"}
    return schema


def render() -> str:
    return json.dumps(values_schema(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the schema file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is stale; run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
