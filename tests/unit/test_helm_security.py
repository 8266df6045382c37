"""The Helm chart's TLS (mounted secrets, cert-manager, probes over mutual TLS), API keys and
reflection (Redis authentication: tests/unit/test_helm_redis_auth.py)."""

from __future__ import annotations

import copy
import datetime
import subprocess
import sys
from pathlib import Path

import helm_python as helm  # pinned in the dev extras: a broken install must fail, not skip
import pytest
from helm_render import (
    NAMESPACE,
    RELEASE,
    TIERS,
    TLS_DIR,
    TLS_VALUES,
    component,
    container,
    env,
    find,
    mounted_secret,
    pod_spec,
    render,
)


def test_tls_is_off_by_default(chart):
    objects = render(chart)
    for comp in TIERS:
        assert not [n for n in env(objects, comp) if "TLS" in n or n == "SPECDEC_API_KEYS_FILE"]
        assert not [v for v in pod_spec(objects, comp)["volumes"] if "secret" in v]
    assert not [o for o in objects if o["kind"] in ("Certificate", "Issuer")]


def test_tls_env_points_at_the_mounted_secret_files(chart):
    objects = render(chart, TLS_VALUES)
    for comp in TIERS:
        variables = env(objects, comp)
        assert variables["SPECDEC_TLS_CERT"] == f"{TLS_DIR}/tls.crt"
        assert variables["SPECDEC_TLS_KEY"] == f"{TLS_DIR}/tls.key"
        assert variables["SPECDEC_TLS_CA"] == f"{TLS_DIR}/ca.crt"
        for name in ("SPECDEC_TLS_CERT", "SPECDEC_TLS_KEY", "SPECDEC_TLS_CA"):
            assert mounted_secret(objects, comp, variables[name]) == f"{RELEASE}-specdec-{comp}-tls"
        # Every mounted file the services read comes from a whole-Secret mount.
        for value in variables.values():
            if isinstance(value, str) and value.startswith("/etc/specdec/"):
                mounted_secret(objects, comp, value)
        if comp != "coordinator":
            assert not {
                "SPECDEC_WORKER_TLS_CERT",
                "SPECDEC_TLS_SERVER_NAME",
                "SPECDEC_API_KEYS_FILE",
            } & set(variables)
    coordinator = env(objects, "coordinator")
    assert coordinator["SPECDEC_WORKER_TLS_CERT"] == f"{TLS_DIR}/tls.crt"
    assert coordinator["SPECDEC_WORKER_TLS_KEY"] == f"{TLS_DIR}/tls.key"
    assert coordinator["SPECDEC_TLS_SERVER_NAME"] == "workers.specdec.internal"
    assert coordinator["SPECDEC_TLS_CLIENT_CA"] == f"{TLS_DIR}/ca.crt"  # default: the cluster CA


def test_tls_separate_secrets_for_the_worker_client_cert_and_the_cas(chart):
    values = {
        "tls": {
            "enabled": True,
            "coordinator": {"secretName": "coord-cert", "workerClientSecretName": "coord-client"},
            "targetWorker": {"secretName": "target-cert"},
            "caSecret": {"name": "trust-bundle", "key": "bundle.pem"},
            "clientCA": {"enabled": True, "secretName": "partner-ca", "key": "ca.pem"},
        }
    }
    objects = render(chart, values)
    coordinator = env(objects, "coordinator")
    expected = {
        "SPECDEC_TLS_CERT": "coord-cert",
        "SPECDEC_WORKER_TLS_CERT": "coord-client",
        "SPECDEC_WORKER_TLS_KEY": "coord-client",
        "SPECDEC_TLS_CA": "trust-bundle",
        "SPECDEC_TLS_CLIENT_CA": "partner-ca",
    }
    for name, secret in expected.items():
        assert mounted_secret(objects, "coordinator", coordinator[name]) == secret, name
    assert coordinator["SPECDEC_TLS_CA"].endswith("/bundle.pem")
    assert coordinator["SPECDEC_TLS_CLIENT_CA"].endswith("/ca.pem")
    assert coordinator["SPECDEC_TLS_SERVER_NAME"] == f"{RELEASE}-specdec-worker"  # the default
    target = env(objects, "target-worker")
    assert mounted_secret(objects, "target-worker", target["SPECDEC_TLS_CERT"]) == "target-cert"
    assert mounted_secret(objects, "target-worker", target["SPECDEC_TLS_CA"]) == "trust-bundle"
    draft = env(objects, "draft-worker")
    assert (
        mounted_secret(objects, "draft-worker", draft["SPECDEC_TLS_KEY"])
        == f"{RELEASE}-specdec-draft-worker-tls"
    )


def test_tls_probes_check_grpc_health_over_tls_inside_the_container(chart):
    """The kubelet's gRPC probe cannot speak TLS, so with TLS on each probe execs a health
    check that presents the pod's own certificate and expects the tier's certificate name."""
    objects = render(chart, TLS_VALUES)
    for comp, (_, port, *_) in TIERS.items():
        main = container(objects, comp)
        variables = env(objects, comp)
        name = (
            "workers.specdec.internal"
            if comp != "coordinator"
            else f"{RELEASE}-specdec-coordinator"
        )
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = main[probe]["exec"]["command"]
            assert command[:2] == ["python", "-c"] and "grpc" not in main[probe]
            assert command[3:8] == [
                str(port),
                variables["SPECDEC_TLS_CA"],
                variables["SPECDEC_TLS_CERT"],
                variables["SPECDEC_TLS_KEY"],
                name,
            ]
            assert float(command[8]) < main[probe]["timeoutSeconds"]


def _issue(directory: Path, name: str, ca=None, hosts=("localhost",)):
    """A P-256 certificate for `hosts` (server and client use), self-signed CA when ca is None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca[1].subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), critical=False
        ).add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    cert = builder.sign(ca[0] if ca else key, hashes.SHA256())
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return key, cert


def test_rendered_tls_probe_passes_only_against_a_serving_mutual_tls_port(chart, tmp_path):
    """Run the rendered probe command against a real mutual-TLS gRPC health server."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    ca = _issue(tmp_path, "ca")
    _issue(tmp_path, "tls", ca, hosts=["workers.specdec.internal"])
    (tmp_path / "ca.crt").rename(tmp_path / "cluster-ca.crt")
    read = lambda name: (tmp_path / name).read_bytes()  # noqa: E731
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(read("tls.key"), read("tls.crt"))],
        root_certificates=read("cluster-ca.crt"),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        command = container(render(chart, TLS_VALUES), "target-worker")["readinessProbe"]["exec"][
            "command"
        ]
        files = {"ca.crt": "cluster-ca.crt", "tls.crt": "tls.crt", "tls.key": "tls.key"}
        local = (
            [sys.executable, command[1], command[2], str(port)]
            + [str(tmp_path / files[Path(arg).name]) for arg in command[4:7]]
            + command[7:]
        )

        def probe(args=local) -> int:
            return subprocess.run(args, capture_output=True, timeout=60).returncode

        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe() != 0
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe() == 0
        assert probe([*local[:7], "someone-else", local[8]]) != 0  # name checked
    finally:
        server.stop(None)


def test_cert_manager_certificates_carry_the_server_name_and_service_names(chart):
    objects = render(chart, TLS_VALUES)
    issuer = next(o for o in objects if o["kind"] == "Issuer")
    assert issuer["spec"] == {"ca": {"secretName": "specdec-ca"}}
    certificates = {component(o): o for o in objects if o["kind"] == "Certificate"}
    assert set(certificates) == set(TIERS)
    for comp, certificate in certificates.items():
        spec = certificate["spec"]
        service = find(objects, "Service", comp)["metadata"]["name"]
        service_names = [
            service,
            f"{service}.{NAMESPACE}",
            f"{service}.{NAMESPACE}.svc",
            f"{service}.{NAMESPACE}.svc.cluster.local",
        ]
        assert set(service_names) <= set(spec["dnsNames"])
        # Worker certificates carry the name the coordinator checks; the coordinator's does
        # not (it would let the coordinator's key impersonate a worker).
        assert ("workers.specdec.internal" in spec["dnsNames"]) == (comp != "coordinator")
        assert spec["secretName"] == mounted_secret(
            objects, comp, env(objects, comp)["SPECDEC_TLS_CERT"]
        )
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert (spec["duration"], spec["renewBefore"]) == ("2160h", "360h")
        assert spec["issuerRef"] == {
            "name": issuer["metadata"]["name"],
            "kind": "Issuer",
            "group": "cert-manager.io",
        }
        assert spec["privateKey"]["rotationPolicy"] == "Always"

    values = copy.deepcopy(TLS_VALUES)
    values["tls"]["certManager"] = {
        "enabled": True,
        "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"},
        "duration": "720h",
        "renewBefore": "240h",
        "coordinatorDnsNames": ["api.example.com"],
    }
    objects = render(chart, values)
    assert not [o for o in objects if o["kind"] == "Issuer"]
    coordinator = find(objects, "Certificate", "coordinator")["spec"]
    assert coordinator["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert "api.example.com" in coordinator["dnsNames"]
    assert (coordinator["duration"], coordinator["renewBefore"]) == ("720h", "240h")


def test_cert_manager_needs_an_issuer_or_a_ca(chart):
    with pytest.raises(helm.HelmRenderError, match="caSecretName"):
        render(chart, {"tls": {"enabled": True, "certManager": {"enabled": True}}})


def test_api_keys_file_is_mounted_and_passed_to_the_coordinator_only(chart):
    objects = render(chart, {"apiKeys": {"enabled": True, "existingSecret": "keys", "key": "k"}})
    path = env(objects, "coordinator")["SPECDEC_API_KEYS_FILE"]
    assert path == "/etc/specdec/api-keys/k"
    assert mounted_secret(objects, "coordinator", path) == "keys"
    for comp in ("draft-worker", "target-worker"):
        assert "SPECDEC_API_KEYS_FILE" not in env(objects, comp)
    assert "SPECDEC_API_KEYS_FILE" not in env(render(chart), "coordinator")
    with pytest.raises(helm.HelmError, match="existingSecret"):
        render(chart, {"apiKeys": {"enabled": True}})


def test_reflection_is_off_unless_asked_for(chart):
    for comp in TIERS:
        assert env(render(chart), comp).get("SPECDEC_REFLECTION", "false") == "false"
        assert env(render(chart, {"reflection": True}), comp)["SPECDEC_REFLECTION"] == "true"
