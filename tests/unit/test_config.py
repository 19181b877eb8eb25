"""MTCConfig: MaxText flag names and defaults, parsing, validation, derived values."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest

from mtc.shared.config import MTCConfig
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_mtc_environment(monkeypatch):
    """Config tests see only what they set: a LocalCluster earlier in the session puts the job
    token in MTC_PEER_TOKEN (as a pod gets its Secret), which from_flags would read."""
    import os

    for k in [k for k in os.environ if k.startswith("MTC_")]:
        monkeypatch.delenv(k)

MINUTES = "multi_tier_checkpointing_backup_interval_minutes"
STEPS = "multi_tier_checkpointing_backup_interval_steps"

# A valid multi-tier config; tests change one thing at a time.
GOOD = dict(
    enable_multi_tier_checkpointing=True,
    local_checkpoint_directory="/local",
    local_checkpoint_period=5,
    base_output_directory="gs://bucket/out",
    run_name="run1",
    **{STEPS: 10},
)


def good(**changes) -> MTCConfig:
    return MTCConfig(**{**GOOD, **changes})


def test_defaults_match_the_maxtext_flag_table():
    c = MTCConfig()
    assert c.enable_checkpointing is True
    assert c.enable_multi_tier_checkpointing is False
    assert c.colocated_python_checkpointing is False
    assert c.local_checkpoint_directory == ""
    assert c.local_checkpoint_period == 0
    assert getattr(c, MINUTES) is None
    assert getattr(c, STEPS) is None
    assert (c.base_output_directory, c.run_name) == ("", "")
    assert (c.local_max_to_keep, c.backup_max_to_keep, c.replication_factor) == (2, 5, 2)
    assert (c.peer_port, c.peer_token, c.cluster_spec, c.max_save_wait_s) == (0, "", "", None)


def test_valid_config_and_derived_values():
    c = good()
    assert c.ramdisk_root == Path("/local/mtc")
    assert c.backup_root == "gs://bucket/out/run1/mtc"
    assert c.backup_enabled
    assert c.mode == "colocated"


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        good().local_checkpoint_period = 3  # type: ignore[misc]


def test_pickles_for_the_sidecars():
    c = good(peer_token="s3cret")
    assert pickle.loads(pickle.dumps(c)) == c


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("changes, names", [
    (dict(local_checkpoint_directory=""), ["enable_multi_tier_checkpointing", "local_checkpoint_directory"]),
    (dict(local_checkpoint_directory="   "), ["local_checkpoint_directory"]),
    (dict(local_checkpoint_period=0, **{STEPS: None}), ["enable_multi_tier_checkpointing", "local_checkpoint_period"]),
    (dict(local_checkpoint_period=-1, **{STEPS: None}), ["local_checkpoint_period"]),
    (dict(**{MINUTES: 30}), [MINUTES, STEPS, "exclusive"]),
    (dict(**{MINUTES: -5, STEPS: None}), [MINUTES]),
    (dict(**{STEPS: -5}), [STEPS]),
    (dict(**{STEPS: 3}), [STEPS, "local_checkpoint_period"]),
    (dict(base_output_directory=""), ["base_output_directory"]),
    (dict(base_output_directory="", **{MINUTES: 30, STEPS: None}), ["base_output_directory"]),
    (dict(local_max_to_keep=0), ["local_max_to_keep"]),
    (dict(backup_max_to_keep=0), ["backup_max_to_keep"]),
    (dict(replication_factor=0), ["replication_factor"]),
    (dict(peer_port=-1), ["peer_port"]),
    (dict(peer_port=65536), ["peer_port"]),
    (dict(colocated_python_checkpointing=True, cluster_spec="/run/spec.json"),
     ["colocated_python_checkpointing", "cluster_spec"]),
    (dict(max_save_wait_s=-1.0), ["max_save_wait_s"]),
    (dict(max_save_wait_s=float("nan")), ["max_save_wait_s"]),
    (dict(max_save_wait_s=float("inf")), ["max_save_wait_s", "None"]),
])
def test_each_validation_error_names_the_flag(changes, names):
    with pytest.raises(ConfigError) as e:
        good(**changes)
    for name in names:
        assert name in str(e.value)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        good(peer_port=-1)


@pytest.mark.parametrize("name, value", [
    ("local_checkpoint_period", "5"),
    ("local_checkpoint_period", 5.0),
    ("local_checkpoint_period", True),
    ("local_checkpoint_period", None),
    ("enable_multi_tier_checkpointing", 1),
    ("enable_multi_tier_checkpointing", "true"),
    (STEPS, "10"),
    ("local_checkpoint_directory", 7),
    ("max_save_wait_s", "30"),
    ("max_save_wait_s", True),
    ("peer_port", "8471"),
])
def test_wrong_type_names_the_flag(name, value):
    with pytest.raises(ConfigError, match=name):
        good(**{name: value})


def test_wrong_type_of_token_does_not_echo_it():
    with pytest.raises(ConfigError, match="peer_token") as e:
        MTCConfig(peer_token=123456789)
    assert "123456789" not in str(e.value)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as e:
        MTCConfig(enable_multi_tier_checkpointing=True, peer_port=-1, local_max_to_keep=0)
    msg = str(e.value)
    for name in ("local_checkpoint_directory", "local_checkpoint_period", "peer_port",
                 "local_max_to_keep"):
        assert name in msg


def test_checkpoint_period_without_multi_tier_is_allowed():
    # The feature flag decides; a period alone is inert, as in MaxText.
    c = MTCConfig(local_checkpoint_period=5)
    assert c.should_save(5)


def test_zero_backup_interval_means_unset():
    c = good(**{STEPS: 0, MINUTES: 0}, base_output_directory="")
    assert getattr(c, STEPS) is None and getattr(c, MINUTES) is None
    assert not c.backup_enabled
    assert c == good(**{STEPS: None}, base_output_directory="")


def test_step_interval_equal_to_period_is_fine():
    assert good(**{STEPS: 5}).backup_enabled


def test_minutes_interval_is_independent_of_the_period():
    c = good(**{STEPS: None, MINUTES: 1})
    assert c.backup_enabled


def test_pathlike_and_numpy_values_are_normalised(tmp_path):
    c = good(local_checkpoint_directory=tmp_path, local_checkpoint_period=np.int64(5),
             max_save_wait_s=3)
    assert c.local_checkpoint_directory == str(tmp_path)
    assert type(c.local_checkpoint_period) is int
    assert type(c.max_save_wait_s) is float
    assert c.ramdisk_root == tmp_path / "mtc"


# ------------------------------------------------------------------ derived values


@pytest.mark.parametrize("base, run, root", [
    ("gs://bucket", "run1", "gs://bucket/run1/mtc"),
    ("gs://bucket/prefix/", "run1", "gs://bucket/prefix/run1/mtc"),
    ("gs://bucket", "", "gs://bucket/mtc"),
    ("/data/out", "r", "/data/out/r/mtc"),
    ("/", "r", "/r/mtc"),
    ("file:///tmp/x", "r", "file:///tmp/x/r/mtc"),
])
def test_backup_root(base, run, root):
    assert good(base_output_directory=base, run_name=run).backup_root == root


def test_backup_root_without_base_names_the_flag():
    with pytest.raises(ConfigError, match="base_output_directory"):
        MTCConfig().backup_root


def test_ramdisk_root_without_directory_names_the_flag():
    with pytest.raises(ConfigError, match="local_checkpoint_directory"):
        MTCConfig().ramdisk_root


def test_mode_follows_cluster_spec():
    assert MTCConfig(cluster_spec="/run/spec.json").mode == "cluster"
    assert MTCConfig(colocated_python_checkpointing=True).mode == "colocated"


def test_should_save():
    c = good()
    assert [s for s in range(16) if c.should_save(s)] == [0, 5, 10, 15]
    assert not MTCConfig().should_save(5)  # period 0
    assert not good(enable_checkpointing=False).should_save(5)
    with pytest.raises(ValueError):
        c.should_save(-1)
    with pytest.raises(ValueError):
        c.should_save(5.0)


def test_replace_validates_and_leaves_the_original():
    c = good()
    c2 = c.replace(local_checkpoint_period=10)
    assert (c.local_checkpoint_period, c2.local_checkpoint_period) == (5, 10)
    with pytest.raises(ConfigError, match="local_checkpoint_directory"):
        c.replace(local_checkpoint_directory="")
    with pytest.raises(ConfigError, match="did you mean 'local_checkpoint_period'"):
        c.replace(local_checkpoint_periodd=10)


# ------------------------------------------------------------------ the token


def test_token_is_not_in_repr_str_or_dict():
    c = good(peer_token="s3cret-token")
    assert "s3cret-token" not in repr(c)
    assert "s3cret-token" not in str(c)
    assert "peer_token" not in c.to_dict()
    assert "s3cret-token" not in str(c.to_dict())
    assert c.peer_token == "s3cret-token"


def test_to_dict_round_trip():
    c = good(peer_port=8471, max_save_wait_s=2.5)
    assert MTCConfig(**c.to_dict()) == c


# ------------------------------------------------------------------ from_flags


def _as_flags(c: MTCConfig) -> list[str]:
    return [f"{k}={'' if v is None else v}" for k, v in c.to_dict().items()]


@pytest.mark.parametrize("c", [
    MTCConfig(),
    good(),
    good(**{STEPS: None, MINUTES: 30}, peer_port=8471, max_save_wait_s=0.5,
         local_max_to_keep=3, replication_factor=1, cluster_spec="/run/spec.json"),
])
def test_from_flags_round_trip(c):
    assert MTCConfig.from_flags(_as_flags(c)) == c


def test_from_flags_maxtext_command_line():
    argv = ["maxtext/configs/base.yml", "run_name=job", "base_output_directory=gs://b/o",
            "model_name=default", "steps=100", "per_device_batch_size=6",
            "enable_multi_tier_checkpointing=True", "local_checkpoint_period=10",
            "local_checkpoint_directory=/local", f"{MINUTES}=30"]
    c = MTCConfig.from_flags(argv, ignore_unknown=True)
    assert c.enable_multi_tier_checkpointing and c.local_checkpoint_period == 10
    assert getattr(c, MINUTES) == 30 and c.backup_root == "gs://b/o/job/mtc"


@pytest.mark.parametrize("text, value", [
    ("true", True), ("True", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("NO", False),
])
def test_from_flags_bools(text, value):
    assert MTCConfig.from_flags([f"colocated_python_checkpointing={text}"]) \
        .colocated_python_checkpointing is value


@pytest.mark.parametrize("text", ["None", "none", ""])
def test_from_flags_none_for_optional_numbers(text):
    c = MTCConfig.from_flags([f"{STEPS}={text}", f"max_save_wait_s={text}"])
    assert getattr(c, STEPS) is None and c.max_save_wait_s is None


def test_from_flags_overrides_win():
    c = MTCConfig.from_flags(["local_checkpoint_period=5", "run_name=a"], run_name="b")
    assert (c.local_checkpoint_period, c.run_name) == (5, "b")


def test_from_flags_value_may_contain_equals():
    assert MTCConfig.from_flags(["run_name=a=b"]).run_name == "a=b"


def test_from_flags_unknown_flag_suggests_the_closest():
    with pytest.raises(ConfigError, match="'local_checkpoint_perod'.*did you mean 'local_checkpoint_period'"):
        MTCConfig.from_flags(["local_checkpoint_perod=5"])


def test_from_flags_unknown_flag_far_from_any_lists_the_valid_names():
    with pytest.raises(ConfigError, match="zzz.*local_checkpoint_period"):
        MTCConfig.from_flags(["zzz=1"])


def test_from_flags_ignore_unknown_skips_only_unknown_keys():
    c = MTCConfig.from_flags(["foo=1", "just-a-word", "local_checkpoint_period=3"], ignore_unknown=True)
    assert c.local_checkpoint_period == 3
    with pytest.raises(ConfigError, match="local_checkpoint_period"):
        MTCConfig.from_flags(["foo=1", "local_checkpoint_period=three"], ignore_unknown=True)


def test_from_flags_unknown_override_is_an_error_even_when_ignoring_flags():
    with pytest.raises(ConfigError, match="did you mean 'run_name'"):
        MTCConfig.from_flags([], ignore_unknown=True, run_nme="x")


def test_from_flags_without_equals():
    with pytest.raises(ConfigError, match="key=value"):
        MTCConfig.from_flags(["local_checkpoint_period"])


def test_from_flags_duplicate_key():
    with pytest.raises(ConfigError, match="run_name.*more than once"):
        MTCConfig.from_flags(["run_name=a", "run_name=b"])


@pytest.mark.parametrize("flag, name", [
    ("enable_checkpointing=maybe", "enable_checkpointing"),
    ("enable_checkpointing=", "enable_checkpointing"),
    ("local_checkpoint_period=ten", "local_checkpoint_period"),
    ("local_checkpoint_period=1.5", "local_checkpoint_period"),
    ("local_checkpoint_period=", "local_checkpoint_period"),
    (f"{STEPS}=abc", STEPS),
    ("max_save_wait_s=soon", "max_save_wait_s"),
])
def test_from_flags_bad_value_names_the_flag(flag, name):
    with pytest.raises(ConfigError, match=f"{name}="):
        MTCConfig.from_flags([flag])


def test_from_flags_result_is_validated():
    with pytest.raises(ConfigError, match="local_checkpoint_directory"):
        MTCConfig.from_flags(["enable_multi_tier_checkpointing=true", "local_checkpoint_period=5"])


# ------------------------------------------------------------------ from_env


def test_from_env_reads_every_flag():
    env = {
        "MTC_ENABLE_MULTI_TIER_CHECKPOINTING": "true",
        "MTC_LOCAL_CHECKPOINT_DIRECTORY": "/local",
        "MTC_LOCAL_CHECKPOINT_PERIOD": "10",
        "MTC_MULTI_TIER_CHECKPOINTING_BACKUP_INTERVAL_MINUTES": "30",
        "MTC_BASE_OUTPUT_DIRECTORY": "gs://b",
        "MTC_CLUSTER_SPEC": "/run/spec.json",
        "MTC_PEER_TOKEN": "tok",
        "MTC_PEER_PORT": "8471",
        "MTC_MAX_SAVE_WAIT_S": "12.5",
        "PATH": "/usr/bin",
    }
    c = MTCConfig.from_env(env)
    assert c.enable_multi_tier_checkpointing and c.local_checkpoint_period == 10
    assert getattr(c, MINUTES) == 30 and c.base_output_directory == "gs://b"
    assert (c.cluster_spec, c.peer_token, c.peer_port, c.max_save_wait_s) == \
        ("/run/spec.json", "tok", 8471, 12.5)
    assert c.mode == "cluster"


def test_from_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("MTC_RUN_NAME", "from-env")
    assert MTCConfig.from_env().run_name == "from-env"


def test_from_env_overrides_win():
    assert MTCConfig.from_env({"MTC_RUN_NAME": "a"}, run_name="b").run_name == "b"


@pytest.mark.parametrize("var, value", [
    ("MTC_LOCAL_CHECKPOINT_PERIOD", "ten"),
    ("MTC_LOCAL_CHECKPOINT_PERIOD", ""),
    ("MTC_ENABLE_CHECKPOINTING", "on"),
    ("MTC_MULTI_TIER_CHECKPOINTING_BACKUP_INTERVAL_STEPS", "1e3"),
    ("MTC_PEER_PORT", "http"),
    ("MTC_MAX_SAVE_WAIT_S", "forever"),
])
def test_from_env_bad_value_names_the_variable(var, value):
    with pytest.raises(ConfigError, match=var):
        MTCConfig.from_env({var: value})


def test_from_env_warns_on_a_misspelt_variable():
    with pytest.warns(UserWarning, match="MTC_LOCAL_CHECKPOINT_PERIOD"):
        MTCConfig.from_env({"MTC_LOCAL_CHECKPIONT_PERIOD": "5"})


def test_from_env_ignores_other_mtc_variables(recwarn):
    MTCConfig.from_env({"MTC_CRASH_POINT": "after_blobs"})
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_from_flags_takes_mtc_own_settings_from_the_environment_and_flags_win():
    env = {"MTC_PEER_PORT": "29010", "MTC_REPLICATION_FACTOR": "3", "MTC_LOCAL_CHECKPOINT_PERIOD": "7"}
    flags = ["enable_multi_tier_checkpointing=true", "local_checkpoint_directory=/tmp/x",
             "local_checkpoint_period=5", "model_name=llama"]
    c = MTCConfig.from_flags(flags, ignore_unknown=True, environ=env)
    assert (c.peer_port, c.replication_factor) == (29010, 3)  # as `mtc manifests render` sets them
    assert c.local_checkpoint_period == 5  # MaxText's flags never come from the environment
    assert MTCConfig.from_flags(flags + ["replication_factor=2"], ignore_unknown=True, environ=env).replication_factor == 2
    assert MTCConfig.from_flags(flags, ignore_unknown=True, environ=env, peer_port=1234).peer_port == 1234
    assert MTCConfig.from_flags(flags, ignore_unknown=True, environ={}).peer_port == 0
    with pytest.raises(ConfigError, match="MTC_PEER_PORT"):
        MTCConfig.from_flags(flags, ignore_unknown=True, environ={"MTC_PEER_PORT": "many"})


def test_ignore_unknown_warns_about_a_misspelt_checkpoint_flag():
    import warnings as _w

    with pytest.warns(UserWarning, match="'multi_tier_checkpointing_backup_interval_minute'.*did you mean "
                                         "'multi_tier_checkpointing_backup_interval_minutes'"):
        cfg = MTCConfig.from_flags(["enable_multi_tier_checkpointing=True", "local_checkpoint_directory=/l",
                                    "local_checkpoint_period=5", "base_output_directory=/b",
                                    "multi_tier_checkpointing_backup_interval_minute=30"],
                                   ignore_unknown=True, environ={})
    assert cfg.multi_tier_checkpointing_backup_interval_minutes is None
    with _w.catch_warnings():
        _w.simplefilter("error")  # MaxText's other flags stay silent
        MTCConfig.from_flags(["model_name=llama3.1-8b", "steps=100", "checkpoint_period=100",
                              "async_checkpointing=True", "enable_emergency_checkpoint=False"],
                             ignore_unknown=True, environ={})


def test_readme_lists_every_variable_mtc_reads_and_no_other():
    import re
    from pathlib import Path

    from mtc.shared.config import known_env

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(MTC_[A-Z0-9_]+)` \|", section, re.M))
    assert listed == known_env(), (sorted(known_env() - listed), sorted(listed - known_env()))


@pytest.mark.parametrize("env, says", [({"MTC_STANBY": "0"}, "did you mean MTC_STANDBY?"),
                                        ({"MTC_PREEMPTION_GRACE": "30"}, "did you mean MTC_PREEMPTION_GRACE_S?")])
def test_a_misspelled_variable_of_any_part_of_mtc_is_warned_about(env, says):
    with pytest.warns(UserWarning, match=says.replace("?", r"\?")):
        MTCConfig.from_env(env)


@pytest.mark.parametrize("text, on", [("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False),
                                      ("false", False), ("No", False), ("off", False), ("", None)])
def test_one_rule_for_on_and_off(text, on):
    from mtc.shared.config import env_flag

    assert env_flag("MTC_X", {"MTC_X": text}, default=None) is on


def test_a_value_neither_on_nor_off_names_the_variable():
    from mtc.shared.config import env_flag

    with pytest.raises(ConfigError, match="MTC_DATA_RESTART='maybe' is neither on nor off"):
        env_flag("MTC_DATA_RESTART", {"MTC_DATA_RESTART": "maybe"})


def test_mtc_cluster_spec_switches_a_config_built_in_code_to_cluster_mode():
    base = MTCConfig(local_checkpoint_directory="/tmp/x")
    assert base.with_cluster_spec_from_env({"MTC_CLUSTER_SPEC": "/run/spec.json"}).cluster_spec == "/run/spec.json"
    assert base.with_cluster_spec_from_env({"MTC_CLUSTER_SPEC": " "}) is base
    assert base.with_cluster_spec_from_env({}).mode == "colocated"
    named = base.replace(cluster_spec="/mine.json")  # the script's own wins
    assert named.with_cluster_spec_from_env({"MTC_CLUSTER_SPEC": "/run/spec.json"}).cluster_spec == "/mine.json"
