"""API keys, URL redaction, and the coordinator's checks of worker answers (no servers)."""

from __future__ import annotations

import os
import time

import pytest

from coordinator.links import BadAnswer, check_proposal, check_verdict
from specdec.serving.registry import redact
from specdec.serving.security import APIKeys, ClientTLS, SecurityConfigError, hash_key
from specdec.v1 import common_pb2, draft_pb2, target_pb2


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


def test_api_keys_plain_hashed_and_comments(tmp_path):
    path = write(tmp_path / "keys", f"# team A\nalpha-key\n\n  {hash_key('beta-key')}  \n")
    keys = APIKeys(path)
    assert len(keys) == 2
    assert keys.check("alpha-key") and keys.check("beta-key")
    assert not keys.check("gamma-key")
    assert not keys.check(hash_key("beta-key")), "the stored hash itself is not a key"
    assert not keys.check("alpha-key ")  # exact match only


def test_authorize_names_what_is_wrong(tmp_path):
    keys = APIKeys(write(tmp_path / "keys", "k1\n"))
    assert keys.authorize(bearer("k1")) is None
    assert keys.authorize((("authorization", "bearer k1"),)) is None  # scheme is case-blind
    assert "missing API key" in keys.authorize(())
    assert "missing API key" in keys.authorize((("x-other", "k1"),))
    assert "malformed" in keys.authorize((("authorization", "Basic k1"),))
    assert "malformed" in keys.authorize((("authorization", "Bearer "),))
    assert keys.authorize(bearer("k2")) == "invalid API key"


def test_api_key_file_is_reread_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    keys = APIKeys(write(path, "old\n"))
    monkeypatch.setattr(APIKeys, "RELOAD_EVERY_S", 0.0)
    assert keys.check("old")
    write(path, "new\n")
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)  # a later mtime even on coarse clocks
    assert keys.check("new") and not keys.check("old")
    write(path, "sha256:nothex\n")  # a broken edit keeps the last good keys
    os.utime(path, ns=(time.time_ns() + 2 * 10**9,) * 2)
    assert keys.check("new")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "holds no key"),
        ("# only a comment\n", "holds no key"),
        ("sha256:abcd\n", "line 1: sha256: needs 64 hex digits"),
        ("ok\nsha256:" + "zz" * 32 + "\n", "line 2"),
    ],
)
def test_bad_api_key_files_are_refused_naming_the_flag(tmp_path, text, message):
    with pytest.raises(SecurityConfigError, match="--api-keys-file") as info:
        APIKeys(write(tmp_path / "keys", text))
    assert message in str(info.value)


def test_missing_api_key_file_names_the_flag(tmp_path):
    with pytest.raises(SecurityConfigError, match="--api-keys-file: cannot read"):
        APIKeys(str(tmp_path / "absent"))


def test_a_client_certificate_needs_its_key(tmp_path):
    with pytest.raises(SecurityConfigError, match="both"):
        ClientTLS(ca="", cert=write(tmp_path / "c.pem", "x")).credentials()


def test_redact_hides_only_the_password():
    assert redact("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert (
        redact("rediss://specdec:s3cret@redis.svc:6380/1")
        == "rediss://specdec:***@redis.svc:6380/1"
    )
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# --- the coordinator's checks of what workers answer ------------------------------------

VOCAB = 100


def verdict(accepted: int, output: list[int]) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(num_accepted=accepted, output_ids=output)


@pytest.mark.parametrize(
    "accepted, output, candidates, max_output",
    [
        (2, [5, 6, 9], [5, 6, 7], 0),  # two accepted, a recovered token
        (3, [5, 6, 7, 8], [5, 6, 7], 0),  # all accepted and the bonus
        (0, [3], [], 0),  # a target-only step
        (1, [5, 9], [5, 6, 7], 3),  # the budget cut the candidates to 2
    ],
)
def test_consistent_verdicts_pass(accepted, output, candidates, max_output):
    check_verdict(verdict(accepted, output), candidates, max_output, VOCAB)


@pytest.mark.parametrize(
    "accepted, output, candidates, max_output, message",
    [
        (3, [5, 6, 7, 8, 8], [5, 6, 7], 0, "5 output tokens for 3 accepted"),
        (4, [5, 6, 7, 8, 8], [5, 6, 7], 0, "num_accepted 4 of 3"),
        (3, [5, 6, 7, 8], [5, 6, 7], 3, "num_accepted 3 of 2"),
        (2, [5, 1, 9], [5, 6, 7], 0, "differ from the candidates"),
        (0, [], [5], 0, "0 output tokens"),
        (1, [5, VOCAB], [5, 6], 0, "outside the vocabulary"),
        (1, [9, 3], [], 0, "num_accepted 1 of 0"),
    ],
)
def test_inconsistent_verdicts_are_refused(accepted, output, candidates, max_output, message):
    with pytest.raises(BadAnswer, match=message):
        check_verdict(verdict(accepted, output), candidates, max_output, VOCAB)


def proposal(candidates, dists=None) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(
        candidate_ids=candidates,
        draft_dists=[common_pb2.SparseDist(token_ids=i, weights=w) for i, w in dists or []],
    )


def test_proposals_checked_for_count_vocabulary_and_q():
    check_proposal(proposal([4, 5], [([4, 6], [9, 1]), ([5], [3])]), 2, VOCAB)
    check_proposal(proposal([4]), 3, VOCAB)  # token-only, fewer than γ
    with pytest.raises(BadAnswer, match="3 candidates for γ = 2"):
        check_proposal(proposal([1, 2, 3]), 2, VOCAB)
    with pytest.raises(BadAnswer, match=r"candidate_ids\[1\] = 100 is outside"):
        check_proposal(proposal([1, VOCAB]), 2, VOCAB)
    with pytest.raises(BadAnswer, match="zero probability"):
        check_proposal(proposal([4], [([6], [9])]), 1, VOCAB)
    with pytest.raises(BadAnswer, match="expected 2"):
        check_proposal(proposal([4, 5], [([4], [9])]), 2, VOCAB)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(tls_cert="CERT"), "--tls-cert/--tls-key: give both"),
        (dict(tls_cert="CERT", tls_key="MISSING"), "--tls-key: no such file"),
        (dict(tls_client_ca="CA"), "--tls-client-ca needs --tls-cert"),
        (dict(tls_ca="CA"), "--tls-ca (mTLS to the workers) needs a client certificate"),
        (dict(worker_tls_cert="CERT"), "--worker-tls-cert/--worker-tls-key: give both"),
        (dict(api_keys_file="EMPTY"), "holds no key"),
        (dict(redis_ca="MISSING"), "--redis-ca: no such file"),
    ],
)
def test_the_coordinator_refuses_security_flags_that_cannot_work(tmp_path, flags, message):
    from coordinator.__main__ import check_security
    from coordinator.settings import CoordinatorSettings

    files = {"CERT": "c.pem", "CA": "ca.pem", "EMPTY": "keys", "MISSING": "absent"}
    for name in ("c.pem", "ca.pem"):
        write(tmp_path / name, "pem")
    write(tmp_path / "keys", "# nothing\n")
    values = {k: str(tmp_path / files[v]) for k, v in flags.items()}
    with pytest.raises(SecurityConfigError) as info:
        check_security(CoordinatorSettings(**values))
    assert message in str(info.value)


def test_workable_security_flags_pass(tmp_path):
    from coordinator.__main__ import check_security
    from coordinator.settings import CoordinatorSettings

    paths = {n: write(tmp_path / n, "x\n") for n in ("c.pem", "k.pem", "ca.pem", "keys")}
    check_security(
        CoordinatorSettings(
            tls_cert=paths["c.pem"],
            tls_key=paths["k.pem"],
            tls_ca=paths["ca.pem"],
            api_keys_file=paths["keys"],
        )
    )
