"""Goodput under failures: real MaxText on mtc against MaxText's standard Orbax checkpointing.

    python bench/bench_goodput.py [--mtbf 90] [--seed 1] [--steps 200] [--restart-delay 5]
        [--contenders mtc,orbax,orbax-supervised] [--defer-failures]
        [--faults kill_head,kill_sidecar,host_replaced,slice_lost,preempt,head_pod_lost[,slice_lost_elastic]]
        [--model default|small] [--json FILE] [--timeline goodput.png]

Every contender trains the same model on the same data (a Grain parquet file this benchmark
writes, every row different, so a data iterator that started over changes every later loss)
for ``--steps`` steps, under the same seeded failure schedule (gaps drawn exponentially with mean
``--mtbf`` seconds of wall time, a class drawn for each). A failure strikes at its drawn time
whatever the job is doing: during a recovery it kills that recovery, and the next one starts
from the tiers again (``--defer-failures``: as before, a failure waits until the training process
has trained ``--fault-min-steps`` steps since it started or since its last elastic retry; the
table's title says which). A failure that ends the head pod is followed, ``--restart-delay`` seconds
later, by a new pod as Kubernetes starts one: a new process, with a fresh home and working
directory, so only what a pod keeps survives (the ramdisks the failure spared, the bucket). A
supervised contender's pod runs ``python -m mtc.head.supervisor`` around the training process:
a failure of the training process alone is the supervisor's to handle in the pod (its warm
standby takes over), with no restart delay.

Contenders (the default: the first three):

- ``mtc``: ``python3 -m mtc.head.maxtext`` (through ``bench/goodput_probe.py``) under its supervisor
  and standby, in cluster mode, 2 slices x 2 hosts of real sidecar daemons (one device each), with
  the local period that ``mtc plan`` recommends for this state and MTBF, backups every
  ``--backup-steps``. Its costs are ``mtc plan --measure``'s, but for the save's cost to training:
  measured in this job, as Orbax's is (a short run saving every step). Here the four sidecars'
  writes, replication and uploads share the training's two cores, so a save costs the steps far
  more than the few milliseconds it blocks (``--mtc-cost blocked`` plans with those alone, right on
  a host whose background work has cores of its own);
- ``orbax``: MaxText's own standard checkpointing (async Orbax, to a local directory standing for
  the bucket) at the period Young/Daly gives for its own save cost, measured the same way, as
  users run it today: a failed training process restarts its pod;
- ``orbax-supervised``: ``orbax`` under the same supervisor (a standby that imported JAX and
  MaxText): what the supervisor gives without mtc's tiers;
- ``mtc-pod-restart``: ``mtc`` without its supervisor (a failed training process restarts its pod);
  ``orbax-cached``: ``orbax`` with MaxText's ``jax_cache_dir`` in the bucket, where a new pod finds
  it (what a user who knows the compilation cache would pick); ``orbax-every-step``,
  ``mtc-backup-only`` (mtc's local period as long as the backup's): what a user might pick instead.

Fault classes and what each contender gets (a failure that ends the training process ends its
pod where the contender is not supervised):

- ``kill_head``: kill -9 of the training process;
- ``head_pod_lost``: kill -9 of the head pod's every process (the supervisor, the training process
  and its standby): a new pod, cold, after the restart delay;
- ``kill_sidecar``: kill -9 of one sidecar daemon, restarted after the delay (the training goes
  on); Orbax has no sidecar: nothing happens to it;
- ``host_replaced``: a host dies, the training process with it, and comes back empty after the
  delay; for Orbax the training process is killed (its checkpoints are in the bucket). Nothing
  trains before the host is back (on Pathways a new process waits for the slice's devices): a
  supervised pod's supervisor is stopped (SIGSTOP) until then, for every contender alike;
- ``slice_lost``: every host of one slice dies, the training process with them, and they come
  back empty after the delay; otherwise as ``host_replaced``;
- ``preempt``: SIGTERM to the pod, with a grace period (``MTC_PREEMPTION_GRACE_S``): mtc saves the
  step reached and exits (the supervisor ends with it); MaxText's standard path has no handler on
  this machine (its preemption check needs JAX's distributed service): the signal ends it as a kill
  would; a new pod after the delay;
- ``slice_lost_elastic`` (not in the default list): every sidecar of one slice is killed -9 and
  its ramdisk wiped while the training process STAYS. With it in ``--faults`` the mtc contenders
  run in MaxText's elastic mode (``elastic_enabled=True``, ``enable_single_controller=True``),
  with ``bench/pathways_cpu.py``'s CPU stand-ins for what Pathways provides (its backend check,
  the devices' slice map, the slices' health check: see its docstring; MaxText's files are not
  changed). mtc's next save raises the lost hosts' ``HostLostError`` (DATA_LOSS); MaxText's
  elastic retry catches it, waits for every slice, runs MaxText's ``initialize`` and train loop
  again in the same interpreter (no new process, no imports) and restores through mtc (the lost
  slice's shards from the peer replicas on the other slice, or the backup). The slice comes back
  empty ``--restart-delay`` seconds after the loss, but not before the error reached the retry (on
  Pathways the slice's devices fail the next step; here only mtc's next save sees it). Every
  other class keeps its meaning (a head-restarting ``slice_lost`` restarts the elastic-mode
  process as before; a sidecar killed raises an elastic retry too, accounted as ``kill_sidecar
  (elastic)``). For Orbax it is ``slice_lost``.

What it prints: per contender the effective training time ratio (the uninterrupted run's time
for the steps trained, over the wall time), the steps recomputed, seconds lost per failure, and
every recovery split into stages: restart (a new pod: the restart delay and the interpreter's
start; in the pod: the supervisor's detection and the standby's promotion), imports, JAX and MaxText
initialisation, setup until the restore, the restore (with mtc's own report: inventory, pull,
load, bytes by tier), compilation, and the first step after it. A recovery that the next failure
cut ("(cut)", ``cut`` in the JSON) ends at that failure: the stage under way then gets the rest.
``kind`` says how it recovered: "in-pod" (the supervisor's restart), "restart" (a new pod) or
"elastic". A recovery in the same process
(``kind`` "elastic" in the JSON) has instead of the first two: detection (the failure until the
error reaches pathwaysutils' retry) and the wait for the slices (until the retry starts the next
attempt); then MaxText's ``initialize`` again, setup, restore, compilation, first step. The stages
not in a recovery's kind are None ("-" in the table); the others add up to the recovery, failure
to first step after it (or to the failure that cut it). Steps recomputed are counted per attempt of the train function. Every contender's final state
(a SHA-256 of every leaf) and every step's logged metrics are compared with the uninterrupted
run's: a mismatch fails the run (exit 1). (MaxText writes a step's metrics when the next step
ends, so a step restored from, whose process was killed before that, has no line: only such a
step may lack one.) ``mtc plan``'s model, given the costs measured here,
predicts each contender's goodput beside the measured one. ``--json`` writes the same figures,
``--timeline`` a picture of every contender's run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "maxtext"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import env as mx_env  # noqa: E402
import pathways_cpu  # noqa: E402

PROBE = REPO / "bench" / "goodput_probe.py"
CONTENDERS = ("mtc", "orbax", "orbax-supervised", "mtc-pod-restart", "orbax-cached", "orbax-every-step",
              "mtc-backup-only")
DEFAULT_CONTENDERS = ("mtc", "orbax", "orbax-supervised")
SUPERVISED = ("mtc", "orbax-supervised", "mtc-backup-only")  # run under mtc's supervisor (a warm standby)
ELASTIC = "slice_lost_elastic"  # in --faults: the mtc contenders run in MaxText's elastic mode
POD_LOST = "head_pod_lost"
DEFAULT_FAULTS = ("kill_head", "kill_sidecar", "host_replaced", "slice_lost", "preempt", POD_LOST)
# What a supervised standby imports while it waits: what the contender's training program imports.
ORBAX_WARM = ("jax", "numpy", "maxtext.trainers.pre_train.train")
FAULTS = (*DEFAULT_FAULTS, ELASTIC)
SLICES, HOSTS = 2, 2
METRICS = ("learning/loss", "learning/grad_norm", "learning/param_norm")

MODELS = {
    # ~25 M parameters, ~300 MB of train state with Adam: a step of about 0.3-1 s on 2 cores.
    "default": dict(emb=256, layers=2, mlp=1024, heads=4, head_dim=64, seq=64, rows=40000),
    # The smallest that still reads real data: for the test of the accounting.
    "small": dict(emb=32, layers=2, mlp=64, heads=2, head_dim=16, seq=32, rows=4000),
}

MAKE_DATA = """
import random, sys
import pyarrow as pa, pyarrow.parquet as pq
random.seed(int(sys.argv[2]))
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega river stone cloud green quick brown fox jumps over lazy dog").split()
rows = [" ".join(random.choice(words) for _ in range(random.randint(10, 60))) + f" row {i}" for i in range(int(sys.argv[3]))]
pq.write_table(pa.table({"text": rows}), sys.argv[1])
"""


# --- the schedule ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Failure:
    at_s: float  # wall time since the contender started
    cls: str
    pick: int  # which host / slice (a seeded draw, the same for every contender)


def schedule(seed: int, mtbf_s: float, faults: list[str], horizon_s: float) -> list[Failure]:
    r = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += r.expovariate(1.0 / mtbf_s)
        if t > horizon_s:
            return out
        out.append(Failure(round(t, 2), r.choice(faults), r.randrange(1 << 16)))


# --- one contender's processes -----------------------------------------------------------------

@dataclasses.dataclass
class Contender:
    name: str
    kind: str  # "mtc" or "orbax"
    period: int  # steps between checkpoints (mtc: local; orbax: its only tier)
    backup_steps: int = 0  # mtc only
    why: str = ""
    supervised: bool = False  # the pod runs mtc's supervisor around the training process


@dataclasses.dataclass
class Pod:
    """One start of the head pod: its process (the training process, or the supervisor around it)."""

    index: int
    spawned: float
    dir: Path
    proc: subprocess.Popen
    ended: float | None = None
    rc: int | None = None
    restart_at: float | None = None  # set by a failure that ended it: when the next pod starts
    preempted: float | None = None  # SIGTERM sent then; SIGKILL after the grace
    suspended: bool = False  # its supervisor is stopped until lost hosts are back (see Runner.strike)


@dataclasses.dataclass
class Strike:
    """A failure as it struck: what it ended (a training process, the pod, or nothing)."""

    t: float
    failure: Failure
    ended: str | None = None  # "process", "pod", or None (the job went on, or it found nothing to end)
    pid: int | None = None
    pod: int | None = None


@dataclasses.dataclass
class Segment:
    """One training process: when it started, its marks, how it ended."""

    index: int
    spawned: float
    marks: list = dataclasses.field(default_factory=list)
    ended: float | None = None
    rc: int | None = None
    failure: Failure | None = None  # the failure that ended it (or hit during it)
    failed_at: float | None = None
    log: str = ""
    hits: list = dataclasses.field(default_factory=list)  # (Failure, time) the process went on through
    pod: int = 0
    nth: int = 0  # its place among its pod's training processes
    pid: int | None = None

    def first(self, name: str) -> float | None:
        return next((m["t"] for m in self.marks if m["mark"] == name), None)

    def first_after(self, name: str, t: float) -> float | None:
        return next((m["t"] for m in self.marks if m["mark"] == name and m["t"] > t), None)

    def retries(self) -> list[dict]:
        """The errors MaxText's elastic retry retried in this process (its ``elastic_event`` marks)."""
        return [m for m in self.marks if m["mark"] == "elastic_event" and m.get("slice_down")]

    def attempt_starts(self) -> list[float]:
        """When each attempt after the first began: the retry's slices ready after each retried error."""
        out = []
        for e in self.retries():
            t = self.first_after("slices_ready", e["t"])
            if t is not None:
                out.append(t)
        return out

    def steps(self) -> list[tuple[int, float]]:
        return [(m["step"], m["t"]) for m in self.marks if m["mark"] == "step"]


def processes(pods: list[Pod], strikes: list[Strike]) -> list[Segment]:
    """The training processes of a contender's pods, in order, from their marks (each carries its pid):
    a pod's first process started with the pod, a later one (a supervisor's restart) at its ``start``
    mark; one ends when the next starts or its pod ends."""
    out: list[Segment] = []
    for pod in pods:
        marks = _read_marks(pod.dir / "marks.jsonl")
        pids: list[int] = []
        for m in marks:
            if m.get("pid") not in pids:
                pids.append(m.get("pid"))
        segs = []
        for j, pid in enumerate(pids):
            mine = [m for m in marks if m.get("pid") == pid]
            start = next((m["t"] for m in mine if m["mark"] == "start"), mine[0]["t"])
            # The pod's own start, unless a failure ended a process of this pod before this one started.
            ended_before = any(k.pod == pod.index and k.ended == "process" and pod.spawned <= k.t <= start
                               for k in strikes)
            spawned = pod.spawned if j == 0 and not ended_before else start
            segs.append(Segment(len(out) + len(segs), spawned, mine, log=str(pod.dir / "log.txt"), pod=pod.index,
                                nth=j, pid=pid))
        for a, b in zip(segs, segs[1:]):
            a.ended = max([m["t"] for m in a.marks] + [a.spawned])
            a.ended = min(b.spawned, next((k.t for k in strikes if k.pid == a.pid and k.ended), a.ended))
        if segs:
            segs[-1].ended, segs[-1].rc = pod.ended, pod.rc
        for seg in segs:
            end = seg.ended if seg.ended is not None else math.inf
            for k in strikes:
                if not seg.spawned <= k.t <= end:
                    continue
                if k.ended and (k.pid == seg.pid or (k.ended == "pod" and k.pod == pod.index)):
                    seg.failure, seg.failed_at = k.failure, k.t
                elif not k.ended and k.pod == pod.index:
                    seg.hits.append((k.failure, k.t))
        out += segs
    return out


def _read_marks(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by kill -9
            pass
    return out


class Cluster:
    """The mtc contender's sidecar daemons: ``python -m mtc.sidecar cluster``, driven over stdin."""

    def __init__(self, py: str, root: Path, env: dict):
        self.proc = subprocess.Popen([py, "-m", "mtc.sidecar", "cluster", "--root", str(root), "--slices",
                                      str(SLICES), "--hosts", str(HOSTS), "--devices-per-host", "1"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        first = json.loads(self.proc.stdout.readline() or "{}")
        if "spec" not in first:
            raise SystemExit("the local sidecar cluster did not start")
        self.spec, self.hosts = first["spec"], first["hosts"]

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"cluster {cmd}: {answer['error']}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Runner:
    def __init__(self, args, py: str, maxtext_dir: Path, data: Path, work: Path, model: dict):
        self.a, self.py, self.maxtext_dir, self.data, self.work, self.model = args, py, maxtext_dir, data, work, model

    def flags(self, out: Path, metrics_file: Path, extra: list[str]) -> list[str]:
        m = self.model
        return [str(self.maxtext_dir / "configs" / "base.yml"), "run_name=r", f"base_output_directory={out}",
                "model_name=default", f"base_emb_dim={m['emb']}", f"base_num_decoder_layers={m['layers']}",
                f"base_mlp_dim={m['mlp']}", f"base_num_query_heads={m['heads']}", f"base_num_kv_heads={m['heads']}",
                f"head_dim={m['head_dim']}", f"max_target_length={m['seq']}", "per_device_batch_size=1",
                f"steps={self.a.steps}", f"learning_rate_schedule_steps={self.a.steps}", "dataset_type=grain",
                "grain_file_type=parquet", f"grain_train_files={self.data}", "grain_worker_count=0",
                f"tokenizer_path={self.maxtext_dir / 'assets' / 'tokenizers' / 'tokenizer.default'}",
                "tokenizer_type=sentencepiece", "eval_interval=-1", "hardware=cpu", f"metrics_file={metrics_file}",
                "skip_jax_distributed_system=True", *extra]

    def env(self, home: Path, marks: Path, extra: dict | None = None) -> dict:
        e = {k: v for k, v in os.environ.items() if not k.startswith(("MTC_", "XLA_", "JAX_"))
             or k == "MTC_CHECKOUT"}  # which checkout's mtc the MaxText environment imports (tests/maxtext/env.py)
        e.update(HOME=str(home), XLA_FLAGS=f"--xla_force_host_platform_device_count={SLICES * HOSTS}",
                 JAX_PLATFORMS="cpu", GOODPUT_MARKS=str(marks), PYTHONUNBUFFERED="1", TMPDIR=str(home))
        e.update(extra or {})
        return e

    def spawn(self, c: Contender, seg_dir: Path, flags: list[str], env_extra: dict) -> subprocess.Popen:
        """A new pod: fresh home and working directory, nothing kept but what the flags point at. A
        supervised contender's pod runs mtc's supervisor, which runs the training process and its standby."""
        if seg_dir.exists():
            shutil.rmtree(seg_dir)
        (seg_dir / "home").mkdir(parents=True)
        env = self.env(seg_dir / "home", seg_dir / "marks.jsonl", env_extra)
        log = (seg_dir / "log.txt").open("wb")
        cmd = [self.py, str(PROBE), c.kind, *flags]
        if c.supervised:
            from mtc.head.maxtext import WARM

            warm = WARM if c.kind == "mtc" else ORBAX_WARM
            # The schedule's failures come far more often than a job's: the crash-loop bound is not what is measured.
            env["MTC_RESTARTS"] = "100000"
            cmd = [self.py, "-m", "mtc.head.supervisor", "--warm", ",".join(warm), "--", *cmd[1:]]
        return subprocess.Popen(cmd, cwd=seg_dir / "home", env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    # -- the uninterrupted run -----------------------------------------------------------------

    def reference(self) -> dict:
        d = self.work / "reference"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        c = Contender("reference", "orbax", 0)
        t0 = time.time()
        proc = self.spawn(c, d / "pod", self.flags(d / "bucket", d / "metrics.txt", ["enable_checkpointing=False"]), {})
        rc = proc.wait()
        marks = _read_marks(d / "pod" / "marks.jsonl")
        if rc != 0:
            raise SystemExit(f"the uninterrupted run failed ({rc}):\n{(d / 'pod' / 'log.txt').read_text()[-3000:]}")
        steps = [(m["step"], m["t"]) for m in marks if m["mark"] == "step"]
        times = [b - a for (_, a), (_, b) in zip(steps, steps[1:])]
        final = next(m for m in marks if m["mark"] == "final")
        # A step's mean time (some steps are slower than others: the mean is what a run of them takes).
        return {"spawned": t0, "marks": marks, "wall_s": final["t"] - t0, "step_s": statistics.mean(times[1:]),
                "step_times": times, "step_at": {s: t - t0 for s, t in steps},
                "first_step_s": steps[0][1] - t0, "digest": final["digest"], "metrics": metrics(d / "metrics.txt"),
                "stages": stages_of(Segment(0, t0, marks), None)}

    # -- a contender under the schedule --------------------------------------------------------

    def run(self, c: Contender, failures: list[Failure], delay: float) -> dict:
        """Train ``c`` under the schedule: each failure strikes at its drawn wall time, whatever the job
        is doing (``--defer-failures``: only once the training process has trained ``--fault-min-steps``
        steps since it started or since its last elastic retry). A pod that a failure ended starts again
        ``delay`` seconds later; hosts that a failure took come back, empty, ``delay`` seconds later."""
        d = self.work / c.name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        token = secrets.token_hex(16)
        cluster = None
        env_extra: dict = {}
        elastic = c.kind == "mtc" and ELASTIC in self.a.faults.split(",")
        if c.kind == "mtc":
            cluster = Cluster(self.py, d / "hosts", dict(self.env(d, d / "cluster-marks"), MTC_PEER_TOKEN=token))
            env_extra = {"MTC_CLUSTER_SPEC": cluster.spec, "MTC_PEER_TOKEN": token,
                         "MTC_PREEMPTION_GRACE_S": str(self.a.grace)}
            (d / "head-ramdisk").mkdir()  # the head pod's own ramdisk mount (kept across its restarts)
            extra = ["enable_checkpointing=True", "enable_multi_tier_checkpointing=True",
                     f"local_checkpoint_directory={d / 'head-ramdisk'}", f"local_checkpoint_period={c.period}",
                     f"multi_tier_checkpointing_backup_interval_steps={c.backup_steps}", "checkpoint_period=1000000"]
            if elastic:  # MaxText's elastic mode, Pathways stood in for on CPU (bench/pathways_cpu.py)
                extra += pathways_cpu.FLAGS
                env_extra["GOODPUT_ELASTIC"] = "1"
        else:
            extra = ["enable_checkpointing=True", "async_checkpointing=True", f"checkpoint_period={c.period}"]
            if c.name == "orbax-cached":  # JAX's compilation cache where a new pod finds it: the bucket
                extra.append(f"jax_cache_dir={d / 'bucket' / 'jax-cache'}")
        flags = self.flags(d / "bucket", d / "metrics.txt", extra)
        pods: list[Pod] = []
        strikes: list[Strike] = []
        pending = list(failures)
        events: list[dict] = []  # what the harness did, with its time
        back: list[dict] = []  # hosts to bring back: {"at", "hosts", "seen_after" (an elastic error first)}
        t_start = time.time()
        pod: Pod | None = None
        restart_at: float | None = t_start
        last_progress = t_start
        try:
            while True:
                now = time.time()
                if now - t_start > self.a.budget:
                    raise SystemExit(f"{c.name}: over the wall-clock budget ({self.a.budget:.0f} s); "
                                     f"see {d}/pod*/log.txt")
                for entry in list(back):  # replaced hosts come back, empty
                    if now >= entry["at"] and (entry["seen_after"] is None or pod is None or any(
                            m["mark"] == "elastic_event" and m["t"] >= entry["seen_after"]
                            for m in _read_marks(pod.dir / "marks.jsonl"))):
                        back.remove(entry)
                        for host in entry["hosts"]:
                            if cluster is not None and not cluster.call(op="alive")["alive"].get(host, True):
                                cluster.call(op="restart", host=host)
                        events.append({"t": time.time(), "what": entry["what"]})
                        if entry.get("resume") is not None and pod is not None and pod.index == entry["resume"] \
                                and pod.suspended and pod.proc.poll() is None:
                            pod.suspended = False
                            os.kill(pod.proc.pid, signal.SIGCONT)
                if pod is None and restart_at is not None and now >= restart_at:
                    pod = Pod(len(pods), time.time(), d / f"pod{len(pods)}", None)  # type: ignore[arg-type]
                    pod.proc = self.spawn(c, pod.dir, flags, env_extra)
                    pods.append(pod)
                    restart_at = None
                if pod is not None and pod.proc.poll() is not None:
                    pod.ended, pod.rc = time.time(), pod.proc.returncode
                    marks = _read_marks(pod.dir / "marks.jsonl")
                    if pod.rc == 0 and any(m["mark"] == "final" for m in marks):
                        break  # trained to the end
                    if pod.restart_at is not None:  # a failure ended it
                        restart_at = pod.restart_at
                    elif pod.preempted is not None:  # it saved and left: the pod comes back on another node
                        restart_at = pod.ended + delay
                    else:  # a crash nobody caused: start it again, and say so
                        events.append({"t": pod.ended, "what": f"process exited {pod.rc} by itself",
                                       "segment": pod.index})
                        if sum(1 for e in events if "by itself" in e["what"]) > 3:
                            raise SystemExit(f"{c.name}: the training process keeps failing; see {pod.dir / 'log.txt'}:\n"
                                             + (pod.dir / "log.txt").read_text(errors="replace")[-3000:])
                        restart_at = pod.ended + delay
                    pod = None
                    continue
                if pod is not None and pod.preempted is not None and now > pod.preempted + self.a.grace + 30:
                    os.killpg(pod.proc.pid, signal.SIGKILL)
                    events.append({"t": now, "what": "grace period over: SIGKILL"})
                    pod.preempted = -math.inf
                if pod is not None and now - last_progress > 20:
                    last_progress = now
                    self.progress(c, pod, strikes, t_start)
                if pending and now - t_start >= pending[0].at_s:
                    marks = _read_marks(pod.dir / "marks.jsonl") if pod is not None else []
                    if self.finished(marks):
                        pending.clear()  # trained to the end: what is left is its exit
                    elif not self.a.defer_failures or (pod is not None and self.ready_for_failure(marks)):
                        k = self.strike(c, pending.pop(0), pod, cluster, delay, events, back)
                        strikes.append(k)
                        if k.failure.cls == POD_LOST and pod is None:  # the new pod was lost before it started
                            restart_at = k.t + delay
                        continue
                time.sleep(0.05)
        finally:
            if pod is not None and pod.proc.poll() is None:
                os.killpg(pod.proc.pid, signal.SIGKILL)
                pod.proc.wait()
            if cluster is not None:
                cluster.close()
        segments = processes(pods, strikes)
        final = next((m["t"] for m in segments[-1].marks if m["mark"] == "final"), None)
        t_end = final or max(p.ended or 0 for p in pods)
        return {"contender": c, "segments": segments, "pods": pods, "strikes": strikes, "events": events,
                "t_start": t_start, "wall_s": t_end - t_start, "metrics": metrics(d / "metrics.txt")}

    def finished(self, marks: list[dict]) -> bool:
        steps = [m["step"] for m in marks if m["mark"] == "step"]
        return bool(steps) and max(steps) >= self.a.steps - 1 or any(m["mark"] == "final" for m in marks)

    def ready_for_failure(self, marks: list[dict]) -> bool:
        """``--defer-failures``: the current training process has trained ``--fault-min-steps`` steps since
        it started or since its last elastic retry, and no retry is under way."""
        starts = [m for m in marks if m["mark"] == "start"]
        if not starts:
            return False
        pid = starts[-1]["pid"]
        seg = Segment(0, starts[-1]["t"], [m for m in marks if m.get("pid") == pid])
        current = [st for st, t in seg.steps() if t >= attempts(seg)[-1][0]]
        return len(current) >= self.a.fault_min_steps and not _retrying(seg)

    def progress(self, c: Contender, pod: Pod, strikes: list[Strike], t_start: float) -> None:
        steps = [m["step"] for m in _read_marks(pod.dir / "marks.jsonl") if m["mark"] == "step"]
        print(f"  {c.name}: {time.time() - t_start:.0f} s, pod {pod.index}, step {max(steps) if steps else '-'} of "
              f"{self.a.steps}, {len(strikes)} failures so far", flush=True)

    @staticmethod
    def training_pid(c: Contender, pod: Pod | None) -> int | None:
        """The pod's training process: the pod's own process, or under the supervisor its oldest child (the
        standby is started after the process it stands behind)."""
        if pod is None or pod.proc.poll() is not None:
            return None
        if not c.supervised:
            return pod.proc.pid
        try:
            kids = Path(f"/proc/{pod.proc.pid}/task/{pod.proc.pid}/children").read_text().split()
        except OSError:
            return None
        alive = []
        for k in kids:
            try:
                fields = Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                alive.append((int(fields[19]), int(k)))  # (start time in clock ticks, pid)
        return min(alive)[1] if alive else None

    def strike(self, c: Contender, f: Failure, pod: Pod | None, cluster: Cluster | None, delay: float,
               events: list, back: list) -> Strike:
        now = time.time()
        k = Strike(now, f, pod=pod.index if pod is not None else None)
        hosts: list[str] = []
        if f.cls in ("host_replaced", "slice_lost", ELASTIC):
            if f.cls == "host_replaced":
                hosts = [f"s{f.pick % (SLICES * HOSTS) // HOSTS}-h{f.pick % HOSTS}"]
            else:
                sl = f.pick % SLICES
                hosts = [f"s{sl}-h{h}" for h in range(HOSTS)]
            if cluster is not None:
                hosts = [h for h in hosts if h in cluster.hosts]
                for host in hosts:
                    cluster.call(op="wipe", host=host)
            # The hosts come back (replaced, empty) ``delay`` after the loss; in elastic mode not before the job
            # has seen them gone (on Pathways its devices fail the next step; here mtc's next save finds its
            # sidecars gone): a slice back before that would have been no loss to the job.
            back.append({"at": now + delay, "hosts": hosts, "seen_after": now if f.cls == ELASTIC else None,
                         "what": f"hosts {', '.join(hosts)} back, empty"})
        if f.cls == ELASTIC and cluster is not None:
            events.append({"t": now, "what": f"{ELASTIC}: hosts {', '.join(hosts)} lost (sidecars killed, ramdisks "
                                             "wiped); the training process stays"})
            return k
        if f.cls == "kill_sidecar":
            if cluster is None:
                events.append({"t": now, "what": "kill_sidecar: no sidecar (nothing happens)"})
                return k
            host = cluster.hosts[f.pick % len(cluster.hosts)]
            cluster.call(op="kill", host=host)
            back.append({"at": now + delay, "hosts": [host], "seen_after": None,  # the container restarts
                         "what": f"sidecar {host} restarted"})
            events.append({"t": now, "what": f"kill -9 sidecar {host}"})
            return k
        if hosts:
            events.append({"t": now, "what": f"{f.cls}: hosts {', '.join(hosts)} lost"
                                             + (" (ramdisks wiped)" if cluster is not None else "")})
        if pod is None or pod.proc.poll() is not None:
            events.append({"t": now, "what": f"{f.cls}: no training process (the pod is restarting)"
                                             + ("; the new pod is lost too" if f.cls == POD_LOST else "")})
            k.ended = "pod" if f.cls == POD_LOST else None
            return k
        if f.cls == "preempt":
            pod.proc.send_signal(signal.SIGTERM)
            pod.preempted = now
            k.ended = "pod"
            events.append({"t": now, "what": "SIGTERM (preemption notice)"})
            return k
        if f.cls == POD_LOST or not c.supervised:
            os.killpg(pod.proc.pid, signal.SIGKILL)
            pod.restart_at = now + delay
            k.ended, k.pid = "pod", pod.proc.pid
            events.append({"t": now, "what": f"{f.cls}: kill -9 of the " + ("head pod (the supervisor, the training "
                          "process and its standby)" if c.supervised else "training process (its pod)")})
            return k
        pid = None if pod.suspended else self.training_pid(c, pod)
        if pid is None:
            events.append({"t": now, "what": f"{f.cls}: no training process (the supervisor is " +
                           ("waiting for lost hosts)" if pod.suspended else "starting one)")})
            return k
        if hosts:
            # The training process dies with its hosts, and none can train before they are back (on Pathways a
            # new one waits for the slice's devices): the supervisor is stopped until then, for every
            # contender alike (mtc's restore would wait for its sidecars; Orbax has nothing to wait on here).
            os.kill(pod.proc.pid, signal.SIGSTOP)
            pod.suspended = True
            back[-1]["resume"] = pod.index  # the entry above: the supervisor goes on when the hosts are back
        os.kill(pid, signal.SIGKILL)
        k.ended, k.pid = "process", pid
        events.append({"t": now, "what": f"{f.cls}: kill -9 of the training process (pid {pid}); its pod stays"
                                         + (", its supervisor stopped until the hosts are back" if hosts else "")})
        return k


# --- accounting --------------------------------------------------------------------------------

STAGES = ("detect", "slice_wait", "restart_delay", "start_imports", "init", "setup", "restore", "compile",
          "first_step")
# A recovery that restarts the training process (a new pod) has these; the others are None.
RESTART_STAGES = ("restart_delay", "start_imports", "init", "setup", "restore", "compile", "first_step")
# One in the same process, by MaxText's elastic retry: the failure until the error reaches the retry
# (detect), the wait for the slices (slice_wait), then MaxText's initialize again, ...
ELASTIC_STAGES = ("detect", "slice_wait", "init", "setup", "restore", "compile", "first_step")
SHORT = {"restart_delay": "restart", "start_imports": "imports", "first_step": "1st step", "slice_wait": "slices"}
STAGE_HELP = {"detect": "the fault until its error reached MaxText's elastic retry",
              "slice_wait": "the retry's wait for every slice",
              "restart_delay": "the failure until the training program runs (a new pod: the restart delay and the "
                               "interpreter's start; in the pod: the supervisor's detection and the standby's promotion)",
              "start_imports": "its imports (a standby did them before)", "init": "MaxText's initialize",
              "setup": "until the restore", "restore": "the restore", "compile": "the train step's compilation",
              "first_step": "the first step"}
_CHAIN = (("init", "initialized"), ("setup", "restore_begin"), ("restore", "restore_end"), ("compile", "compiled"),
          ("first_step", "step"))


def _mark_at(seg: Segment, name: str, t: float) -> float | None:
    """The first mark ``name`` at or after ``t`` (``compiled``: the train step's)."""
    return next((m["t"] for m in seg.marks if m["mark"] == name and m["t"] >= t
                 and (name != "compiled" or m.get("prefix") == "train")), None)


def _warming(seg: Segment, failed_at: float) -> float:
    """How long after ``failed_at`` the standby promoted into ``seg`` was still importing (its ``start``
    mark's ``warm_at``); 0 when it was warm, or says nothing."""
    start = next((m for m in seg.marks if m["mark"] == "start"), None)
    warm_at = start.get("warm_at") if start is not None else None
    return max(0.0, warm_at - failed_at) if isinstance(warm_at, (int, float)) else 0.0


def stages_of(seg: Segment, failed_at: float | None, event: dict | None = None, cut: float = math.inf) -> dict:
    """[failure, first step after it] cut at the marks: the stages add up to the whole.

    Without ``event``: the segment's process start (a restart: ``failed_at`` is when the process
    before it failed; None: the job's own start). With ``event`` (an ``elastic_event`` mark of
    this segment): the recovery in the same process from that retried error, ``failed_at`` the
    fault that caused it. Each mark is the first one after the one before. ``cut``: when the next
    failure ended this recovery before its first step: the stage under way then gets the rest, the
    ones after it are None."""
    if event is None:
        t0 = seg.spawned if failed_at is None else failed_at
        points, chain = [("restart_delay", seg.spawned)], (("start_imports", "imported"), *_CHAIN)
    else:
        t0 = failed_at
        points, chain = [("detect", event["t"])], (("slice_wait", "slices_ready"), *_CHAIN)
    t = points[0][1]
    for name, mark in chain:
        at = _mark_at(seg, mark, t)
        points.append((name, at))
        t = at if at is not None else t
    out, prev = {name: None for name in STAGES}, t0
    for name, t in points:
        if t is not None and t > cut:
            t = cut
        if t is None:
            if cut == math.inf:
                continue
            t = cut
        out[name] = max(0.0, t - prev)
        prev = max(prev, t)
        if prev >= cut:
            break
    out["total"] = prev - t0
    return out


def _retrying(seg: Segment) -> bool:
    """An elastic retry under way: its last retried error has no step after the attempt it began."""
    retries = seg.retries()
    if not retries:
        return False
    ready = seg.first_after("slices_ready", retries[-1]["t"])
    return ready is None or seg.first_after("step", ready) is None


def attempts(seg: Segment) -> list[tuple[float, dict | None]]:
    """A process's attempts of the train function: (start, the retried error before it, None for the first)."""
    out: list[tuple[float, dict | None]] = [(seg.spawned, None)]
    for e in seg.retries():
        ready = seg.first_after("slices_ready", e["t"])
        if ready is not None:
            out.append((ready, e))
    return out


def _compiled(seg: Segment) -> float | None:
    return next((m["t"] for m in seg.marks if m["mark"] == "compiled" and m.get("prefix") == "train"), None)


def metrics(path: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[int(d["step"])] = {k: d.get(k) for k in METRICS}
    return out


def _short(restore: dict) -> str:
    """A restore's report in a table cell: tiers in MB and mtc's phases."""
    line = restore.get("mtc")
    if not line:
        return "MaxText: " + restore["maxtext"].split("directory ", 1)[-1] if restore.get("maxtext") else "from scratch"
    import re

    step = re.search(r"restored step (\d+)", line)
    phases = re.search(r"inventory ([\d.]+) s, pull ([\d.]+) s, load ([\d.]+) s", line)
    tiers = re.findall(r"(ram|peer|backup) (\d+) bytes", line)
    src = "backup" if "(backup " in line else "hosts"
    out = f"step {step.group(1) if step else '?'} from {src}: " + " ".join(f"{t} {int(b) / 1e6:.0f}MB"
                                                                         for t, b in tiers if int(b))
    if phases:
        out += f" (inv {phases.group(1)}, pull {phases.group(2)}, load {phases.group(3)} s)"
    return out


def _restore_in(seg: Segment, t0: float, t1: float | None) -> dict:
    """The restore's report between t0 and t1: mtc's (its ``mtc_restored`` mark), or MaxText's own line
    (``maxtext_restored``), else {}."""
    for mark, key in (("mtc_restored", "mtc"), ("maxtext_restored", "maxtext")):
        line = next((m["line"] for m in seg.marks if m["mark"] == mark and m["t"] >= t0
                     and (t1 is None or m["t"] <= t1)), None)
        if line:
            return {key: line}
    return {}


def endings(result: dict) -> list[tuple[float, str, str | None]]:
    """Every end of a training process or pod, in time order: (when, what ended it, the end's kind:
    "process" (the supervisor restarts it in the pod) or "pod" (a new pod, after the restart delay))."""
    out = [(k.t, k.failure.cls, k.ended) for k in result["strikes"] if k.ended]
    struck = {(k.pod, k.pid) for k in result["strikes"] if k.ended} | {(k.pod, None) for k in result["strikes"]
                                                                      if k.ended == "pod"}
    segs: list[Segment] = result["segments"]
    for a, b in zip(segs, segs[1:]):  # a process that ended with no failure: it exited by itself
        if a.failure is None and a.ended is not None and (a.pod, a.pid) not in struck and (a.pod, None) not in struck:
            out.append((a.ended, f"exit {a.rc if a.pod != b.pod else ''}".strip() + " (by itself)",
                        "pod" if a.pod != b.pod else "process"))
    return sorted(out)


def account(result: dict, ref: dict) -> dict:
    segs: list[Segment] = result["segments"]
    seen: set[int] = set()
    recoveries, recomputed_total = [], 0
    again_at: dict[tuple[int, int], list[int]] = {}  # (segment, attempt) -> steps it trained again
    for i, seg in enumerate(segs):
        runs = attempts(seg)
        for k, (t_begin, event) in enumerate(runs):
            t_next = runs[k + 1][0] if k + 1 < len(runs) else math.inf
            in_attempt = [(s, t) for s, t in seg.steps() if t_begin <= t < t_next]
            steps = [s for s, _ in in_attempt]
            again = sorted(set(steps) & seen)
            again_at[(i, k)] = again
            recomputed_total += len(again)
            first_at = in_attempt[0][1] if in_attempt else None
            if event is not None:  # a recovery in the same process: MaxText's elastic retry
                before = [(f, t) for f, t in seg.hits if t <= event["t"] and t >= (runs[k - 1][0] if k > 1 else 0)]
                f, failed_at = before[-1] if before else (None, event["t"])
                st = stages_of(seg, failed_at, event)
                cls = f.cls if f else "elastic retry"
                if f and f.cls != ELASTIC:
                    cls += " (elastic)"
                recoveries.append({
                    "cls": cls, "kind": "elastic", "segment": i, "attempt": k, "pid": seg.pid, "stages": st,
                    "recomputed": len(again), "failed_at": failed_at, "first_step_at": first_at,
                    "error": event.get("error", ""), "cut": False,
                    "recompute_s": len(again) * ref["step_s"], "lost_s": st["total"] + len(again) * ref["step_s"],
                    "resumed_at": steps[0] if steps else None, "restore": _restore_in(seg, t_begin, first_at)})
            seen |= set(steps)
    # A recovery by a new process (the supervisor's, in the pod) or a new pod: from each end to the first step
    # after it, or to the next end when that came first (a failure during a recovery: the recovery is cut).
    ends = endings(result)
    for e, (t0, cls, kind) in enumerate(ends):
        t_next = ends[e + 1][0] if e + 1 < len(ends) else math.inf
        i = next((j for j, s in enumerate(segs) if t0 <= s.spawned < t_next), None)
        seg = segs[i] if i is not None else None
        steps = seg.steps() if seg is not None else []
        first_at = steps[0][1] if steps and steps[0][1] < t_next else None
        cut = first_at is None
        end = first_at if first_at is not None else min(t_next, result["t_start"] + result["wall_s"])
        if seg is not None:
            st = stages_of(seg, t0, cut=end if cut else math.inf)
        else:  # no process started before the next end (a pod lost again while it restarted)
            st = {**{name: None for name in STAGES}, "restart_delay": end - t0, "total": end - t0}
        again = again_at.get((i, 0), []) if not cut else []
        recoveries.append({
            "cls": cls + (" (cut)" if cut else ""), "kind": "in-pod" if kind == "process" else "restart",
            "segment": i, "attempt": 0, "pid": seg.pid if seg is not None else None, "stages": st,
            "recomputed": len(again), "failed_at": t0, "first_step_at": first_at, "cut": cut,
            "recompute_s": len(again) * ref["step_s"], "lost_s": st["total"] + len(again) * ref["step_s"],
            "resumed_at": steps[0][0] if first_at is not None else None,
            # A standby promoted before its warm imports were done (a failure right after its pod
            # started) waited for them: how long past the failure, part of "restart_delay".
            "standby_warming_s": _warming(seg, t0) if seg is not None and kind == "process" else 0.0,
            "restore": _restore_in(seg, seg.spawned, first_at) if seg is not None and first_at is not None else {}})
    recoveries.sort(key=lambda r: r["failed_at"])
    trained = max(seen) + 1 if seen else 0
    # The uninterrupted run's own time to the same step (spawn to that step's end).
    ideal = ref["step_at"].get(trained - 1, ref["first_step_s"] + (trained - 1) * ref["step_s"])
    final = next((m for m in reversed(segs[-1].marks) if m["mark"] == "final"), None)
    got = result["metrics"]
    bad_steps = sorted(s for s, m in ref["metrics"].items() if s in got and got[s] != m)
    # MaxText writes a step's metrics line when the next step ends: a process killed after a step's
    # save loses that line, and its successor resumes after the step. Only such a step may lack one.
    restored = {r["resumed_at"] - 1 for r in recoveries if r["resumed_at"]}
    unlogged = sorted(s for s in ref["metrics"] if s not in got)
    bad_steps += [s for s in unlogged if s not in restored]
    first = stages_of(segs[0], None)
    # The steps as they ran under checkpointing: every step after a process's first (which compiles).
    gaps = [b - a for seg in segs for (_, a), (_, b) in zip(seg.steps()[1:], seg.steps()[2:])]
    return {"name": result["contender"].name, "period": result["contender"].period,
            "startup_s": first["total"], "step_s_run": statistics.mean(gaps) if gaps else ref["step_s"],
            "step_times_run": gaps,
            "backup_steps": result["contender"].backup_steps, "why": result["contender"].why,
            "wall_s": result["wall_s"], "steps": trained, "ideal_s": ideal, "ratio": ideal / result["wall_s"],
            "recomputed": recomputed_total, "failures": len(recoveries), "recoveries": recoveries,
            "lost_per_failure_s": (statistics.mean(r["lost_s"] for r in recoveries) if recoveries else 0.0),
            "final_equal": bool(final and final["digest"] == ref["digest"]), "metrics_equal": not bad_steps,
            "metrics_differ_at": sorted(bad_steps)[:10], "metrics_unlogged_at": unlogged[:10],
            "events": result["events"], "supervised": result["contender"].supervised,
            "strikes": [{"t": k.t, "cls": k.failure.cls, "ended": k.ended, "pid": k.pid, "pod": k.pod}
                        for k in result["strikes"]]}


# --- the planner against the measurement -------------------------------------------------------

def predicted(acc: dict, ref: dict, save_cost_s: float | None = None, *, first_order: bool = False,
              as_came: bool = False) -> float:
    """``mtc plan``'s model (``plan.tier`` and ``plan.goodput``) on this run's own measured costs: one
    tier at the contender's period, what a save cost its steps, the restore and the restart, and the
    failures as they came (the realized MTBF, so that a schedule's luck is not read as a model
    error: the mean wall time between the failures that hit it, after its first start). The run's
    first start-up is in the measured ratio's both terms; it is added here too.

    ``save_cost_s``: seconds a save takes from training; by default what the saves took in this
    run (its steps' mean time against the uninterrupted run's, times the period), else the cost
    given (the one measured before the run, which chose the period). ``first_order``: the sum of
    the waste terms instead of the quotient. ``as_came``: the work lost per failure as it came (the
    steps recomputed) instead of the model's half period."""
    from mtc.head.tools import plan as planner

    if not acc["recoveries"]:
        return math.nan
    startup = acc["startup_s"]  # this run's own first start, spawn to first step
    mtbf = max(acc["wall_s"] - startup, 1e-9) / len(acc["recoveries"])
    tau = acc["period"] * ref["step_s"]  # training seconds between saves
    if save_cost_s is None:
        save_cost_s = max(acc["step_s_run"] - ref["step_s"], 0.0) * acc["period"]
    restore = statistics.mean(r["stages"]["restore"] or 0.0 for r in acc["recoveries"])
    restart = statistics.mean(r["stages"]["total"] for r in acc["recoveries"]) - restore
    tier = planner.tier(save_cost_s, tau, restore, mtbf)
    if as_came:
        lost = acc["recomputed"] / len(acc["recoveries"]) * ref["step_s"]
        tier = dataclasses.replace(tier, failures=(lost + restore) / mtbf)
    goodput = (1 - tier.waste - restart / mtbf) if first_order else planner.goodput([tier], restart, mtbf)
    if goodput <= 0:
        return 0.0
    train = acc["ideal_s"] - ref["first_step_s"]  # the steps' own time, uninterrupted
    return acc["ideal_s"] / (startup + train / goodput)


# --- output ------------------------------------------------------------------------------------

def print_tables(accs: list[dict], ref: dict, args, preds: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=min(160, max(100, shutil.get_terminal_size((120, 24)).columns)))
    when = "failures deferred until a process trains (--defer-failures)" if args.defer_failures else \
        "failures at their drawn times"
    t = Table(title=f"goodput: {args.steps} steps, MTBF {args.mtbf:g} s, seed {args.seed}, restart delay "
                    f"{args.restart_delay:g} s, {when} (uninterrupted: {ref['wall_s']:.1f} s, "
                    f"{ref['step_s']:.3f} s a step; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for col in ("contender", "period", "wall s", "step s", "ratio", "predicted", "failures", "lost s/fail",
                "again", "bit for bit"):
        t.add_column(col, justify="right" if col not in ("contender",) else "left")
    for a in accs:
        same = "yes" if a["final_equal"] and a["metrics_equal"] else \
            ("STATE DIFFERS" if not a["final_equal"] else "METRICS DIFFER")
        t.add_row(a["name"], f"{a['period']}" + (f"+{a['backup_steps']}" if a["backup_steps"] else ""),
                  f"{a['wall_s']:.1f}", f"{a['step_s_run']:.3f}", f"{a['ratio']:.1%}",
                  f"{preds.get(a['name'], {}).get('in_run', math.nan):.1%}",
                  str(a["failures"]), f"{a['lost_per_failure_s']:.1f}", str(a["recomputed"]), same)
    con.print(t)
    con.print("period: steps between saves (+ mtc's backup interval). again: steps trained again. "
              "step s: a step's mean time under checkpointing (the uninterrupted run's: "
              f"{ref['step_s']:.3f} s). predicted: mtc plan's model, (1 - F) / (1 + C), on this run's costs: "
              "what the saves took from the steps (C), the restore, the restart and the MTBF as they came (F).",
              highlight=False)
    for a in accs:
        pr = preds.get(a["name"], {})
        if pr:
            con.print(f"  {a['name']}: {pr['in_run']:.1%} predicted; with the save cost measured before the run "
                      f"({pr['cost_before_s']:.3f} s a save, in the run {pr['cost_in_run_s']:.3f} s): "
                      f"{pr['cost_before']:.1%}; the first-order sum 1 - C - F: {pr['first_order']:.1%}; "
                      f"steps recomputed per failure {pr['recomputed_per_failure']:.1f} (the model's half period "
                      f"{a['period'] / 2:.1f}): with them, {pr['as_came']:.1%}", highlight=False)
    used = [name for name in STAGES if any(rec["stages"][name] is not None for a in accs for rec in a["recoveries"])]
    r = Table(title="each recovery, in seconds (the stages add up to the total, failure to first step; "
                    "\"cut\": the next failure struck before it)")
    for col in ("#", "contender", "fault", "kind", *(SHORT.get(n, n) for n in used), "total", "again"):
        r.add_column(col, justify="left" if col in ("contender", "fault", "kind") else "right")
    notes, n = [], 0
    for a in accs:
        for rec in a["recoveries"]:
            n += 1
            st = rec["stages"]
            r.add_row(str(n), a["name"], rec["cls"], rec["kind"], *[("-" if st[s] is None else f"{st[s]:.1f}")
                                                                    for s in used],
                      f"{st['total']:.1f}", str(rec["recomputed"]))
            if rec["restore"]:
                notes.append(f"  #{n} {_short(rec['restore'])}")
    con.print(r)
    con.print("again: steps trained again. Stages: " + "; ".join(f"{SHORT.get(s, s)}: {STAGE_HELP[s]}" for s in used),
              highlight=False)
    if notes:
        con.print("restores:", highlight=False)
        for line in notes:
            con.print(line, highlight=False, soft_wrap=True)


def timeline(accs: list[dict], results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"detect": "#762a83", "slice_wait": "#c2a5cf", "restart_delay": "#bbbbbb", "start_imports": "#f4a582", "init": "#fddbc7", "setup": "#d1e5f0",
              "restore": "#4393c3", "compile": "#b2182b", "first_step": "#92c5de", "training": "#1a9850"}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.9 * len(accs)))
    for y, (acc, res) in enumerate(zip(accs, results)):
        t0 = res["t_start"]
        for seg in res["segments"]:
            steps = seg.steps()
            if steps:
                ax.barh(y, (seg.ended or steps[-1][1]) - steps[0][1], left=steps[0][1] - t0, color=colors["training"],
                        height=0.5)
        first = stages_of(res["segments"][0], None)  # the job's own start, before any failure
        left = res["segments"][0].spawned - t0
        for name in RESTART_STAGES[1:]:
            if first[name]:
                ax.barh(y, first[name], left=left, color=colors[name], height=0.5, alpha=0.5)
                left += first[name]
        for rec in acc["recoveries"]:
            left = rec["failed_at"] - t0
            for name in STAGES:
                w = rec["stages"][name]
                if w:
                    ax.barh(y, w, left=left, color=colors[name], height=0.5)
                    left += w
            ax.plot([rec["failed_at"] - t0], [y + 0.33], marker="v", color="black")
            ax.text(rec["failed_at"] - t0, y + 0.38, rec["cls"], fontsize=7, rotation=20)
    ax.set_yticks(range(len(accs)), [f"{a['name']}\n{a['ratio']:.1%}" for a in accs])
    ax.set_xlim(left=0)
    ax.set_xlabel("wall time (s); the first start faded; a triangle is a failure", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), ncol=10, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --- main --------------------------------------------------------------------------------------

def measure_save_cost(runner: Runner, c_kind: str, ref: dict, steps: int = 12) -> float:
    """Seconds a save takes from training in this job: a short run of the contender's kind saving
    every step (mtc: its sidecar daemons, a backup every 4 saves, as the runs below), its steps'
    mean time against the uninterrupted run's. What the save blocks and what its background work
    (writes, replication, uploads, on this machine's cores) takes from the steps, together."""
    d = runner.work / f"calibrate-{c_kind}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    a = runner.a
    saved_steps, a.steps = a.steps, steps
    try:
        if c_kind == "mtc":
            res = runner.run(Contender(f"calibrate-{c_kind}", "mtc", 1, 4), [], 0.0)
            segs = res["segments"]
        else:
            extra = ["enable_checkpointing=True", "async_checkpointing=True", "checkpoint_period=1"]
            proc = runner.spawn(Contender("cal", "orbax", 1), d / "pod", runner.flags(d / "bucket", d / "m.txt", extra),
                                {})
            if proc.wait() != 0:
                raise SystemExit(f"calibration failed:\n{(d / 'pod' / 'log.txt').read_text()[-3000:]}")
            segs = [Segment(0, 0.0, _read_marks(d / "pod" / "marks.jsonl"))]
    finally:
        a.steps = saved_steps
    st = [t for _, t in segs[-1].steps()]
    times = [b - a for a, b in zip(st, st[1:])][1:]
    shutil.rmtree(d, ignore_errors=True)
    return max(0.0, statistics.mean(times) - ref["step_s"])


def mtc_period(state_bytes: int, mtbf_s: float, step_s: float, in_job_cost_s: float | None) -> tuple[int, str, float]:
    """The local period ``mtc plan`` recommends for this state over 4 hosts (2 slices), with the
    costs ``--measure`` gives, and the save's cost to training measured in this job where given."""
    from mtc.head.tools import plan as planner

    rates = planner.measure_rates()
    rates.pop("_spread", None)
    per_host = state_bytes / HOSTS  # each slice holds the whole state; a host its share
    costs = planner.costs_from_rates(per_host, d2h_gbps=rates["d2h"], write_gbps=rates["write"],
                                     backup_gbps=rates["backup"], ram_read_gbps=rates["ram_read"],
                                     peer_gbps=rates["peer"], backup_read_gbps=rates["backup_read"])
    blocked = costs.local_blocked_s
    why = f"mtc plan --measure: blocked {blocked:.3f} s a save"
    if in_job_cost_s is not None:
        costs = dataclasses.replace(costs, local_blocked_s=max(blocked, in_job_cost_s))
        why += f"; in this job a save took {in_job_cost_s:.3f} s from training"
    p = planner.plan(costs, mtbf_s=mtbf_s)
    period = max(1, round(p.local.interval_s / step_s))
    return period, f"{why}; every {p.local.interval_s:.1f} s at MTBF {mtbf_s:g} s", costs.local_blocked_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mtbf", type=float, default=90.0, help="mean seconds of wall time between failures (90)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=200, help="steps each contender trains (200)")
    p.add_argument("--restart-delay", type=float, default=5.0, help="seconds from a failure to the new pod (5)")
    p.add_argument("--grace", type=float, default=30.0, help="preemption grace period, seconds (30)")
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help=f"of {', '.join(CONTENDERS)} (default {','.join(DEFAULT_CONTENDERS)})")
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                   help=f"fault classes to draw from (default {','.join(DEFAULT_FAULTS)}; known: {', '.join(FAULTS)})")
    p.add_argument("--model", choices=sorted(MODELS), default="default")
    p.add_argument("--backup-steps", type=int, default=0, help="mtc's backup interval in steps (default: 4 periods)")
    p.add_argument("--mtc-cost", choices=("in-job", "blocked"), default="in-job",
                   help="the save cost mtc's period is planned with: measured in this job, saving every step (what "
                        "the save and its background work take from the steps), or mtc plan --measure's blocked "
                        "time alone (right where the background work has cores of its own)")
    p.add_argument("--period", type=int, default=0, help="force every contender's period (default: each its own)")
    p.add_argument("--max-failures", type=int, default=0, help="stop drawing failures after this many (0: no cap)")
    p.add_argument("--defer-failures", action="store_true",
                   help="a failure waits until the training process has trained --fault-min-steps steps since it "
                        "started or since its last elastic retry (default: failures strike at their drawn times, "
                        "during recoveries too)")
    p.add_argument("--fault-min-steps", type=int, default=1, help="with --defer-failures: the steps a failure waits "
                                                                  "for (1)")
    p.add_argument("--budget", type=float, default=1800.0, help="wall-clock cap per contender, seconds (1800)")
    p.add_argument("--workdir", type=Path, default=None, help="default: a fresh folder on /dev/shm")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, marks) afterwards")
    p.add_argument("--json", type=Path, help="write the figures as JSON here")
    p.add_argument("--timeline", type=Path, default=Path("bench-out") / "goodput.png")
    a = p.parse_args(argv)
    faults = [f.strip() for f in a.faults.split(",") if f.strip()]
    bad = [f for f in faults if f not in FAULTS]
    names = [n.strip() for n in a.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if bad or unknown or not faults or not names:
        p.error(f"unknown fault class(es) {bad} (known: {', '.join(FAULTS)})" if bad or not faults else
                f"unknown contender(s) {unknown} (known: {', '.join(CONTENDERS)})")
    if not (a.mtbf > 0 and a.steps >= 4 and a.restart_delay >= 0):
        p.error("--mtbf must be > 0, --steps >= 4, --restart-delay >= 0")

    py = str(mx_env.ensure())
    maxtext_dir = Path(subprocess.run([py, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                                      capture_output=True, text=True, check=True).stdout.strip())
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    work = a.workdir or Path(tempfile.mkdtemp(prefix="mtc-goodput-", dir=shm))
    work.mkdir(parents=True, exist_ok=True)
    model = MODELS[a.model]
    data = work / "data" / "data-train-00000.parquet"
    data.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([py, "-c", MAKE_DATA, str(data), str(a.seed), str(model["rows"])], check=True)
    runner = Runner(a, py, maxtext_dir, data, work, model)
    try:
        print(f"uninterrupted run ({a.steps} steps, no checkpointing) ...", flush=True)
        ref = runner.reference()
        print(f"  {ref['wall_s']:.1f} s, {ref['step_s']:.3f} s a step; first step after {ref['first_step_s']:.1f} s",
              flush=True)
        state_bytes = next(m["bytes"] for m in ref["marks"] if m["mark"] == "final")
        contenders = []
        orbax_cost = mtc_cost = 0.0
        if any(n.startswith("orbax") for n in names):
            orbax_cost = measure_save_cost(runner, "orbax", ref)
            young = math.sqrt(2 * max(orbax_cost, 1e-3) * a.mtbf)
            op = a.period or max(1, round(young / ref["step_s"]))
            young_why = f"Young/Daly: sqrt(2 x {orbax_cost:.3f} s x {a.mtbf:g} s) = {young:.1f} s"
            if "orbax" in names:
                contenders.append(Contender("orbax", "orbax", op, why=young_why))
            if "orbax-supervised" in names:
                contenders.append(Contender("orbax-supervised", "orbax", op, supervised=True,
                                            why=f"as orbax, under mtc's supervisor; {young_why}"))
            if "orbax-cached" in names:
                contenders.append(Contender("orbax-cached", "orbax", op, why="as orbax, with jax_cache_dir in the bucket"))
            if "orbax-every-step" in names:
                contenders.append(Contender("orbax-every-step", "orbax", 1, why="every step"))
        if any(n.startswith("mtc") for n in names):
            in_job = measure_save_cost(runner, "mtc", ref) if a.mtc_cost == "in-job" else None
            mp, why, mtc_cost = mtc_period(state_bytes, a.mtbf, ref["step_s"], in_job)
            mp = a.period or mp
            backup = a.backup_steps or 4 * mp
            if "mtc" in names:
                contenders.insert(0, Contender("mtc", "mtc", mp, backup, why, supervised=True))
            if "mtc-pod-restart" in names:
                contenders.append(Contender("mtc-pod-restart", "mtc", mp, backup, "as mtc, without its supervisor: "
                                            "a failed training process restarts its pod"))
            if "mtc-backup-only" in names:
                contenders.append(Contender("mtc-backup-only", "mtc", backup, backup, "local period = backup's",
                                            supervised=True))
        for c in contenders:
            print(f"  {c.name}: period {c.period} steps{f', backups every {c.backup_steps}' if c.backup_steps else ''}"
                  f"{', supervised' if c.supervised else ''} ({c.why})", flush=True)
        horizon = 3 * ref["wall_s"] + 600
        failures = schedule(a.seed, a.mtbf, faults, horizon)
        if a.max_failures:
            failures = failures[:a.max_failures]
        results, accs = [], []
        for c in contenders:
            print(f"{c.name} under the schedule ...", flush=True)
            res = runner.run(c, failures, a.restart_delay)
            results.append(res)
            acc = account(res, ref)
            accs.append(acc)
            print(f"  {acc['wall_s']:.1f} s, ratio {acc['ratio']:.1%}, {acc['failures']} failures, "
                  f"{acc['recomputed']} steps recomputed", flush=True)
        preds = {}
        for acc in accs:
            if not acc["recoveries"]:
                continue
            before = mtc_cost if acc["name"].startswith("mtc") else orbax_cost
            preds[acc["name"]] = {
                "in_run": predicted(acc, ref), "first_order": predicted(acc, ref, first_order=True),
                "as_came": predicted(acc, ref, as_came=True),
                "cost_before": predicted(acc, ref, before), "cost_before_s": before,
                "cost_in_run_s": max(acc["step_s_run"] - ref["step_s"], 0.0) * acc["period"],
                "recomputed_per_failure": acc["recomputed"] / len(acc["recoveries"])}
        print_tables(accs, ref, a, preds)
        if a.timeline:
            timeline(accs, results, a.timeline)
            print(f"timeline: {a.timeline}")
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps({
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                "reference": {k: ref[k] for k in ("wall_s", "step_s", "first_step_s", "stages", "step_times")},
                "state_bytes": state_bytes, "schedule": [dataclasses.asdict(f) for f in failures],
                "contenders": [{**acc, "predicted": preds.get(acc["name"])} for acc in accs]}, indent=1, default=str))
        wrong = [acc["name"] for acc in accs if not (acc["final_equal"] and acc["metrics_equal"])]
        if wrong:
            print(f"FAILED: the final state or the metrics differ from the uninterrupted run's for {wrong}",
                  file=sys.stderr)
            return 1
        print("every contender's final state and metrics are bit for bit the uninterrupted run's")
        return 0
    finally:
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        else:  # asked for: on /dev/shm it holds memory until removed
            held = sum(f.stat().st_size for f in work.rglob("*") if f.is_file() and not f.is_symlink())
            print(f"kept: {work} ({held / 2**30:.1f} GiB; remove it when done)")


if __name__ == "__main__":
    sys.exit(main())
