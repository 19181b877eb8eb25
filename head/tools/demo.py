"""``mtc demo``: every tier and every recovery, on a local cluster of 2 slices x 2 hosts.

A small model trains on 8 CPU devices (4 per slice, data-parallel over the slices) with a local
checkpoint every ``--period`` steps and a backup every three checkpoints, to a local directory.
While it trains, the demo

1. kills a sidecar in the middle of a save (kill -9 between two blob writes): the save fails,
   the step is not committed, the job restores the previous step from RAM;
2. replaces a host (its ramdisk wiped): the new host pulls its shards from its peer;
3. loses a whole slice: the job goes on on one slice (an elastic restore onto 4 devices), then
   the slice comes back and the job scales up again (the returned hosts pull from their peers);
4. loses every ramdisk: the job restores from the backup.

Each recovery is a new head (a new ``CheckpointManager``) that restores the latest step and
trains on from there. At the end the final parameters are compared, bit for bit, with an
uninterrupted run, a table lists every recovery (the fault, the step restored, the bytes from
each tier, the time to recover) and a timeline picture (PNG) is written.

The sidecars run as real daemon processes (``python -m mtc.sidecar cluster``); the head drives
them through the cluster dispatcher, as a job without Pathways would.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtc.shared.config import ENV_TOKEN

_XLA = "--xla_force_host_platform_device_count=8"
SLICES, HOSTS, DEVICES_PER_HOST = 2, 2, 2
MIN_STEPS = 16
RUN_NAME = "demo"  # the run name of the demo's backups: <workdir>/backup/demo/mtc
_MARK = ".mtc-demo"  # in a work folder the demo made its own (it then replaces what it wrote there)


def _job_token() -> str:
    """The demo job's token: MTC_PEER_TOKEN when set, else one made once for this demo (its
    sidecars and its heads get it in their environment, as pods get the job's Secret)."""
    if not os.environ.get(ENV_TOKEN, "").strip():
        os.environ[ENV_TOKEN] = secrets.token_hex(32)
    return os.environ[ENV_TOKEN]


def _worker_env() -> dict:
    _job_token()
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = (flags + " " + _XLA).strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def fault_schedule(steps: int, period: int) -> dict[int, str]:
    """step -> the fault injected before that step trains (spread over the run, on save steps)."""
    def at(frac: float) -> int:
        s = max(period + 1, int(steps * frac))
        return s - (s % period) if s % period else s

    plan = {at(0.2): "kill_mid_save", at(0.35): "replace_host", at(0.5): "lose_slice", at(0.65): "slice_back",
            at(0.82): "lose_all_ramdisks"}
    if len(plan) != 5 or max(plan) >= steps:
        raise ValueError(f"--steps {steps} with --period {period} leaves no room for the five faults; "
                         f"use --steps >= {MIN_STEPS} and a --period of at most --steps / 8")
    return plan


FAULT_SHORT = {
    "kill_mid_save": "sidecar killed mid-save",
    "replace_host": "host replaced",
    "lose_slice": "slice lost",
    "slice_back": "slice back (scale up)",
    "lose_all_ramdisks": "every ramdisk lost",
}
FAULT_TEXT = {
    "kill_mid_save": "sidecar s0-h1 killed (kill -9) in the middle of a save",
    "replace_host": "host s1-h0 replaced (its ramdisk wiped)",
    "lose_slice": "slice 1 lost (both its hosts killed): go on on slice 0",
    "slice_back": "slice 1 back: scale up to 2 slices",
    "lose_all_ramdisks": "every ramdisk lost (all 4 hosts wiped)",
}


class _Cluster:
    """The local sidecar daemons, driven through ``python -m mtc.sidecar cluster`` (JSON lines)."""

    def __init__(self, root: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mtc.sidecar", "cluster", "--root", str(root), "--slices", str(SLICES),
             "--hosts", str(HOSTS), "--devices-per-host", str(DEVICES_PER_HOST)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_worker_env())
        first = self._read()
        self.spec, self.hosts = Path(first["spec"]), first["hosts"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the local cluster stopped (see its logs under the work directory)")
        doc = json.loads(line)
        if "error" in doc:
            raise RuntimeError(f"local cluster: {doc['error']}")
        return doc

    def do(self, op: str, host: str | None = None, env: dict | None = None) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, "host": host, "env": env}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def slice_hosts(self, s: int) -> list[str]:
        return [h for h in self.hosts if h.startswith(f"s{s}-")]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class Recovery:
    fault: str
    step: int
    bytes_by_tier: dict
    seconds: float


@dataclass
class Timeline:
    t0: float = field(default_factory=time.perf_counter)
    steps: list = field(default_factory=list)  # (t, step, slices)
    saves: list = field(default_factory=list)  # (t, step)
    backups: list = field(default_factory=list)  # (t, step)
    faults: list = field(default_factory=list)  # (t, text)
    recoveries: list = field(default_factory=list)  # (t start, t end, step, tiers it read from)

    def now(self) -> float:
        return time.perf_counter() - self.t0


def _run(workdir: Path, steps: int, period: int, timeline_png: Path, metrics_port: int = 0) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from mtc.head import CheckpointManager, MTCConfig
    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher

    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough that the table keeps one row a line,
        console = Console(width=120, soft_wrap=True)  # and a sentence stays on its line
    # The demo reports what its faults do; mtc's own log (errors included: they are the faults)
    # goes to a file in the work directory.
    import logging

    handler = logging.FileHandler(workdir / "head.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    mtc_log = logging.getLogger("mtc")
    mtc_log.addHandler(handler)
    mtc_log.setLevel(logging.INFO)
    mtc_log.propagate = False
    faults = fault_schedule(steps, period)
    backup_every = 3 * period
    devices = sorted(jax.devices(), key=lambda d: d.id)
    slice_devices = {s: devices[s * 4:(s + 1) * 4] for s in range(SLICES)}

    def mesh_of(slices: list[int]) -> Mesh:
        return Mesh(np.array([d for s in slices for d in slice_devices[s]]).reshape(len(slices), 4), ("data", "model"))

    def shardings(mesh: Mesh) -> dict:
        # Sharded over "model" (inside a slice), replicated over "data" (the slices): each
        # slice holds the whole state, so one slice's loss loses nothing.
        p = {"w": NamedSharding(mesh, P(None, "model")), "b": NamedSharding(mesh, P("model"))}
        return {"params": p, "momentum": p, "step": NamedSharding(mesh, P())}

    def init(mesh: Mesh) -> dict:
        sh = shardings(mesh)
        w = (np.arange(64 * 32, dtype=np.float32).reshape(64, 32) % 7) / 7
        state = {"params": {"w": w, "b": np.zeros(32, np.float32)},
                 "momentum": {"w": np.zeros((64, 32), np.float32), "b": np.zeros(32, np.float32)},
                 "step": np.int32(0)}
        return jax.tree.map(lambda x, s: jax.device_put(x, s), state, sh)

    @jax.jit
    def train_step(state):
        # Elementwise only: every device runs the same program on its shard whatever the mesh,
        # so a run that moved between meshes is bit-identical to one that did not.
        step = state["step"] + 1
        t = jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) * 0.01
                                           + step.astype(jnp.float32) * 0.1), state["params"])
        grads = jax.tree.map(lambda p, x: p - x, state["params"], t)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
        params = jax.tree.map(lambda p, m: p - 0.05 * m, state["params"], momentum)
        loss = sum(jnp.mean((p - x) ** 2) for p, x in zip(jax.tree.leaves(params), jax.tree.leaves(t)))
        return {"params": params, "momentum": momentum, "step": step}, loss

    # The uninterrupted run, for the comparison at the end.
    ref = init(mesh_of([0, 1]))
    for _ in range(steps):
        ref, _ = train_step(ref)
    reference = {k: np.asarray(v) for k, v in ref["params"].items()}

    root, backups = workdir / "cluster", workdir / "backup"
    for d in (root, backups):
        shutil.rmtree(d, ignore_errors=True)
    console.print(f"[bold]mtc demo[/bold]: {steps} steps on {SLICES} slices x {HOSTS} hosts x {DEVICES_PER_HOST} "
                  f"devices; a local checkpoint every {period} steps, a backup every {backup_every} steps")
    console.print(f"  ramdisks under {root}, backups in {backups}")
    if metrics_port:
        console.print(f"  the head's metrics while it runs: curl -s localhost:{metrics_port}/metrics | grep ^mtc_")
    cluster = _Cluster(root)
    tl = Timeline()
    recoveries: list[Recovery] = []
    managers: list = []

    def manager(slices: list[int]):
        sub = workdir / f"spec-{len(managers)}.json"
        spec = json.loads(cluster.spec.read_text())
        sub.write_text(json.dumps({**spec, "hosts": [h for h in spec["hosts"] if h["slice"] in slices]}))
        cfg = MTCConfig(local_checkpoint_directory=str(root), cluster_spec=str(sub), local_checkpoint_period=period,
                        base_output_directory=str(backups), run_name=RUN_NAME,
                        multi_tier_checkpointing_backup_interval_steps=backup_every, metrics_port=metrics_port)
        live = [d for s in slices for d in slice_devices[s]]
        m = CheckpointManager(cfg, dispatcher=ClusterDispatcher(cfg, devices=live))
        managers.append(m)
        return m

    def recover(fault: str, slices: list[int], t_fault: float):
        m = manager(slices)
        mesh = mesh_of(slices)
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              init(mesh), shardings(mesh))
        latest = m.latest_step()
        state = m.restore(latest, target=target)
        r = m.last_restore_report
        t_end = tl.now()
        recoveries.append(Recovery(FAULT_SHORT[fault], latest, dict(r.bytes_by_tier), t_end - t_fault))
        by_tier = dict(r.bytes_by_tier)
        tl.recoveries.append((t_fault, t_end, latest, [k for k in ("ram", "peer", "backup") if by_tier.get(k)]))
        served = ", ".join(f"{n} B from {tier}" for tier, n in r.bytes_by_tier.items() if n) or "nothing to move"
        console.print(f"  [green]recovered[/green]: step {latest} restored on {len(slices)} slice(s) ({served}) "
                      f"in {t_end - t_fault:.2f} s; training goes on from step {latest + 1}")
        return m, state

    seen_backups: set = set()

    def note_backups() -> None:
        for m in managers:
            rep = m.last_backup_report
            if rep is not None and rep.name and id(rep) not in seen_backups:
                seen_backups.add(id(rep))
                tl.backups.append((tl.now(), rep.step))

    def abandon(m) -> None:
        try:
            m.close()  # waits for its background save and backup
        except Exception:  # its failed save was the fault; a new head takes over
            pass
        note_backups()

    ok = False
    try:
        slices = [0, 1]
        mgr = manager(slices)
        state = init(mesh_of(slices))
        done = set()
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            task = progress.add_task("training", total=steps)
            step = 1
            while step <= steps:
                fault = faults.get(step)
                if fault and fault not in done:
                    done.add(fault)
                    t_fault = tl.now()
                    tl.faults.append((t_fault, fault))
                    console.print(f"step {step}: [red]fault[/red]: {FAULT_TEXT[fault]}")
                    if fault == "kill_mid_save":
                        mgr.wait_until_finished()  # the saves before it are committed
                        cluster.do("restart", "s0-h1", env={"MTC_CRASH_AT": "between_blobs"})
                        state, _ = train_step(state)
                        mgr.save(step, state, force=True)
                        failed = None
                        try:
                            mgr.wait_until_finished()
                        except Exception as e:  # the save of this step failed: nothing committed
                            failed = e
                        if failed is None:
                            raise RuntimeError("the save should have failed: its sidecar was killed mid-save")
                        console.print(f"  the save of step {step} failed ({type(failed).__name__}); "
                                      "nothing of it is visible")
                        abandon(mgr)
                        cluster.do("restart", "s0-h1")
                    elif fault == "replace_host":
                        mgr.wait_until_finished()
                        abandon(mgr)
                        cluster.do("wipe", "s1-h0")
                        cluster.do("restart", "s1-h0")
                    elif fault == "lose_slice":
                        mgr.wait_until_finished()
                        abandon(mgr)
                        for h in cluster.slice_hosts(1):
                            cluster.do("kill", h)
                        slices = [0]
                    elif fault == "slice_back":
                        mgr.wait_until_finished()
                        abandon(mgr)
                        for h in cluster.slice_hosts(1):
                            cluster.do("restart", h)
                        slices = [0, 1]
                    elif fault == "lose_all_ramdisks":
                        mgr.wait_until_finished()
                        mgr.wait_for_backup()
                        abandon(mgr)
                        for h in cluster.hosts:
                            cluster.do("wipe", h)
                            cluster.do("restart", h)
                    mgr, state = recover(fault, slices, t_fault)
                    step = int(state["step"]) + 1
                    progress.update(task, completed=step - 1)
                    continue
                state, loss = train_step(state)
                tl.steps.append((tl.now(), step, len(slices)))
                if mgr.save(step, state):
                    tl.saves.append((tl.now(), step))
                note_backups()
                progress.update(task, completed=step, description=f"training (loss {float(loss):.4f}, "
                                f"{len(slices)} slice{'s' if len(slices) > 1 else ''})")
                step += 1
            mgr.wait_until_finished()
            mgr.wait_for_backup()
            note_backups()
        final = {k: np.asarray(v) for k, v in state["params"].items()}
        ok = sorted(final) == sorted(reference) and all(
            final[k].dtype == reference[k].dtype and final[k].tobytes() == reference[k].tobytes() for k in final)
        table = Table(title="recoveries")
        for col in ("fault", "step restored", "from ram", "from peer", "from backup", "time to recover"):
            table.add_column(col, justify="left" if col == "fault" else "right")
        for r in recoveries:
            table.add_row(r.fault, str(r.step), *(f"{r.bytes_by_tier.get(t, 0):,} B" for t in ("ram", "peer", "backup")),
                          f"{r.seconds:.2f} s")
        console.print(table)
        from mtc.head.tools.demo_plot import plot

        plot(tl, timeline_png, steps, FAULT_SHORT, backup_every=backup_every)
        console.print(f"timeline: {timeline_png}")
        print(json.dumps({"bitwise_equal": ok, "recoveries": len(recoveries),
                          "tiers": sorted({t for r in recoveries for t, n in r.bytes_by_tier.items() if n}),
                          "timeline": str(timeline_png)}), flush=True)
        console.print("final parameters equal the uninterrupted run bit for bit" if ok
                      else "[red]MISMATCH: the final parameters differ from the uninterrupted run[/red]")
    finally:
        for m in managers:
            abandon(m)
        cluster.close()
    return 0 if ok else 1


def _tool(name: str) -> str | None:
    """How to run this environment's ``name`` (``mtc``, ``pip``) from here: the bare name when PATH finds this
    one, else its path (relative under the current folder, e.g. ``.venv/bin/mtc``); None when it has none."""
    path = Path(sys.executable).parent / name
    if not path.is_file():
        return None
    found = shutil.which(name)
    if found and Path(found).resolve() == path.resolve():
        return name
    try:
        rel = path.relative_to(Path.cwd())
    except ValueError:
        return str(path)
    return str(rel) if "/" in str(rel) else f"./{rel}"


TOKEN_FILE = "job-token"  # in a kept work folder: the demo job's token (its backups are sealed with its key)


def _keep_token(work: Path) -> None:
    """Leave the demo job's token beside its kept folders (mode 0600): the tools read its sealed backups
    only with the job's key."""
    path = work / TOKEN_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_job_token() + "\n")


def kept_message(work: Path) -> str:
    """Where --keep left the job's folders, and the commands to look at them (runnable as written: with this
    environment's ``mtc``)."""
    mtc = _tool("mtc") or f"{sys.executable} -m mtc.head.tools.cli"
    if (work / TOKEN_FILE).is_file():  # the job's token: its key seals the backups the tools read
        mtc = f"MTC_PEER_TOKEN=$(cat {work / TOKEN_FILE}) {mtc}"
    pip = _tool("pip") or f"{sys.executable} -m pip"
    hosts = " ".join(str(p) for p in sorted((work / "cluster").glob("s*-h*")) if p.is_dir())
    backup = f"--base-output-directory {work / 'backup'} --run-name {RUN_NAME}"
    return (f"kept: the hosts' ramdisk folders in {work / 'cluster'}, the backups in {work / 'backup'} "
            f"(run name {RUN_NAME}), the head's log {work / 'head.log'}"
            + (f", the job's token {work / TOKEN_FILE}" if (work / TOKEN_FILE).is_file() else "")
            + ". Look at them with:\n"
            f"  {mtc} status --local-checkpoint-directory {hosts} {backup}\n"
            f"  {mtc} restore-version show {backup}\n"
            f"  {mtc} verify --backup --local-checkpoint-directory {hosts} {backup}\n"
            f"  {mtc} export --to {work / 'export'} --local-checkpoint-directory {hosts} --verify\n"
            f"    (export needs the export extra: {pip} install 'mtc[export]', or {pip} install -e '.[export]' in a "
            "checkout)")


def metrics_port_of(given: int | None, environ=None) -> tuple[int, str | None]:
    """The demo's metrics port (``--metrics-port``, else ``MTC_METRICS_PORT``, else 0: none) and what is wrong
    with it (one line), checked before anything runs: in range, and free on this machine."""
    import socket

    env = os.environ if environ is None else environ
    what = "--metrics-port" if given is not None else "MTC_METRICS_PORT"
    text = str(given) if given is not None else env.get("MTC_METRICS_PORT", "").strip()
    if not text:
        return 0, None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        return 0, f"mtc demo: {what}={text} is not a port; give one in 1..65535 (e.g. 9431), or 0 for no metrics"
    if port:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError as e:
                return 0, f"mtc demo: {what}={port}: the port is taken here ({e.strerror or e}); pick another"
    return port, None


def _check_args(steps: int, period: int, timeline: Path) -> str | None:
    """What is wrong with the demo's arguments (one line), before anything runs; None when nothing."""
    if period < 1:
        return f"mtc demo: --period {period}: the local checkpoint period is a number of steps, at least 1"
    if steps < MIN_STEPS:
        return f"mtc demo: --steps {steps}: the demo needs --steps >= {MIN_STEPS} for its five faults"
    try:
        fault_schedule(steps, period)
    except ValueError as e:
        return f"mtc demo: {e}"
    if timeline.suffix.lower() != ".png":
        return f"mtc demo: --timeline {timeline}: the timeline is a PNG picture; give a path ending in .png"
    parent = timeline.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".mtc-demo-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"mtc demo: --timeline {timeline}: cannot write in {parent} ({e.strerror or e}); give another path"
    return None


def main(args: argparse.Namespace) -> int:
    """Run the demo (in a process with 8 CPU devices); 0 when the result equals the uninterrupted run."""
    problem = None
    try:
        import matplotlib  # noqa: F401
        import rich  # noqa: F401
    except ImportError as e:
        problem = f"mtc demo needs {e.name}: pip install 'mtc[demo]' (or pip install -e '.[demo]' in a checkout)"
    steps = args.steps if args.steps is not None else (20 if args.quick else 40)
    problem = problem or _check_args(steps, args.period, Path(args.timeline or "demo-out/timeline.png"))
    metrics_port, bad_port = metrics_port_of(getattr(args, "metrics_port", None))
    problem = problem or bad_port
    work = Path(args.workdir)
    if problem:
        print(problem, file=sys.stderr)
        if getattr(args, "created_workdir", False):
            shutil.rmtree(work, ignore_errors=True)  # nothing ran: leave nothing behind
        return 2
    theirs = [n for n in ("cluster", "backup", "head.log") if (work / n).exists()]
    if theirs and not (work / _MARK).exists():  # the demo replaces these: only its own
        print(f"mtc demo: --workdir {work} already holds {', '.join(theirs)}, which the demo did not make and would "
              "replace; give a new or empty folder", file=sys.stderr)
        return 2
    try:
        work.mkdir(parents=True, exist_ok=True)
        (work / _MARK).write_text("a work folder of mtc demo: it replaces cluster/, backup/ and head.log here\n")
    except OSError as e:
        print(f"mtc demo: --workdir {work} is not a writable directory ({e.strerror or e}); pass another one",
              file=sys.stderr)
        return 2
    timeline = Path(args.timeline if args.timeline is not None else
                    Path("demo-out") / ("timeline-quick.png" if args.quick else "timeline.png")).resolve()
    cmd = [sys.executable, "-m", "mtc.head.tools.demo", "run", "--workdir", str(work), "--steps", str(steps),
           "--period", str(args.period), "--timeline", str(timeline), "--metrics-port", str(metrics_port)]
    try:
        rc = subprocess.run(cmd, env=_worker_env()).returncode
        if args.keep:
            _keep_token(work)
            print(kept_message(work))
        return rc
    finally:
        if not args.keep:
            for name in ("cluster", "backup"):
                shutil.rmtree(work / name, ignore_errors=True)
            (work / "head.log").unlink(missing_ok=True)
            for p in work.glob("spec-*.json"):
                p.unlink()
            (work / _MARK).unlink(missing_ok=True)
            if getattr(args, "created_workdir", False):
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        p = argparse.ArgumentParser(prog="mtc.head.tools.demo run")
        p.add_argument("--workdir", type=Path, required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--period", type=int, required=True)
        p.add_argument("--timeline", type=Path, required=True)
        p.add_argument("--metrics-port", type=int, default=0)
        a = p.parse_args(sys.argv[2:])
        sys.exit(_run(a.workdir, a.steps, a.period, a.timeline, a.metrics_port))
    print("usage: mtc demo [--quick] [--steps N] [--period N] [--workdir DIR] [--keep] [--timeline PNG] "
          "[--metrics-port PORT]",
          file=sys.stderr)
    sys.exit(2)
