"""Generate specdec/values.schema.json, the JSON schema Helm checks every values set against.

The three specdec tiers share most of their shape, so the schema is built from small
constructors (schema_builders.py, schema_tiers.py, schema_cluster.py beside this script)
instead of being written by hand three times. Run after changing values.yaml:

    python deploy/helm/gen_schema.py          # rewrite the schema
    python deploy/helm/gen_schema.py --check  # exit 1 when the committed file is stale

Draft-07 keeps the schema readable by Helm 3 (gojsonschema) as well as Helm 4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from schema_builders import KEY, Schema, boolean, k8s_list, k8s_object, obj, string, string_map
from schema_cluster import network_policy, redis, tls
from schema_tiers import coordinator, worker

SCHEMA_PATH = Path(__file__).resolve().parent / "specdec" / "values.schema.json"


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
