"""The MaxText launcher's checks that need no MaxText: version range, flags refused before training."""

from __future__ import annotations

import types

import pytest

from mtc.head.maxtext import launcher
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.unit

GOOD = ["base.yml", "run_name=r", "base_output_directory=/tmp/out", "enable_multi_tier_checkpointing=True",
        "local_checkpoint_directory=/local", "local_checkpoint_period=10",
        "multi_tier_checkpointing_backup_interval_minutes=30"]


@pytest.mark.parametrize("version", ["0.2.4", "0.3.0", "1.0.0", "0.1.9"])
def test_maxtext_outside_the_supported_range_is_refused(version):
    with pytest.raises(launcher.UnsupportedMaxTextError, match=r"maxtext >= 0\.2\.5, < 0\.3"):
        launcher.check_maxtext_version(version)


@pytest.mark.parametrize("version", ["0.2.5", "0.2.9", "0.2.5.post1"])
def test_supported_versions_pass(version):
    assert launcher.check_maxtext_version(version) == version


@pytest.mark.parametrize("drop,add,names", [
    ("local_checkpoint_directory=", [], "local_checkpoint_directory"),
    ("local_checkpoint_period=", [], "local_checkpoint_period"),
    (None, ["multi_tier_checkpointing_backup_interval_steps=20"], "exclusive"),
    ("multi_tier_checkpointing_backup_interval_minutes=", [], "one backup interval"),
    (None, ["local_checkpoint_period=abc"], "local_checkpoint_period"),
])
def test_bad_flags_fail_before_training_naming_the_flag(capsys, drop, add, names):
    argv = ["mtc.head.maxtext"] + [a for a in GOOD if drop is None or not a.startswith(drop)] + add
    assert launcher.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtc: ") and names in err and "Traceback" not in err, err


def test_config_from_maxtext_reads_its_flags_and_mtc_env():
    mx = types.SimpleNamespace(enable_checkpointing=True, enable_multi_tier_checkpointing=True,
                               colocated_python_checkpointing=True, local_checkpoint_directory="/local",
                               local_checkpoint_period=5, multi_tier_checkpointing_backup_interval_minutes=None,
                               multi_tier_checkpointing_backup_interval_steps=10, base_output_directory="/b",
                               run_name="run")
    cfg = launcher.config_from_maxtext(mx, environ={"MTC_REPLICATION_FACTOR": "3", "MTC_PEER_PORT": "29010"})
    assert (cfg.local_checkpoint_period, cfg.multi_tier_checkpointing_backup_interval_steps) == (5, 10)
    assert (cfg.replication_factor, cfg.peer_port, cfg.colocated_python_checkpointing) == (3, 29010, True)
    assert cfg.backup_root.endswith("run/mtc")
    with pytest.raises(ConfigError, match="exclusive"):
        launcher.config_from_maxtext(types.SimpleNamespace(**{**vars(mx), "multi_tier_checkpointing_backup_interval_minutes": 5}),
                                     environ={})


class _Manager:
    def __init__(self, error: Exception | None = None):
        self.closed, self.error = 0, error

    def close(self):
        self.closed += 1
        if self.error:
            raise self.error


def test_an_elastic_retry_closes_the_abandoned_attempts_manager(monkeypatch, caplog):
    from mtc.head.elastic import HostLostError

    lost = _Manager(HostLostError("DATA_LOSS: host s1-h0 stopped answering"))
    monkeypatch.setattr(launcher, "_managers", [lost])
    launcher._retire_previous_managers(types.SimpleNamespace(elastic_enabled=True))
    assert lost.closed == 1 and launcher._managers == []  # closed once; its error logged, not raised
    assert "closing the checkpoint manager" in caplog.text and "DATA_LOSS" in caplog.text


def test_outside_elastic_mode_no_manager_is_closed(monkeypatch):
    kept = _Manager()
    monkeypatch.setattr(launcher, "_managers", [kept])
    launcher._retire_previous_managers(types.SimpleNamespace(elastic_enabled=False))
    launcher._retire_previous_managers(types.SimpleNamespace())
    assert kept.closed == 0 and launcher._managers == [kept]


def test_the_launcher_warns_about_a_misspelled_mtc_variable(monkeypatch, caplog, capsys):
    """The launcher (the production head) builds its configuration from MaxText's flags, not from
    MTCConfig.from_env: it says a misspelled MTC_* variable itself, before anything runs."""
    monkeypatch.setenv("MTC_STANBY", "0")
    with caplog.at_level("WARNING", logger=launcher.log.name):
        assert launcher.main(["mtc.head.maxtext"]) == 2  # the usage line: nothing else ran
    assert "MTC_STANBY is not one mtc reads; did you mean MTC_STANDBY?" in caplog.text
