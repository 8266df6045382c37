"""The schema of the chart's cluster-wide sections around the tiers: TLS and mutual TLS,
NetworkPolicies, and the in-cluster or external Redis with its credentials."""

from __future__ import annotations

from schema_builders import (
    KEY,
    PORT,
    Schema,
    boolean,
    integer,
    k8s_list,
    k8s_object,
    obj,
    resources,
    string,
    string_map,
)

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
