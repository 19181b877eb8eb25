"""Object names, URL dispatch, error classification and the optional dependency."""

from __future__ import annotations

import importlib
import sys

import pytest

from mtc.shared.errors import ConfigError, MTCError
from mtc.shared.objstore import open_store
from mtc.shared.objstore.store import (
    FatalStoreError,
    InvalidObjectNameError,
    ObjectNotFoundError,
    TransientStoreError,
    validate_name,
    validate_prefix,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["restore.version", "blobs/0123abcd", "backups/2026-01-02T03-04-05Z-step-10.json",
                                  "a/b/c/d", "blobs/x..y", "ünïcode/ok"])
def test_good_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name, why", [
    ("", "empty"),
    ("/abs/path", "starts with '/'"),
    ("..", "'..' part"),
    ("../up", "'..' part"),
    ("blobs/../../etc/passwd", "'..' part"),
    ("a/./b", "'.' part"),
    ("a//b", "empty part"),
    ("blobs/", "empty part"),
    (".hidden", "starts with '.'"),
    ("blobs/.mtc-tmp-123", "starts with '.'"),
    ("a\\b", "backslash"),
    ("a\nb", "control character"),
    ("a\x00b", "control character"),
    ("x" * 1025, "longer than 1024"),
    (b"blobs/x", "not bytes"),
    (None, "not NoneType"),
])
def test_bad_names(name, why):
    with pytest.raises(InvalidObjectNameError, match="not valid") as info:
        validate_name(name)
    assert why in str(info.value)


def test_prefixes():
    for p in ("", "blobs/", "backups/2026-", "a/b/"):
        assert validate_prefix(p) == p
    for p in ("/", "../", "a//", "/abs"):
        with pytest.raises(InvalidObjectNameError):
            validate_prefix(p)


def test_error_hierarchy():
    assert issubclass(TransientStoreError, MTCError) and issubclass(FatalStoreError, MTCError)
    assert not issubclass(TransientStoreError, FatalStoreError)
    assert issubclass(ObjectNotFoundError, FatalStoreError) and issubclass(ObjectNotFoundError, FileNotFoundError)
    assert issubclass(InvalidObjectNameError, FatalStoreError) and issubclass(InvalidObjectNameError, ValueError)


def test_open_store_local(tmp_path):
    from mtc.shared.objstore.local import LocalStore

    for url, root in [(str(tmp_path / "a"), tmp_path / "a"), ((tmp_path / "b").as_uri(), tmp_path / "b"),
                      (f"file://localhost{tmp_path}/c", tmp_path / "c")]:
        store = open_store(url)
        assert isinstance(store, LocalStore) and store.root == root and root.is_dir()
        assert store.url == root.as_uri() + "/"


@pytest.mark.parametrize("url", ["", "s3://bucket/x", "gs://", "gs:///x", "file://host/x", "file://"])
def test_open_store_bad_urls(url):
    with pytest.raises(ConfigError, match="backup store URL"):
        open_store(url)


def test_open_store_gcs_needs_no_network(monkeypatch):
    """gs:// opens a GCSStore (emulator from STORAGE_EMULATOR_HOST); nothing is contacted yet."""
    pytest.importorskip("google.cloud.storage")
    from mtc.shared.objstore.gcs import GCSStore

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")  # discard port: nothing listens
    with open_store("gs://bkt/base/run/mtc/", deadline=5) as store:
        assert isinstance(store, GCSStore)
        assert (store.bucket_name, store.prefix, store.url) == ("bkt", "base/run/mtc/", "gs://bkt/base/run/mtc/")
        assert store.deadline == 5
    with open_store("gs://bkt") as store:
        assert store.prefix == "" and store.url == "gs://bkt/"


@pytest.mark.parametrize("value", ["not a url", "ftp://h:1", "http://", "http://h:1/path", "h:notaport"])
def test_bad_emulator_host_names_the_variable(monkeypatch, value):
    pytest.importorskip("google.cloud.storage")
    from mtc.shared.objstore.gcs import make_client

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", value)
    with pytest.raises(ConfigError, match="STORAGE_EMULATOR_HOST"):
        make_client()


def test_transient_vs_fatal_classification():
    pytest.importorskip("google.cloud.storage")
    import requests
    from google.api_core import exceptions as gexc

    from mtc.shared.objstore.gcs import is_transient

    for exc in (gexc.TooManyRequests("slow down"), gexc.InternalServerError("x"), gexc.BadGateway("x"),
                gexc.ServiceUnavailable("x"), gexc.GatewayTimeout("x"), gexc.from_http_status(408, "request timeout"),
                requests.ConnectionError("refused"), requests.ReadTimeout("slow"), ConnectionResetError(),
                TimeoutError()):
        assert is_transient(exc), exc
    for exc in (gexc.NotFound("no bucket"), gexc.Forbidden("no"), gexc.BadRequest("bad"),
                gexc.Unauthorized("who"), gexc.PreconditionFailed("exists"), FileNotFoundError("local"),
                ValueError("bug")):
        assert not is_transient(exc), exc


def test_missing_google_cloud_storage_names_the_extra(monkeypatch):
    """Without google-cloud-storage, importing the GCS backend says what to install."""
    pytest.importorskip("google.cloud.storage")
    import google.cloud

    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)  # import fails as if absent
    monkeypatch.delattr(google.cloud, "storage", raising=False)
    monkeypatch.delitem(sys.modules, "mtc.shared.objstore.gcs", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'mtc\[gcs\]'"):
        importlib.import_module("mtc.shared.objstore.gcs")
