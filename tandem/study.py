"""`tandem study`: a grid of ordinary `tandem run`s plus named extra runs, resumable, one report.

Rules:
- A study config (YAML; configs/study/*.yaml, the keys on `load_study`) names a base run config,
  overrides for every run, a grid (every combination of its values is one run) and named extra runs.
- A grid run is named by its grid values, the last part of each key
  (`recipe-bf16__max_staleness-0__seed-0`); a named run by its key. Runs whose resolved configs are
  equal run once: the later name is an alias of the first (its summary row reads the same folder).
- Each run is `tandem run` in DIR/<name>/ (logs in DIR/<name>/launcher.log); `--jobs N` runs N at a
  time, each pinned to its share of this process's CPU set (trainer, rollout workers and Redis
  inherit it).
- A run is finished when DIR/<name>/done.json exists; re-running the study skips finished runs and
  restarts interrupted ones in their folder, where the trainer resumes from its checkpoint. A run
  folder made for another config is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from policy.configfile import parse_override, read_mapping, set_dotted

from . import config as run_config

_STUDY_KEYS = {"name", "description", "base", "set", "grid", "runs"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, kw_only=True)
class StudyRun:
    """One run of a study: its name, the keys that define it (grid values or the named run's
    overrides) and its full run config as a plain dict (base + set + keys)."""

    name: str
    keys: dict[str, Any]
    config: dict
    named: bool  # a named extra run (else a grid point)
    alias_of: str | None = None  # an earlier run with the same resolved config: that folder is used


@dataclass(frozen=True, kw_only=True)
class Study:
    """A study config, resolved. Its YAML (configs/study/*.yaml):

        name: staleness-x-precision
        description: free text       # copied into the report (see below)
        base: demo.yaml              # the base run config (next to this file, else under configs/)
        set:                         # overrides applied to every run (dotted keys or nested mappings)
          trainer.max_steps: 100
        grid:                        # every combination of these config keys' values is one run
          recipe: [bf16, int4_qat, nvfp4_moe]
          loop.max_staleness: [0, 1, 2, 4, 8]
          loop.seed: [0, 1, 2]
        runs:                        # named extra runs: overrides on top of base + set
          int4-train_bf16-rollout: {recipe: int4_qat, rollout_recipe: bf16}

    The report shows the description, or what ran instead when `grid.`/`runs` overrides change it.
    """

    name: str
    description: str
    base: Path
    set: dict[str, Any]  # dotted key -> value
    grid: dict[str, list]  # dotted key -> values, in the config's order
    runs: dict[str, dict[str, Any]]  # named run -> dotted key -> value
    source: dict = field(default_factory=dict)  # the study config as resolved (written into DIR/study.yaml)

    def expand(self) -> list[StudyRun]:
        """Grid points first (the last key varies fastest), then the named runs; every config validated."""
        base = read_mapping(self.base, f"study {self.name}: base {str(self.base)!r}")
        out: list[StudyRun] = []
        seen: dict[str, str] = {}  # canonical resolved config -> first run's name
        keys = list(self.grid)
        points = [dict(zip(keys, values)) for values in itertools.product(*self.grid.values())] if keys else []
        todo = [(grid_run_name(p), p, False) for p in points] + [(n, o, True) for n, o in self.runs.items()]
        for name, overrides, named in todo:
            cfg = _with(_with(base, self.set), overrides)
            cfg["run_id"] = study_run_id(name)
            try:
                resolved = run_config.from_dict(cfg)
                _check_recipes(resolved)
            except (ValueError, TypeError) as e:
                raise ValueError(f"study {self.name}: run {name}: {e}") from None
            canon = json.dumps({k: v for k, v in resolved.to_dict().items() if k != "run_id"}, sort_keys=True)
            if name in {r.name for r in out}:
                raise ValueError(f"study {self.name}: two runs are named {name}")
            out.append(StudyRun(name=name, keys=dict(overrides), config=cfg, named=named, alias_of=seen.get(canon)))
            seen.setdefault(canon, name)
        if not out:
            raise ValueError(f"study {self.name}: no runs (an empty grid and no named runs)")
        return out


def command_line() -> str:
    """This process's command line as a user typed it (`tandem study ...`)."""
    return "tandem " + " ".join(sys.argv[1:])


def grid_run_name(point: dict[str, Any]) -> str:
    """`{"recipe": "bf16", "trainer.backward": "hp"}` -> `recipe-bf16__backward-hp`."""
    return "__".join(f"{k.rsplit('.', 1)[-1]}-{re.sub(r'[^A-Za-z0-9._-]', '-', str(v))}" for k, v in point.items())


def study_run_id(name: str) -> str:
    """A run's run_id: its name with '__' as '.', cut to 64 characters (the limit on run ids) with
    the first 8 hex digits of the full name's SHA-256 at the end when longer, so that ids stay distinct."""
    run_id = name.replace("__", ".")
    if len(run_id) <= 64:
        return run_id
    return run_id[:55] + "-" + hashlib.sha256(run_id.encode()).hexdigest()[:8]


def _check_recipes(cfg: run_config.RunConfig) -> None:
    from .services import load_recipe  # imports the trainer and the rollout worker: seconds

    for name in filter(None, (cfg.recipe, cfg.rollout_recipe)):
        load_recipe(cfg, name)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> dotted keys; `model.overrides` stays one value (its keys are model fields)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key != "model.overrides" and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _with(data: dict, dotted: dict[str, Any]) -> dict:
    """A deep copy of `data` with each dotted key set (nested sections created as needed)."""
    out = json.loads(json.dumps(data))
    for key, value in dotted.items():
        set_dotted(out, key, json.loads(json.dumps(value)))
    return out


def load_study(path: str | Path, overrides: list[str] = ()) -> Study:
    """A study YAML (its keys: Study) + command-line overrides (`_apply_overrides`) -> Study (every
    run's config checked by `expand`)."""
    p = run_config.find_config(path)
    if p is None:
        raise ValueError(f"study config {path}: no such file")
    data = read_mapping(p, f"study config {p}")
    unknown = sorted(set(data) - _STUDY_KEYS)
    if unknown:
        raise ValueError(
            f"study config {p}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_STUDY_KEYS))}"
        )
    name = data.get("name") or p.stem
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"study config {p}: name={name!r} (letters, digits, '-', '_' and '.')")
    sets = _mapping(data.get("set"), "set", p)
    grid = _flatten_keys(_mapping(data.get("grid"), "grid", p))
    runs = _mapping(data.get("runs"), "runs", p)
    file_grid, file_runs = dict(grid), list(runs)
    runs = _apply_overrides(overrides, sets, grid, runs)
    _check_grid_and_runs(p, grid, runs)
    base_ref = data.get("base", "demo.yaml")
    base = next((b for b in (p.parent / base_ref, run_config.REPO_CONFIGS / base_ref) if b.is_file()), None)
    if base is None:
        raise ValueError(f"study config {p}: base {base_ref!r} found neither next to it nor under configs/")
    study = Study(
        name=name,
        description=describe(str(data.get("description") or "").strip(), file_grid, grid, file_runs, list(runs)),
        base=base,
        set=_flatten(sets),
        grid={k: list(v) for k, v in grid.items()},
        runs={k: _flatten(v) for k, v in runs.items()},
    )
    source = {
        "name": study.name,
        "description": study.description,
        "base": str(base_ref),
        "set": study.set,
        "grid": study.grid,
        "runs": study.runs,
    }
    return Study(**{**study.__dict__, "source": source})


def _apply_overrides(overrides, sets: dict, grid: dict, runs: dict) -> dict:
    """Command-line `key=value` onto the study: `grid.KEY=[...]` replaces (or adds) a grid axis in
    `grid`, `runs=[a, b]` keeps only those named runs (`runs=[]`: none; returned), any other key is
    one more entry of `sets`."""
    for item in overrides:
        key, value = parse_override(item)
        if key.startswith("grid."):
            grid[key[len("grid.") :]] = value
        elif key == "runs":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"override runs={value!r}: want a list of named runs, e.g. runs=[a,b]")
            missing = [v for v in value if v not in runs]
            if missing:
                raise ValueError(f"override runs: no named run(s) {', '.join(missing)}; known: {', '.join(runs)}")
            runs = {k: runs[k] for k in value}
        elif key in grid:
            raise ValueError(f"override {key}: {key} is a grid key; write grid.{key}=[...]")
        else:
            sets[key] = value
    return runs


def _check_grid_and_runs(p: Path, grid: dict, runs: dict) -> None:
    """Every grid axis a non-empty list; every named run a well-named mapping."""
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"study config {p}: grid.{key} must be a non-empty list, got {values!r}")
    for rname, o in runs.items():
        if not isinstance(rname, str) or not _NAME_RE.match(rname) or "__" in rname:
            raise ValueError(f"study config {p}: run name {rname!r} (letters, digits, '-', '_', '.'; no '__')")
        if not isinstance(o, dict):
            raise ValueError(f"study config {p}: runs.{rname} must be a mapping of config keys")


def describe(text: str, file_grid: dict, grid: dict, file_runs: list[str], runs: list[str]) -> str:
    """The description a study's report shows: the file's `text` while the command line left its grid
    and named runs as the file has them; else what ran, noting that the file's text (written for
    what the file runs) is left out."""
    if grid == file_grid and runs == file_runs:
        return text

    def flow(values: list) -> str:
        return "[" + ", ".join(map(str, values)) + "]"

    changed = [f"grid.{k}={flow(grid[k])}" for k in grid if grid[k] != file_grid.get(k)]
    changed += [f"runs={flow(runs)}"] if runs != file_runs else []
    axes = " x ".join(f"{k} in {flow(v)}" for k, v in grid.items()) or "none"
    ran = f"What ran: the grid {axes}; named runs: {', '.join(runs) or 'none'}."
    return ran + (f" (The study file's description is left out: {', '.join(changed)} on the command line changed"
                  " what it describes.)" if text else "")  # fmt: skip


def _mapping(value, what: str, p: Path) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"study config {p}: {what} must be a mapping, got {type(value).__name__}")
    return dict(value)


def _flatten_keys(grid: dict) -> dict:
    """grid: {trainer: {backward: [...]}} and {trainer.backward: [...]} mean the same."""
    out = {}
    for k, v in grid.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _flatten_keys(v).items()})
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------- running


def cpu_shares(jobs: int, cpus: list[int] | None = None) -> list[list[int]]:
    """Split the CPU set into `jobs` contiguous shares; more jobs than CPUs share them round robin."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if jobs <= len(cpus):
        return [cpus[i * len(cpus) // jobs : (i + 1) * len(cpus) // jobs] for i in range(jobs)]
    return [[cpus[i % len(cpus)]] for i in range(jobs)]


def run_state(run_dir: Path) -> str:
    """'done' (done.json), 'interrupted' (`tandem run` started there: its config.yaml) or 'new'."""
    if (run_dir / "done.json").is_file():
        return "done"
    return "interrupted" if (run_dir / "config.yaml").is_file() else "new"


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for ln in path.read_text().splitlines() if ln.strip()) if path.is_file() else 0


def _fmt_s(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Job:
    def __init__(self, run: StudyRun, run_dir: Path, cpus: list[int]):
        self.run, self.run_dir, self.cpus = run, run_dir, cpus
        self.max_steps = run_config.from_dict(run.config).trainer.max_steps
        self.steps_at_start = _steps_done(run_dir)
        cfg_path = run_dir / "study-run.yaml"
        self.started = time.time()
        log = open(run_dir / "launcher.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "run", str(cfg_path), "--run-dir", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the study only; it stops each run in order
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()

    def fraction(self) -> float:
        return min(1.0, _steps_done(self.run_dir) / self.max_steps)

    def finish(self, rc: int) -> None:
        end = time.time()
        attempt = {"start": self.started, "end": end, "rc": rc, "cpus": self.cpus, "commit": commit()}
        with open(self.run_dir / "attempts.jsonl", "a") as f:
            f.write(json.dumps(attempt) + "\n")
        if rc == 0 and _steps_done(self.run_dir) >= self.max_steps:
            wall = sum(a["end"] - a["start"] for a in read_jsonl(self.run_dir / "attempts.jsonl"))
            (self.run_dir / "done.json").write_text(json.dumps({"wall_time_s": wall, "finished": end}) + "\n")


def commit() -> str:
    """This checkout's git commit, noting uncommitted changes: recorded per attempt and in the report."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def prepare_run_dir(run: StudyRun, run_dir: Path) -> None:
    """Write DIR/<name>/study-run.yaml, or check that an existing folder was made for this config."""
    cfg_path = run_dir / "study-run.yaml"
    text = yaml.safe_dump(run.config, sort_keys=True)
    if cfg_path.is_file():
        if yaml.safe_load(cfg_path.read_text()) != yaml.safe_load(text):
            raise ValueError(
                f"run folder {run_dir} was made for another config (see its study-run.yaml): "
                "use another --out, or remove that folder"
            )
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(text)


def _prepare_study(study: Study, runs: list[StudyRun], out: Path) -> None:
    """The study folder: each run's folder (aliases have none), study.yaml, and this invocation
    appended to commands.jsonl (every invocation that ran runs here, for the report)."""
    out.mkdir(parents=True, exist_ok=True)
    for r in runs:
        if r.alias_of is None:
            prepare_run_dir(r, out / r.name)
    (out / "study.yaml").write_text(yaml.safe_dump(study.source, sort_keys=False))
    with open(out / "commands.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "command": command_line()}) + "\n")


def _progress_line(n_real: int, todo: list, running: dict, n_failed: int, done_here: float, elapsed: float) -> str:
    """The periodic progress line: runs done, the running ones' steps, and the ETA from the runs
    (fractions included) progressed since this invocation started (`done_here`)."""
    partial = sum(j.fraction() - j.steps_at_start / j.max_steps for j in running.values())
    finished = n_real - len(todo) - len(running)
    rate = (done_here + partial) / max(elapsed, 1e-9)
    remaining = len(todo) + sum(1 - j.fraction() for j in running.values())
    eta = _fmt_s(remaining / rate) if rate > 0 else "?"
    state = ", ".join(f"{j.run.name} {_steps_done(j.run_dir)}/{j.max_steps}" for j in running.values())
    return (
        f"[study] {finished}/{n_real} runs done ({n_failed} failed), running: {state or '-'}; "
        f"elapsed {_fmt_s(elapsed)}, ETA {eta}"
    )


def _stop_jobs(jobs: list) -> None:
    """SIGTERM every running job (its launcher stops trainer, workers and Redis in order), then wait
    for each; one still running after 60 s is killed with its process group."""
    for job in jobs:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGTERM)
    for job in jobs:
        try:
            job.finish(job.proc.wait(timeout=60))
        except subprocess.TimeoutExpired:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.finish(job.proc.wait())


def _start_jobs(todo: list, free: list, running: dict, out: Path, shares: list, log) -> None:
    """Start the next runs of `todo` on the free job slots."""
    while todo and free:
        slot = free.pop(0)
        r = todo.pop(0)
        state = run_state(out / r.name)
        running[slot] = _Job(r, out / r.name, shares[slot])
        log(f"[study] start {r.name} ({'resuming' if state == 'interrupted' else 'new'}) on cpus {shares[slot]}")


def _reap_jobs(running: dict, free: list, failed: list, log) -> tuple[int, float]:
    """Collect the jobs that exited (their slots freed, failures added to `failed`); returns how many
    exited and the runs they progressed in this invocation (fractions for resumed runs)."""
    exited, progressed = 0, 0.0
    for slot, job in list(running.items()):
        rc = job.proc.poll()
        if rc is None:
            continue
        job.finish(rc)
        del running[slot]
        free.append(slot)
        exited += 1
        ok = run_state(job.run_dir) == "done"
        progressed += 1 - job.steps_at_start / job.max_steps
        if not ok:
            failed.append(job.run.name)
        log(
            f"[study] {'finished' if ok else f'FAILED (exit {rc})'} {job.run.name} in "
            f"{_fmt_s(time.time() - job.started)}" + ("" if ok else f"; see {job.run_dir / 'launcher.log'}")
        )
    return exited, progressed


def run_study(
    study: Study, out: Path, *, jobs: int = 1, log=print, poll_s: float = 1.0, progress_s: float = 30.0
) -> int:
    """Run every unfinished run of `study` in `out`, `jobs` at a time (the report is study_report's).
    Returns 0 when every run finished, 1 when some failed, 130 when interrupted."""
    runs = study.expand()
    _prepare_study(study, runs, out)
    real = [r for r in runs if r.alias_of is None]
    todo = [r for r in real if run_state(out / r.name) != "done"]
    n_done0 = len(real) - len(todo)
    log(
        f"[study] {study.name}: {len(runs)} runs ({len(runs) - len(real)} aliases), {n_done0} already finished, "
        f"{len(todo)} to run, {jobs} at a time; folder {out}"
    )
    shares = cpu_shares(jobs)
    free = list(range(jobs))
    running: dict[int, _Job] = {}
    failed: list[str] = []
    t0 = last_progress = time.monotonic()
    done_here = 0.0  # runs (fractions included) progressed since this invocation started

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while todo or running:
            _start_jobs(todo, free, running, out, shares, log)
            time.sleep(poll_s)
            exited, progressed = _reap_jobs(running, free, failed, log)
            done_here += progressed
            if exited:
                last_progress = 0.0  # print progress now
            now = time.monotonic()
            if now - last_progress >= progress_s:
                last_progress = now
                log(_progress_line(len(real), todo, running, len(failed), done_here, now - t0))
    except KeyboardInterrupt:
        log(f"[study] interrupted: stopping {len(running)} run(s); re-run the same command to resume")
        _stop_jobs(list(running.values()))
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if failed:
        log(f"[study] failed: {', '.join(failed)} (see each run's launcher.log)")
    return 1 if failed else 0
