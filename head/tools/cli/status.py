"""``mtc status``: which steps live where, and which one a restore would choose, and why.

Read-only: it asks the sidecars for their inventories and step manifests and lists the backup
root, and never claims the hosts (a running job's head keeps driving them). For a stopped job
whose ramdisks are folders on this machine, ``--local-checkpoint-directory`` starts a sidecar
daemon on each folder for the time of the question.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from mtc.shared import backup_layout
from mtc.shared.config import MTCConfig
from mtc.shared.errors import MTCError
from mtc.shared.format import writers

from mtc.head.tools.cli.common import missing_local_root


@dataclass
class StepRow:
    step: int
    hosts: list[str]  # hosts with the step committed
    whole_on: list[str]  # ... of which hold all of their own share
    min_copies: int  # fewest hosts holding any one blob of the step
    replicated: bool  # every blob on >= replication_factor slices
    backups: list[str]  # backups of this step
    restorable: bool
    why_not: str = ""  # what is missing (not restorable), or lost and covered by other parts
    replication: str = ""  # when not replicated: hosts whose last pull of the step failed, and why


@dataclass
class Status:
    hosts: list[str]
    unreachable: dict
    steps: list[StepRow]
    backup_root: str | None
    backups: list[dict]
    restore_version: str | None
    choice: int | None
    reason: str
    notes: list[str] = field(default_factory=list)
    backup_error: str | None = None  # why the backup root could not be listed (then its backups are not known)
    damaged: list[dict] = field(default_factory=list)  # backups a scrub marked damaged: {"name", "step", "why"}
    backup_root_missing: bool = False  # the (local) backup root does not exist: backup_error says so
    pin_broken: bool = False  # restore.version names a backup restore cannot take: every restore fails
    verified: dict | None = None  # with --verify: {"steps", "copies" hashed, "corrupt", "errors": {host: why},
    #                                "own_part_only": {host: why its copies for others went unhashed}}

    def verify_line(self) -> str | None:
        """What --verify hashed, in one line (None without --verify)."""
        v = self.verified
        if v is None:
            return None
        hosts = len(self.hosts) - len(self.unreachable) - len(v["errors"])
        return (f"verify: {v['copies']} blob copies of {v['steps']} step(s) hashed on {hosts} host(s): "
                + (f"{v['corrupt']} corrupt (not counted; see the notes column)" if v["corrupt"] else "none corrupt")
                + (f"; {len(v['errors'])} host(s) could not hash" if v["errors"] else ""))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _slices(spec: dict) -> dict[str, int]:
    return {h["id"]: h["slice"] for h in spec["hosts"]}


def collect(dispatch: Any, spec: dict, config: MTCConfig, *, verify: bool = False) -> Status:
    """The status of the hosts behind ``dispatch`` (read-only calls) and of the backup root.

    With ``verify``, every host hashes its blobs of every step, and a copy that fails its hash
    does not count (without it, a corrupt copy is only found when a restore reads it).
    """
    from mtc.head.replication.plan import step_views

    inv = dispatch.inventories()
    unreachable = {h: i.error for h, i in inv.items() if i.error}
    def manifest(step: int, digest: str):
        try:  # for the rows of hosts that committed a record of the step: read with its manifest
            return dispatch.manifest(step, digest)
        except MTCError:
            return None

    headers: dict[str, Any] = {}

    def header(step: int, digest: str):
        """The manifest's header line (O(arrays + hosts)): a step whose every part is whole where it was
        written is summed up from it and the inventories, without reading a row (``StepView.by_parts``)."""
        if digest not in headers:
            try:
                headers[digest] = dispatch.manifest_header(step, digest)
            except MTCError:
                headers[digest] = None
        return headers[digest]

    views = step_views(inv, manifest, header)
    listing = {"backups": [], "restore_version": None}
    notes: list[str] = []
    backup_error = None
    root_missing = missing_local_root(config.backup_root) if config.base_output_directory else None
    if config.base_output_directory and not root_missing:  # a missing root is not listed: that would create it
        try:
            listing = dispatch.backup_listing(deadline_s=10)
        except MTCError as e:  # not "no backups": which backups exist is not known
            backup_error = f"{type(e).__name__}: {e}"
    in_backup: dict[int, list[str]] = {}
    for b in listing["backups"]:
        in_backup.setdefault(b["step"], []).append(b["name"])
    slice_of = _slices(spec)
    verified: dict = {"steps": 0, "copies": 0, "corrupt": 0, "errors": {}, "own_part_only": {}}
    factor = config.replication_factor
    rows = []
    for step in sorted(set(views) | set(in_backup)):
        v = views.get(step)
        backups = in_backup.get(step, [])
        if v is None:
            rows.append(StepRow(step, [], [], 0, False, backups, bool(backups) and not unreachable,
                                "" if backups else "on no host"))
            continue
        n_slices = len(set(slice_of.values()))
        # Every saved box is in a part some host holds whole (its writer's, a peer copy of it, a data-parallel
        # twin's): the copies from the header and the inventories, O(hosts), no blob row. Each writer's share
        # where every part is whole; where a writer's part is gone, each box where its twins' parts and the
        # peer copies are (None: the header cannot say, and the rows do).
        fewest = (writers.copies(headers[v.manifest], v.part_holders,
                                 (lambda h: slice_of.get(h, 0)) if n_slices > 1 else (lambda h: h), v.pieces)
                  if v.by_writers and v.lost and not verify else None)
        if v.by_parts and not verify or fewest is not None:
            copies = [fewest] if fewest is not None else copies_by_share(inv, step, v.manifest,
                                                                         headers[v.manifest], slice_of)
            restorable = not unreachable or bool(backups)
            replicated = bool(copies) and min(copies) >= factor
            pieced = "; ".join(f"{w}'s blobs are held in pieces by {', '.join(hs)}" for w, hs in v.pieces.items())
            lost = (f"hosts {', '.join(v.lost)} no longer hold their parts; every box they wrote is in a part "
                    "another host holds whole" + (f", or in pieces ({pieced})" if pieced else "")
                    if v.lost else "")
            rows.append(StepRow(step, sorted(v.hosts), sorted(v.whole), min(copies) if copies else 0, replicated,
                                backups, restorable, lost, "" if replicated else _pull_failures(inv, step)))
            continue
        holders = [set(hs) for hs in v.holders]
        corrupt: list[str] = []
        names = _blob_names(dispatch, step) if (verify or not v.restorable) else []
        if verify and names:
            index = {n: i for i, n in enumerate(names)}
            verified["steps"] += 1
            for host, res in sorted(dispatch.verify(step).items()):
                if "error" in res:
                    verified["errors"][host] = res["error"]
                    continue
                if res.get("own_part_only"):
                    verified["own_part_only"][host] = res["own_part_only"]
                verified["copies"] += int(res.get("checked", 0))
                verified["corrupt"] += len(res.get("bad", []))
                for n in res.get("bad", []):
                    if n in index:
                        holders[index[n]].discard(host)
                        corrupt.append(f"blob {n[:12]}.. corrupt on {host}")
        copies = [len({slice_of.get(h, 0) for h in hs}) if n_slices > 1 else len(hs) for hs in holders]
        whole_copies = all(holders)
        why = "; ".join(corrupt)
        if not whole_copies:
            missing = [i for i, hs in enumerate(holders) if not hs]
            first = names[missing[0]][:12] + ".." if names else f"#{missing[0]}"
            why = "; ".join(filter(None, [why, (f"blob {first} and {len(missing) - 1} more on no host (no good copy)"
                                                if len(missing) > 1 else f"blob {first} on no host (no good copy)")
                                               + (" and in no backup" if not backups else "")]))
        restorable = (whole_copies and not unreachable) or bool(backups)
        replicated = bool(copies) and min(copies) >= factor
        rows.append(StepRow(step, sorted(v.hosts), sorted(v.whole), min(copies) if copies else 0, replicated,
                            backups, restorable, why, "" if replicated else _pull_failures(inv, step)))
    rv = listing.get("restore_version")
    if rv:
        pinned = backup_layout.parse_backup_name(rv)
        exists = any(b["name"] == rv for b in listing["backups"])
        damaged = any(d["name"] == rv for d in listing.get("damaged", []))
        choice = pinned if exists else None
        pin_broken = not exists
        reason = (f"restore.version pins backup {rv} (step {pinned}): restore takes exactly that backup" if exists
                  else f"restore.version names backup {rv}, which is marked damaged (restore never takes it): "
                       "restore fails until it is pinned to another (mtc restore-version set NAME) or cleared"
                  if damaged else f"restore.version names backup {rv}, which does not exist: restore fails until it "
                                  "is fixed (mtc restore-version set NAME) or cleared")
    else:
        pin_broken = False
        choice, where, why_none = _restore_choice(dispatch, config, listing)
        row = next((r for r in rows if r.step == choice), None)
        if verify and row is not None and "corrupt" in row.why_not:
            # --verify knows what a restore only finds when it reads the copy: it would plan again without
            # it, and take the newest step that is whole without the corrupt copies, from where they are.
            good = [r for r in rows if r.restorable and r.step <= choice]
            choice = good[-1].step if good else None
            if good:
                r = good[-1]
                on_hosts = r.hosts and r.min_copies > 0 and not unreachable and "no good copy" not in r.why_not
                where = "from the hosts" if on_hosts else f"from backup {r.backups[0]}"
        if choice is None:
            reason = "no step is restorable" + (f"; hosts not answering: {', '.join(sorted(unreachable))}"
                                                if unreachable else "") + (f" ({why_none})" if why_none else "")
        else:
            for r in rows:
                if r.step == choice and not r.restorable:  # whole with blobs from the backups of other steps
                    r.restorable = True
                    r.why_not = "; ".join(filter(None, [r.why_not, "restorable: the blobs no host holds are in "
                                                                   "the backups of other steps"]))
            skipped = [f"step {x.step}: {x.why_not}" for x in rows if x.step > choice]
            reason = f"step {choice}, the newest whose every blob has a copy, {where}" + (
                f" (newer: {'; '.join(skipped)})" if skipped else "")
    if root_missing:  # said once, after the table (the command prints backup_error to stderr)
        backup_error = root_missing
    elif backup_error:
        reason += (f"; the backup root {config.backup_root} could not be listed ({backup_error}): its backups are "
                   "not known, and a step only they hold is not counted")
    if config.base_output_directory and not (root_missing or backup_error or listing["backups"] or rv
                                             or listing.get("damaged")):
        notes.append(f"the backup root {config.backup_root} holds no backup: none made yet, or "
                     "--base-output-directory and --run-name are not the job's")
    for h, e in sorted(verified["errors"].items()):
        notes.append(f"{h} could not hash its blobs ({e}): its copies are counted unverified")
    for h, e in sorted(verified["own_part_only"].items()):
        notes.append(f"{h} hashed its own part's blobs only; the copies it keeps for other hosts are counted "
                     f"unverified ({e})")
    by_why: dict[str, list[dict]] = {}
    for d in listing.get("damaged", []):
        by_why.setdefault(d["why"], []).append(d)
    for why, ds in by_why.items():  # one note per reason: a root of another key's backups is one line
        what = "not taken" if why.startswith("not sealed by this job") else "damaged"
        names = ", ".join(f"{d['name']} (step {d['step']})" for d in ds[:3]) + (f" and {len(ds) - 3} more"
                                                                               if len(ds) > 3 else "")
        notes.append(f"backup{'s' if len(ds) > 1 else ''} {names} {'are' if len(ds) > 1 else 'is'} {what}, restore "
                     f"never chooses {'them' if len(ds) > 1 else 'it'}: {why}")
    if unreachable:
        notes.append("hosts that did not answer (no step is confirmed on them): "
                     + "; ".join(f"{h} ({e})" for h, e in sorted(unreachable.items())))
    return Status(hosts=sorted(inv), unreachable=unreachable, steps=rows,
                  backup_root=config.backup_root if config.base_output_directory else None,
                  backups=listing["backups"], restore_version=rv, choice=choice, reason=reason, notes=notes,
                  backup_error=backup_error, damaged=listing.get("damaged", []), backup_root_missing=bool(root_missing),
                  pin_broken=pin_broken, verified=verified if verify else None)


def _restore_choice(dispatch: Any, config: MTCConfig, listing: dict) -> tuple[int | None, str, str]:
    """(the step a restore would take, from where, why none): the restore's own choice
    (``Restorer.choose_step``, read-only: it repairs nothing), so that status and restore never differ."""
    from mtc.head.restore.restorer import Restorer

    restorer = Restorer(dispatch, config, strategy=None, replicate=lambda committed: None)  # type: ignore[arg-type]
    restorer.read_only = True
    try:
        step, backup_name, _, _ = restorer.choose_step(None, listing)
    except MTCError as e:
        return None, "", f"{type(e).__name__}: {str(e).split(';')[0]}"
    return step, "from the hosts" if backup_name is None else f"from backup {backup_name}", ""


def _pull_failures(inv: dict, step: int) -> str:
    """Why a step lacks its copies, as the hosts tell it: their last failed pull of it (a full ramdisk
    says what it lacks); a running head's replication retries until the copies are made."""
    notes = [f"{h} could not take its copies {age:.0f} s ago: {why}" for h, i in sorted(inv.items())
             for s, why, age in i.pull_failures if s == step]
    return "; ".join(notes) + ("; the head's replication retries while it runs" if notes else "")


def copies_by_share(inv: dict, step: int, digest: str, header: Any, slice_of: dict[str, int]) -> list[int]:
    """For each host's part of ``step``: on how many failure domains (slices; hosts with one slice) a host
    holds that share whole. Its writer and its data-parallel twins (the same share, held whole), and the
    hosts that keep copies of it (they keep the whole manifest, and report the shares they hold whole):
    what the replication decision counts (``covered_by_shares``), without a blob name."""
    rows = {h: s for h, i in inv.items() if not i.error for s in i.steps if s.step == step and s.manifest == digest}
    many = len(set(slice_of.values())) > 1
    by_share: dict[str, set[str]] = {}  # share digest -> hosts that hold it whole (one pass: O(hosts))
    for g, s in rows.items():
        if s.own and s.local_blobs == s.blobs:
            by_share.setdefault(s.own, set()).add(g)
        for d in s.copies:
            by_share.setdefault(d, set()).add(g)
    out = []
    for host, _ in header.parts:
        holders = by_share.get(rows[host].own, set()) if host in rows and rows[host].own else set()
        out.append(len({slice_of.get(g, 0) for g in holders} if many else holders))
    return out


def _blob_names(dispatch: Any, step: int) -> list[str]:
    try:
        return dispatch.manifest_blob_names(step)
    except MTCError:
        return []


COLUMNS = ("step", "on hosts", "replicated", "backups", "restorable", "restore", "notes")


def _cells(st: Status, r: StepRow) -> tuple[str, ...]:
    """One row of the table, as text: the step chosen is marked in its own column, what is wrong with a
    step (a corrupt or missing copy, a failed pull) in the notes."""
    notes = "; ".join(filter(None, [r.why_not, f"not replicated: {r.replication}" if r.replication else ""]))
    return (str(r.step), ", ".join(r.hosts) or "-",
            f"yes ({r.min_copies} copies)" if r.replicated else f"no ({r.min_copies})",
            "\n".join(r.backups) or "-", "yes" if r.restorable else "no",
            "<- restore" if r.step == st.choice else "", notes)


def render(st: Status, console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"steps x tiers ({len(st.hosts)} hosts)")
    # A backup name is copied into `mtc restore-version set`: one a line, never cut or folded; the other
    # columns fold where the terminal is narrow.
    longest = max((len(b) for r in st.steps for b in r.backups), default=0)
    for col in COLUMNS:
        if col == "backups":
            table.add_column(col, no_wrap=True, min_width=longest)
        else:
            table.add_column(col, overflow="fold")
    for r in st.steps:
        table.add_row(*(escape(c) for c in _cells(st, r)))
    console.print(table)
    # Messages are text, not markup: "mtc[gcs]" must print as written.
    console.print(f"backup root: {st.backup_root or 'none configured'}; restore.version: "
                  f"{'not known' if st.backup_error else st.restore_version or 'not set'}", markup=False)
    console.print(f"restore would choose: {st.reason}", markup=False)
    if st.verify_line():
        console.print(st.verify_line(), markup=False)
    for n in st.notes:
        console.print(f"note: {n}", markup=False)


def render_plain(st: Status) -> None:
    """The table without rich (a plain ``pip install mtc``)."""
    print(f"steps x tiers ({len(st.hosts)} hosts)")
    print("  ".join(COLUMNS))
    for r in st.steps:
        print("  ".join(c.replace("\n", ", ") for c in _cells(st, r)).rstrip())
    print(f"backup root: {st.backup_root or 'none configured'}; restore.version: "
          f"{'not known' if st.backup_error else st.restore_version or 'not set'}")
    print(f"restore would choose: {st.reason}")
    if st.verify_line():
        print(st.verify_line())
    for n in st.notes:
        print(f"note: {n}")


def run(args: Any) -> int:
    """``mtc status`` (see cli.py for the options). Exit 0; 1 when a host did not answer or the backup
    root could not be listed (what they hold is not known: the answer may be wrong); 2 on bad input."""
    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
    from mtc.head.tools.sources import TOOL_ERRORS, job_hosts, refused

    try:
        with job_hosts(args.cluster_spec, args.local_checkpoint_directory) as (hosts, rows):
            spec = json.loads(hosts.spec_path.read_text())
            config = MTCConfig(local_checkpoint_directory=str(rows[0][1] if rows else hosts.spec_path.parent),
                               cluster_spec=str(hosts.spec_path), base_output_directory=args.base_output_directory or "",
                               run_name=args.run_name or "", replication_factor=args.replication_factor,
                               peer_token=hosts.token)
            devices = hosts.devices  # device ids only name hosts here: status moves no array
            dispatch = ClusterDispatcher(config, devices=devices)
            try:
                st = collect(dispatch, spec, config, verify=args.verify)
            finally:
                dispatch.close()
    except TOOL_ERRORS as e:
        return refused("status", e)
    if args.json:
        print(st.to_json())
    else:
        try:
            from rich.console import Console
        except ImportError:  # rich comes with the demo, test and export extras; plain text without it
            render_plain(st)
        else:
            render(st, Console(width=max(100, os.get_terminal_size(1).columns if sys.stdout.isatty() else 120)))
    if st.backup_root_missing:
        print(f"mtc status: {st.backup_error}", file=sys.stderr)
    elif st.backup_error:
        print(f"mtc status: the backup root {st.backup_root} could not be listed ({st.backup_error}); its backups "
              "are not counted", file=sys.stderr)
    if st.unreachable:
        print(f"mtc status: {len(st.unreachable)} of {len(st.hosts)} hosts did not answer; what they hold is not "
              "counted", file=sys.stderr)
    if st.pin_broken:
        print(f"mtc status: {st.reason}", file=sys.stderr)
    return 1 if st.unreachable or st.backup_error or st.pin_broken else 0
