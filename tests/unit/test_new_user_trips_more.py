"""More of what a new user tripped over, each pinned: one line that names the thing and the fix, no traceback."""

from __future__ import annotations

import pytest

from mtc.head.tools.cli.main import main

pytestmark = pytest.mark.unit

PLAN = ["plan", "--hosts", "4", "--mtbf", "1h", "--costs", "1,2,3,4,5,6"]


def one_line(err: str) -> bool:
    return "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra,says", [
    (["--params", "nan"], "--params"), (["--params", "inf"], "--params"),
    (["--params", "1e9", "--step-time", "nan"], "--step-time"),
    (["--params", "1e9", "--bytes-per-param", "nan"], "--bytes-per-param"),
    (["--params", "1e9", "--bytes-per-param", "-1"], "--bytes-per-param"),
])
def test_plan_with_a_number_that_is_not_finite_or_positive(capsys, extra, says):
    assert main([*PLAN, *extra]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and says in err and "positive, finite" in err, err


def test_plan_with_a_cost_that_is_not_a_number(capsys):
    assert main(["plan", "--hosts", "4", "--mtbf", "1h", "--params", "1e9", "--costs", "1,2,3,4,5,x"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "--costs" in err, err


def test_tls_generate_into_a_file_or_an_unwritable_place(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    assert main(["tls", "generate", str(f)]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "is not a folder" in err, err
    assert f.read_text() == "keep me"
    assert main(["tls", "generate", "/proc/nope"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "/proc/nope" in err and "choose a folder" in err, err


def test_tls_generate_into_an_empty_name_writes_nothing_here(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["tls", "generate", ""]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "is empty" in err and list(tmp_path.iterdir()) == [], err


def test_tls_generate_days_is_bounded(capsys, tmp_path):
    assert main(["tls", "generate", str(tmp_path / "t"), "--days", "1000000"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "--days" in err and "3650" in err, err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("to,says", [("file", "is a file"), ("/proc/nope", "cannot be made")])
def test_export_to_a_file_or_an_unwritable_place_is_refused_before_any_sidecar_starts(capsys, tmp_path, to, says):
    import time

    (tmp_path / "file").write_text("keep me")
    (tmp_path / "r" / "mtc" / "backups").mkdir(parents=True)
    t0 = time.monotonic()
    rc = main(["export", "--to", str(tmp_path / to) if to == "file" else to,
               "--base-output-directory", str(tmp_path), "--run-name", "r"])
    err = capsys.readouterr().err
    assert rc == 2 and one_line(err) and says in err and "[Errno" not in err, err
    assert time.monotonic() - t0 < 2  # a sidecar daemon takes longer than that to start
    assert (tmp_path / "file").read_text() == "keep me"


def test_export_to_an_empty_name_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--to", "", "--cluster-spec", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "--to is empty" in err and list(tmp_path.iterdir()) == [], err


def test_export_max_memory_zero_says_what_a_size_is(capsys):
    assert main(["export", "--to", "x", "--max-memory", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--max-memory" in err and "positive" in err and "1GiB" in err and "parse_size" not in err, err


def test_export_without_orbax_names_orbax_and_the_extra():
    import subprocess
    import sys

    code = ("import sys; [sys.modules.__setitem__(m, None) for m in ('orbax', 'etils')]; "
            "from mtc.head.tools.cli.main import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "export", "--to", "/tmp/mtc-test-no-orbax", "--cluster-spec",
                        "/nonexistent/cluster.json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and one_line(r.stderr), r.stderr
    assert "orbax-checkpoint" in r.stderr and "mtc[export]" in r.stderr and "etils" not in r.stderr, r.stderr


@pytest.mark.parametrize("extra,says,not_says", [
    (["--backups", "0"], "--backups 0", "--bytes-per-s"),
    (["--bytes-per-s", "0"], "--bytes-per-s 0", "--backups"),
])
def test_verify_says_which_of_its_numbers_is_wrong(capsys, tmp_path, extra, says, not_says):
    rc = main(["verify", "--backup", "--cluster-spec", str(tmp_path / "c.json"), "--base-output-directory",
               str(tmp_path), "--run-name", "r", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and one_line(err) and says in err and not_says not in err.split(":", 2)[2], err
    assert "e+07" not in err, err


def test_status_prints_brackets_as_written():
    import io

    from rich.console import Console

    from mtc.head.tools.cli.status import Status, StepRow, render

    why = "pip install 'mtc[gcs]' (ImportError)"
    st = Status(hosts=["h0"], unreachable={}, steps=[StepRow(3, ["h0"], ["h0"], 1, False, [], True, f"[bold]{why}")],
                backup_root="gs://b/r/mtc", backups=[], restore_version=None, choice=3, reason=f"step 3; {why}",
                notes=[why], backup_error=why)
    out = io.StringIO()
    render(st, Console(file=out, width=300))
    text = out.getvalue()
    assert text.count("'mtc[gcs]'") == 3 and "[bold]" in text, text


# ---- mtc manifests check applies render's rules to a hand edit -------------------------------------------

def _rendered() -> list[dict]:
    from mtc.head.tools.k8s.manifests import render_documents
    from mtc.head.tools.k8s.options import ManifestOptions

    return render_documents(ManifestOptions(
        name="llama", command="python3 -m maxtext.trainers.pre_train.train model_name=llama3.1-8b",
        base_output_directory="gs://bucket/ckpt", params=8e9, peer_token="0123456789abcdef0123456789abcdef",
        metrics_port=9431, preemption_grace_s=60))


def _pods(docs):
    js = next(d for d in docs if d["kind"] == "JobSet")
    return {rj["name"]: rj["template"]["spec"]["template"]["spec"] for rj in js["spec"]["replicatedJobs"]}


def _container(docs, job, name):
    spec = _pods(docs)[job]
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def _set_env(c, key, value):
    c["env"] = [e for e in c["env"] if e["name"] != key]
    if value is not None:
        c["env"].append({"name": key, "value": value})


def _grace(d, v):
    _pods(d)["pathways-head"]["terminationGracePeriodSeconds"] = v


def _monitoring(d):
    return next(x for x in d if x["kind"] == "PodMonitoring")


def _other_tls_secret(d):
    vol = next(v for v in _pods(d)["worker"]["volumes"] if v["name"] == "mtc-tls")
    vol["secret"]["secretName"] = "another-mtc-tls"


def _tls_without_mount(d):
    c = _container(d, "worker", "colocated-python-sidecar")
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "mtc-tls"]


def _tls_only_in_head(d):
    _set_env(_container(d, "worker", "colocated-python-sidecar"), "MTC_TLS_DIR", None)


@pytest.mark.parametrize("edit,says", [
    (lambda d: _grace(d, 30), "terminationGracePeriodSeconds 30 is not above MTC_PREEMPTION_GRACE_S=60"),
    (lambda d: _grace(d, -5), "terminationGracePeriodSeconds -5 is negative"),
    (lambda d: _set_env(_container(d, "pathways-head", "main"), "MTC_PREEMPTION_GRACE_S", "-1"),
     "MTC_PREEMPTION_GRACE_S='-1'"),
    (lambda d: _set_env(_container(d, "pathways-head", "main"), "MTC_METRICS_PORT", "9999"),
     "MTC_METRICS_PORT=9999, but its port named metrics is 9431"),
    (lambda d: _monitoring(d)["spec"]["endpoints"][0].update(port="metrix"), "endpoint port 'metrix' is not the name"),
    (lambda d: _monitoring(d)["spec"]["selector"]["matchLabels"].update(
        {"jobset.sigs.k8s.io/replicatedjob-name": "worker"}), "selects replicatedJob worker"),
    (_other_tls_secret, "from another-mtc-tls: each accepts only certificates its own CA signed"),
    (_tls_without_mount, "MTC_TLS_DIR=/etc/mtc/tls, but nothing is mounted there"),
    (_tls_only_in_head, "has TLS (MTC_TLS_DIR) and replicatedJob worker, container colocated-python-sidecar has not"),
    (lambda d: _container(d, "worker", "colocated-python-sidecar")["ports"][1].update(containerPort=99999),
     "containerPort 99999 is out of range"),
])
def test_manifests_check_refuses_what_render_refuses(capsys, tmp_path, edit, says):
    import yaml

    from mtc.head.tools.k8s.check import check_documents

    docs = _rendered()
    assert check_documents(docs, params=8e9).problems == []
    edit(docs)
    problems = check_documents(docs, params=8e9).problems
    assert len(problems) == 1 and says in problems[0], problems
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    assert main(["manifests", "check", str(f), "--params", "8e9"]) == 1
    assert says in capsys.readouterr().out


# ---- the demo ---------------------------------------------------------------------------------------------

def test_demo_keep_hints_run_as_written_without_mtc_on_path(tmp_path, monkeypatch):
    import os
    import subprocess

    from mtc.head.tools.demo import kept_message

    (tmp_path / "cluster" / "s0-h0").mkdir(parents=True)
    monkeypatch.setenv("PATH", os.defpath)  # README's install: the venv's bin is not on PATH
    text = kept_message(tmp_path)
    line = next(ln for ln in text.splitlines() if " status --local-checkpoint-directory" in ln)
    mtc = line.strip().split(" status ")[0]
    r = subprocess.run(f"{mtc} --version", shell=True, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": os.defpath})
    assert r.returncode == 0 and r.stdout.startswith("mtc "), (mtc, r.stderr)
    assert "pip install" in text and " pip install" not in text.replace("/pip install", ""), text


@pytest.mark.parametrize("given,env,says", [
    (None, "nine", "MTC_METRICS_PORT=nine is not a port"), (70000, "", "--metrics-port=70000 is not a port"),
])
def test_demo_metrics_port_is_checked_before_it_runs(given, env, says):
    from mtc.head.tools.demo import metrics_port_of

    port, problem = metrics_port_of(given, {"MTC_METRICS_PORT": env})
    assert port == 0 and problem and says in problem, problem


def test_demo_metrics_port_taken_and_from_the_environment():
    import socket

    from mtc.head.tools.demo import metrics_port_of

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        taken = s.getsockname()[1]
        port, problem = metrics_port_of(None, {"MTC_METRICS_PORT": str(taken)})
        assert port == 0 and "is taken" in problem and str(taken) in problem, problem
    assert metrics_port_of(None, {"MTC_METRICS_PORT": str(taken)}) == (taken, None)
    assert metrics_port_of(None, {}) == (0, None) and metrics_port_of(0, {"MTC_METRICS_PORT": "9431"}) == (0, None)



def test_an_infinite_preemption_grace_is_refused_by_render_and_check(capsys, tmp_path):
    import yaml

    from mtc.head.tools.k8s.check import check_documents

    assert main(["manifests", "render", "--name", "x", "--base-output-directory", "gs://b/c", "--params", "8e9",
                 "--command", "python3 -m maxtext.trainers.pre_train.train", "--preemption-grace-s", "inf"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "--preemption-grace-s=inf" in err, err
    docs = _rendered()
    _set_env(_container(docs, "pathways-head", "main"), "MTC_PREEMPTION_GRACE_S", "inf")
    problems = check_documents(docs, params=8e9).problems
    assert len(problems) == 1 and "MTC_PREEMPTION_GRACE_S='inf'" in problems[0], problems


def test_demo_does_not_replace_a_backup_folder_it_did_not_make(capsys, tmp_path):
    (tmp_path / "backup").mkdir()
    (tmp_path / "backup" / "mine.txt").write_text("keep me")
    assert main(["demo", "--workdir", str(tmp_path), "--quick"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "already holds backup" in err, err
    assert (tmp_path / "backup" / "mine.txt").read_text() == "keep me"


@pytest.mark.parametrize("argv, usage, meant", [
    (["demo", "--quik"], "usage: mtc demo", "did you mean --quick?"),
    (["size", "--params", "7B", "--hosts", "4", "--jsn"], "usage: mtc size", "did you mean --json?"),
    (["restore-version", "show", "--bakup-root", "/b"], "usage: mtc restore-version", "did you mean --backup-root?"),
])
def test_a_mistyped_option_names_its_command_and_the_option_meant(capsys, argv, usage, meant):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert usage in err and meant in err and "unrecognized arguments" in err and "Traceback" not in err
