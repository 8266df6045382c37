"""The Helm chart in deploy/helm/specdec, rendered by the real Helm engine (helm-python-sdk):
lint, the values schema, the objects of each tier, probes, GPUs and the flags each tier gets."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import re
from collections import Counter

import helm_python as helm  # pinned in the dev extras: a broken install must fail, not skip
import pytest
from helm_render import (
    CHART_DIR,
    GPU,
    NAMESPACE,
    RELEASE,
    REPO,
    TIERS,
    component,
    container,
    env,
    find,
    probe_budget,
    render,
)


def test_lint_reports_no_warnings_or_errors():
    report = helm.lint(CHART_DIR, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_committed_schema_matches_generator(monkeypatch):
    # gen_schema.py imports its sibling builders as a script does: from its own directory
    monkeypatch.syspath_prepend(str(REPO / "deploy/helm"))
    spec = importlib.util.spec_from_file_location("gen_schema", REPO / "deploy/helm/gen_schema.py")
    gen_schema = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_schema)
    assert (CHART_DIR / "values.schema.json").read_text() == gen_schema.render()


def test_every_values_key_has_a_comment():
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    for number, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w.-]*:", line) and not lines[number - 1].lstrip().startswith(
            "#"
        ):
            undocumented.append(f"{number + 1}: {line.strip()}")
    assert undocumented == []


def test_default_render_has_exactly_the_expected_kinds_per_tier(chart):
    kinds = Counter((component(o), o["kind"]) for o in render(chart))
    expected = Counter(
        {
            (tier, kind): 1
            for tier in TIERS
            for kind in ("Deployment", "Service", "PodDisruptionBudget")
        }
    )
    expected[("redis", "Deployment")] = 1
    expected[("redis", "Service")] = 1
    expected[(None, "ServiceAccount")] = 1
    # Kubernetes discovery (the default): the coordinator's own account, Role and binding.
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        expected[("coordinator", kind)] = 1
    # Secure defaults: the generated Redis password, one NetworkPolicy per tier and Redis,
    # and the release-wide default deny.
    expected[("redis", "Secret")] = 1
    for comp in (*TIERS, "redis"):
        expected[(comp, "NetworkPolicy")] = 1
    expected[(None, "NetworkPolicy")] = 1
    assert kinds == expected


def test_every_object_is_named_after_release_and_in_the_release_namespace(chart):
    for obj in render(chart):
        assert obj["metadata"]["name"].startswith(f"{RELEASE}-specdec")
        assert obj["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("replicas", [(3, 5, 2), (0, 1, 7)])
def test_each_tier_follows_its_own_replicas(chart, replicas):
    values = {key: {"replicas": n} for (key, *_), n in zip(TIERS.values(), replicas, strict=True)}
    objects = render(chart, values)
    for comp, n in zip(TIERS, replicas, strict=True):
        assert find(objects, "Deployment", comp)["spec"]["replicas"] == n


def test_tiers_use_the_single_console_script_with_their_subcommand(chart):
    objects = render(chart)
    for comp, (*_, subcommand) in TIERS.items():
        assert container(objects, comp)["command"] == ["specdec", subcommand]


def test_no_gpus_are_requested_by_default(chart):
    objects = render(chart)
    for comp in TIERS:
        resources = container(objects, comp)["resources"]
        assert GPU not in resources.get("limits", {})
        assert GPU not in resources.get("requests", {})


def test_gpus_appear_only_on_the_tier_that_requests_them(chart):
    objects = render(chart, {"targetWorker": {"gpu": {"count": 2}}})
    target = container(objects, "target-worker")["resources"]
    assert target["limits"][GPU] == 2
    assert target["requests"][GPU] == 2
    assert target["limits"]["memory"] == "16Gi"  # GPU entries are added, not substituted
    for comp in ("coordinator", "draft-worker"):
        assert GPU not in container(objects, comp)["resources"].get("limits", {})

    objects = render(chart, {"draftWorker": {"gpu": {"count": 1, "resourceName": "amd.com/gpu"}}})
    assert container(objects, "draft-worker")["resources"]["limits"]["amd.com/gpu"] == 1
    assert GPU not in container(objects, "target-worker")["resources"].get("limits", {})


def test_probes_are_grpc_on_each_tiers_port(chart):
    objects = render(chart)
    for comp, (_, port, metrics_port, _) in TIERS.items():
        main = container(objects, comp)
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        http = {"http": 8000} if comp == "coordinator" else {}
        assert ports == {"grpc": port, **http, "metrics": metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"] == {"port": port}
            assert "httpGet" not in main[probe] and "tcpSocket" not in main[probe]


def test_startup_probe_budget_covers_model_loading_and_is_configurable(chart):
    objects = render(chart)
    # Converting and loading a model takes minutes: 15 for the target, 10 for the draft.
    for comp, minimum in (("draft-worker", 600), ("target-worker", 900)):
        main = container(objects, comp)
        startup = main["startupProbe"]
        assert probe_budget(startup) >= minimum, comp
        # ... which readiness and liveness, checked only after startup passed, do not inherit:
        # a wedged worker is restarted within a minute, not after the loading budget.
        assert probe_budget(main["livenessProbe"]) <= 60 < probe_budget(startup), comp
        assert probe_budget(main["readinessProbe"]) <= 15, comp
    probes = {"startup": {"periodSeconds": 15, "failureThreshold": 400}}
    main = container(render(chart, {"targetWorker": {"probes": probes}}), "target-worker")
    startup = main["startupProbe"]
    assert (startup["periodSeconds"], startup["failureThreshold"]) == (15, 400)
    assert startup["grpc"] == {"port": 50071}
    liveness = main["livenessProbe"]
    assert (liveness["periodSeconds"], liveness["failureThreshold"]) == (10, 6)


def test_termination_grace_exceeds_worker_drain_time(chart):
    objects = render(chart)
    for comp in ("draft-worker", "target-worker"):
        pod = find(objects, "Deployment", comp)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > float(env(objects, comp)["SPECDEC_GRACE_S"])


def test_grace_period_not_above_drain_time_fails_rendering(chart):
    with pytest.raises(helm.HelmRenderError, match="terminationGracePeriodSeconds"):
        render(
            chart, {"targetWorker": {"terminationGracePeriodSeconds": 30, "config": {"graceS": 30}}}
        )


def test_coordinator_gamma_above_worker_limit_fails_rendering(chart):
    with pytest.raises(helm.HelmRenderError, match="maxSpeculativeTokens"):
        render(chart, {"coordinator": {"config": {"maxSpeculativeTokens": 24}}})


def test_env_carries_common_settings(chart):
    objects = render(chart, {"draftWorker": {"logLevel": "debug"}})
    for comp, (_, port, metrics_port, _) in TIERS.items():
        variables = env(objects, comp)
        assert variables["SPECDEC_HOST"] == "0.0.0.0"
        assert variables["SPECDEC_PORT"] == str(port)
        assert variables["SPECDEC_METRICS_PORT"] == str(metrics_port)
    assert env(objects, "draft-worker")["SPECDEC_LOG_LEVEL"] == "debug"
    assert env(objects, "target-worker")["SPECDEC_LOG_LEVEL"] == "info"


def test_env_carries_configured_flags(chart):
    values = {
        "coordinator": {
            "tokenizerPath": "/models/big",
            "config": {"maxNewTokens": 777, "leaseS": 2.5, "draftAddr": "d0:50061,d1:50061"},
        },
        "draftWorker": {
            "model": {"path": "/models/small"},
            "config": {"wireTopK": 7, "proposer": "ngram", "maxBatchSize": 3},
        },
        "targetWorker": {
            "config": {
                "maxBatchSize": 24,
                "maxInFlight": 96,
                "maxKvMb": 1048576,
                "dtype": "bfloat16",
                "linearKernel": "default",
                "batchAttention": "padded",
                "device": "cuda:1",
                "cpuBind": "0-3",
            }
        },
    }
    objects = render(chart, values)
    coordinator = env(objects, "coordinator")
    assert coordinator["SPECDEC_TOKENIZER"] == "/models/big"
    assert coordinator["SPECDEC_MAX_NEW_TOKENS"] == "777"
    assert coordinator["SPECDEC_LEASE_S"] == "2.5"
    assert coordinator["SPECDEC_DRAFT_ADDR"] == "d0:50061,d1:50061"
    assert "SPECDEC_TARGET_ADDR" not in coordinator  # "" = use the Redis registry
    draft = env(objects, "draft-worker")
    assert draft["SPECDEC_MODEL"] == "/models/small"
    assert draft["SPECDEC_WIRE_TOP_K"] == "7"
    assert draft["SPECDEC_PROPOSER"] == "ngram"
    assert draft["SPECDEC_MAX_BATCH_SIZE"] == "3"
    target = env(objects, "target-worker")
    assert target["SPECDEC_MAX_BATCH_SIZE"] == "24"
    assert target["SPECDEC_MAX_IN_FLIGHT"] == "96"
    assert draft["SPECDEC_MAX_IN_FLIGHT"] == "256"  # the chart's default, the program's too
    assert target["SPECDEC_MAX_KV_MB"] == "1048576"  # not "1.048576e+06"
    assert target["SPECDEC_DTYPE"] == "bfloat16"
    assert target["SPECDEC_LINEAR_KERNEL"] == "default"
    assert target["SPECDEC_CPU_BIND"] == "0-3"
    assert draft["SPECDEC_CPU_BIND"] == "auto"
    assert target["SPECDEC_BATCH_ATTENTION"] == "padded"
    assert draft["SPECDEC_BATCH_ATTENTION"] == "auto"
    assert draft["SPECDEC_LINEAR_KERNEL"] == "auto"  # the chart's default, the program's too
    assert target["SPECDEC_DEVICE"] == "cuda:1"
    assert target["SPECDEC_MODEL"] == "/models/target"


def test_every_config_key_becomes_its_specdec_variable(chart):
    objects = render(chart)
    for comp, (key, *_) in TIERS.items():
        variables = env(objects, comp)
        for flag in chart.values[key]["config"]:
            name = "SPECDEC_" + re.sub(r"(?<!^)(?=[A-Z])", "_", flag).upper()
            if chart.values[key]["config"][flag] not in ("", None):
                assert name in variables, f"{key}.config.{flag} does not reach {name}"


def test_null_config_value_leaves_the_program_default(chart):
    objects = render(chart, {"targetWorker": {"config": {"prefillChunk": None}}})
    assert "SPECDEC_PREFILL_CHUNK" not in env(objects, "target-worker")
    assert "SPECDEC_MAX_BATCH_TOKENS" in env(objects, "target-worker")


def test_workers_advertise_their_pod_ip(chart):
    objects = render(chart)
    for comp, (_, port, *_) in TIERS.items():
        if comp == "coordinator":
            continue
        names = [e["name"] for e in container(objects, comp)["env"]]
        variables = env(objects, comp)
        assert variables["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert variables["SPECDEC_ADVERTISE_ADDR"] == f"$(POD_IP):{port}"
        # Kubernetes only expands $(POD_IP) when it is declared earlier in the list.
        assert names.index("POD_IP") < names.index("SPECDEC_ADVERTISE_ADDR")


def test_extra_env_is_appended_last(chart):
    extra = [{"name": "SPECDEC_THREADS", "value": "9"}, {"name": "OMP_NUM_THREADS", "value": "9"}]
    names = [
        e["name"]
        for e in container(render(chart, {"targetWorker": {"extraEnv": extra}}), "target-worker")[
            "env"
        ]
    ]
    assert names[-2:] == ["SPECDEC_THREADS", "OMP_NUM_THREADS"]


# the chart's tiers and the settings their SPECDEC_* variables are read into
SETTINGS = {
    "coordinator": ("coordinator.settings", "CoordinatorSettings"),
    "draftWorker": ("draft_worker.__main__", "DraftSettings"),
    "targetWorker": ("target_worker.__main__", "TargetSettings"),
}


def schema_mismatches(schema: dict, settings: dict[str, type]) -> list[str]:
    """Where the values schema's enum or pattern of a tier's flag differs from the flag's own
    choices or pattern (the schema is written by hand in deploy/helm/schema_tiers.py)."""
    problems = []
    for tier, cls in settings.items():
        properties = schema["properties"][tier]["properties"]
        keys = {**properties["config"]["properties"]}
        keys.update({k: properties[k] for k in ("logLevel", "discovery") if k in properties})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, spec in keys.items():
            field = fields.get(re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower())
            if field is None:
                problems.append(f"{tier}.{key}: no such flag")
                continue
            enum = {v for v in spec.get("enum", []) if v is not None}
            choices = set(field.metadata.get("choices", []))
            if enum != choices:
                problems.append(f"{tier}.{key}: schema {sorted(enum)}, flag {sorted(choices)}")
            pattern = field.metadata.get("pattern")
            if pattern and "pattern" not in spec:
                problems.append(f"{tier}.{key}: the flag's pattern is not in the schema")
    return problems


def test_the_schema_allows_what_each_flag_allows():
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    settings = {
        tier: getattr(importlib.import_module(module), name)
        for tier, (module, name) in SETTINGS.items()
    }
    assert schema_mismatches(schema, settings) == []
    # negative control: a choice the flag gained and the schema did not
    draft = schema["properties"]["draftWorker"]["properties"]["config"]["properties"]
    draft["proposer"]["enum"].remove("ngram")
    assert schema_mismatches(schema, settings) == [
        "draftWorker.proposer: schema ['model'], flag ['model', 'ngram']"
    ]
