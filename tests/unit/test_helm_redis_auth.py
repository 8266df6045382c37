"""The Helm chart's Redis authentication: the password Secret (generated, existing, none),
the ACL user and requirepass, an external Redis with its CA, and the ACL of exactly the
commands specdec issues."""

from __future__ import annotations

import base64
import re
from typing import Any

import yaml
from helm_render import RELEASE, REPO, TIERS, container, env, find, mounted_secret, render


def redis_secret(objects) -> dict[str, Any]:
    return find(objects, "Secret", "redis")


def test_bundled_redis_takes_its_password_from_the_generated_secret(chart):
    objects = render(chart)
    secret = redis_secret(objects)
    name = secret["metadata"]["name"]
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    redis = container(objects, "redis")
    ref = {"secretKeyRef": {"name": name, "key": "password"}}
    assert env(objects, "redis") == {"REDIS_PASSWORD": ref, "REDISCLI_AUTH": ref}
    # The password never appears in the pod spec: only $(REDIS_PASSWORD), expanded by Kubernetes.
    deployment = yaml.safe_dump(find(objects, "Deployment", "redis"))
    assert password not in deployment
    args = redis["args"]
    assert [a for a in args if "REDIS_PASSWORD" in a] == [">$(REDIS_PASSWORD)"]
    assert "--requirepass" not in args
    # The specdec ACL user; the default user (all commands) is off.
    assert args[args.index("--user") : args.index("--user") + 3] == ["--user", "default", "off"]
    user = args[len(args) - args[::-1].index("--user") :]
    assert user[:3] == ["specdec", "on", ">$(REDIS_PASSWORD)"]
    assert user[3:] == chart.values["redis"]["auth"]["aclRules"].split()
    assert "redis-cli -p 6379 --user specdec" in " ".join(
        redis["readinessProbe"]["exec"]["command"]
    )
    for comp in TIERS:
        assert env(objects, comp)["SPECDEC_REDIS_PASSWORD"] == ref
        assert env(objects, comp)["SPECDEC_REDIS_URL"].startswith("redis://specdec@")
    for obj in objects:
        if obj is not secret:
            assert password not in yaml.safe_dump(obj)


def test_redis_password_from_an_existing_secret(chart):
    objects = render(chart, {"redis": {"auth": {"existingSecret": "corp-redis", "key": "pw"}}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    ref = {"secretKeyRef": {"name": "corp-redis", "key": "pw"}}
    assert env(objects, "redis")["REDIS_PASSWORD"] == ref
    for comp in TIERS:
        assert env(objects, comp)["SPECDEC_REDIS_PASSWORD"] == ref


def test_redis_without_acl_user_uses_requirepass(chart):
    objects = render(chart, {"redis": {"auth": {"username": ""}}})
    args = container(objects, "redis")["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "--user" not in args
    assert (
        env(objects, "coordinator")["SPECDEC_REDIS_URL"]
        == f"redis://{RELEASE}-specdec-redis:6379/0"
    )


def test_redis_auth_can_be_turned_off(chart):
    objects = render(chart, {"redis": {"auth": {"enabled": False}}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    assert "env" not in container(objects, "redis")
    assert not {"--requirepass", "--user"} & set(container(objects, "redis")["args"])
    for comp in TIERS:
        assert "SPECDEC_REDIS_PASSWORD" not in env(objects, comp)


def test_external_redis_gets_the_password_secret_and_its_ca(chart):
    values = {
        "redis": {
            "enabled": False,
            "externalUrl": "rediss://specdec@cache.example:6380/0",
            "auth": {"existingSecret": "cache-pw"},
            "caSecret": {"name": "cache-ca"},
        }
    }
    objects = render(chart, values)
    assert not [o for o in objects if o["kind"] == "Secret"]
    for comp in TIERS:
        variables = env(objects, comp)
        assert variables["SPECDEC_REDIS_PASSWORD"] == {
            "secretKeyRef": {"name": "cache-pw", "key": "password"}
        }
        assert variables["SPECDEC_REDIS_CA"] == "/etc/specdec/redis-ca/ca.crt"
        assert mounted_secret(objects, comp, variables["SPECDEC_REDIS_CA"]) == "cache-ca"
    # Without a password Secret the URL (e.g. externalUrlSecret) carries the credentials.
    values["redis"]["auth"] = {"existingSecret": ""}
    assert "SPECDEC_REDIS_PASSWORD" not in env(render(chart, values), "coordinator")


LUA_CALL = re.compile(r"redis\.call\('(\w+)'")


# Commands redis-py sends for the client-side calls of coordinator/store.py and
# specdec/serving/registry.py: register_script -> EVALSHA (SCRIPT LOAD on NOSCRIPT, SCRIPT
# EXISTS + LOAD in pipelines; never EVAL; no MULTI/EXEC: a session is read by a script);
# hgetall, lrange, get, set (cancel, heartbeat), delete -> DEL; the registry's index set:
# sadd, srem, smembers, and mget of the entries it names.
CLIENT_COMMANDS = {
    "evalsha", "script|load", "script|exists",
    "hgetall", "lrange", "get", "set", "del", "sadd", "srem", "smembers", "mget",
}  # fmt: skip


# On connect: AUTH (HELLO with RESP3), SELECT for a database other than 0; PING: the probe.
CONNECTION_COMMANDS = {"hello", "auth", "ping", "select"}


def test_redis_acl_grants_exactly_the_commands_specdec_issues(chart):
    from specdec.serving.registry import REDIS_ACL

    store = (REPO / "coordinator" / "store.py").read_text()
    lua = {name.lower() for name in LUA_CALL.findall(store)}
    assert {"hset", "rpush", "hincrby", "pexpire"} <= lua  # the scripts were found
    rules = chart.values["redis"]["auth"]["aclRules"].split()
    assert rules[:4] == ["resetkeys", "~specdec:*", "resetchannels", "-@all"]
    assert all(r.startswith("+") and "@" not in r for r in rules[4:])  # commands, no categories
    assert {r[1:] for r in rules[4:]} == lua | CLIENT_COMMANDS | CONNECTION_COMMANDS
    # Never more than the project's documented user (specdec/serving/registry.py), which the
    # service tests run every store and registry operation as.
    assert set(rules) <= set(REDIS_ACL)
    assert 'PREFIX = "specdec:' in store  # every key is under the ACL's key pattern
    registry = (REPO / "specdec" / "serving" / "registry.py").read_text()
    assert 'PREFIX = "specdec:' in registry
