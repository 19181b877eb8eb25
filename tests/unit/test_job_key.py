"""The job key (mtc.shared.job_key): tags that check only under the key that made them, for the kind,
name and content they were made for; older keys accepted for reading; what a process without a key
or with a short one gets."""

from __future__ import annotations

import pytest

from mtc.shared import job_key
from mtc.shared.errors import ConfigError
from mtc.shared.job_key import JobKey

pytestmark = pytest.mark.unit

TOKEN = "the-jobs-token-0123456789abcdef"
NEW = "a-key-of-its-own-0123456789abcdef"


def test_a_tag_checks_only_for_its_kind_name_and_content():
    key = JobKey.from_secret(TOKEN, {})
    tag = key.sign("backup manifest", "run/b1", b"content")
    assert key.check("backup manifest", "run/b1", b"content", tag) == job_key.OK
    assert key.check("backup manifest", "run/b1", b"contenT", tag) == job_key.BAD
    assert key.check("backup manifest", "run/b2", b"content", tag) == job_key.BAD  # renamed
    assert key.check("finalize marker", "run/b1", b"content", tag) == job_key.BAD  # another kind
    assert key.check("backup manifest", "run/b1", b"content", None) == job_key.UNSIGNED
    assert key.check("backup manifest", "run/b1", b"content", "not-a-tag") == job_key.BAD
    other = JobKey.from_secret("another-jobs-token-0123456789", {})
    assert other.check("backup manifest", "run/b1", b"content", tag) == job_key.UNKNOWN_KEY


def test_the_key_is_not_the_token_and_its_id_names_no_secret():
    key = JobKey.from_secret(TOKEN, {})
    tag = key.sign("k", "n", b"")
    assert TOKEN not in tag and key.key_id and tag.startswith(key.key_id + "-")
    assert JobKey.from_secret(None, {"MTC_PEER_TOKEN": TOKEN}).key_id == key.key_id  # the token from the environment


def test_rotation_reads_older_keys_only_while_they_are_listed():
    old = JobKey.from_secret(TOKEN, {})
    tag = old.sign("k", "n", b"x")
    rotated = JobKey.from_secret(TOKEN, {"MTC_JOB_KEY": NEW, "MTC_JOB_KEYS_ACCEPTED": f"{TOKEN}, "})
    assert rotated.key_id != old.key_id  # MTC_JOB_KEY comes before the token
    assert rotated.check("k", "n", b"x", tag) == job_key.OK
    assert rotated.sign("k", "n", b"x").startswith(rotated.key_id)
    dropped = JobKey.from_secret(TOKEN, {"MTC_JOB_KEY": NEW})
    assert dropped.check("k", "n", b"x", tag) == job_key.UNKNOWN_KEY


def test_no_secret_signs_nothing_and_checks_nothing():
    none = JobKey.from_secret(None, {})
    assert not none.enabled and none.sign("k", "n", b"x") is None
    tag = JobKey.from_secret(TOKEN, {}).sign("k", "n", b"x")
    assert none.check("k", "n", b"x", tag) == job_key.NO_KEY


@pytest.mark.parametrize("env,says", [({"MTC_JOB_KEY": "short"}, "MTC_JOB_KEY has a key of 5 characters"),
                                      ({"MTC_JOB_KEYS_ACCEPTED": "tiny"}, "MTC_JOB_KEYS_ACCEPTED")])
def test_a_short_key_is_refused_by_name(env, says):
    with pytest.raises(ConfigError, match=says):
        JobKey.from_secret(TOKEN, env)


def test_a_child_with_a_token_of_its_own_keeps_the_jobs_key():
    assert JobKey.for_child({"MTC_PEER_TOKEN": TOKEN}) == {"MTC_JOB_KEY": TOKEN}
    assert JobKey.for_child({"MTC_PEER_TOKEN": TOKEN, "MTC_JOB_KEY": NEW}) == {"MTC_JOB_KEY": NEW}
    assert JobKey.for_child({}) == {}
    child = JobKey.from_secret("the-childs-own-token-0123456789", JobKey.for_child({"MTC_PEER_TOKEN": TOKEN}))
    assert child.key_id == JobKey.from_secret(TOKEN, {}).key_id


def test_a_refused_object_is_counted_and_warned_about_once(caplog):
    before = job_key.rejected_counts().get("test kind", 0)
    for _ in range(3):
        job_key.refuse("test kind", "obj-1", job_key.BAD)
    assert job_key.rejected_counts()["test kind"] == before + 3
    assert sum("obj-1" in r.getMessage() for r in caplog.records) == 1
