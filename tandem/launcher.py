"""`tandem run`: one machine, separate processes: a private redis-server (unless the config
names a Redis URL), the trainer and N rollout workers, exactly the services Kubernetes runs.

The launcher checks the config completely (recipe, model, files, Redis reachable, and what
tandem.preflight checks: ports, memory, the run folder, a resume's changes) before it starts
anything, writes the run folder (mode 0700, files 0600: config.yaml resolved with secrets masked,
ports.json, logs/ with trainer.log and one log per worker, and what the trainer writes:
metrics.jsonl, checkpoints/, plots), passes each service its ports, shows the trainer's progress
on the console, and on Ctrl-C or when the trainer finishes (or a worker cannot start: exit 2)
stops the trainer, then the rollouts with SIGTERM (they drain), then Redis.
Every child runs in its own process session, so a terminal's Ctrl-C reaches the launcher alone.
The private Redis keeps an append-only file in `redis/`: `--run-dir` resumes against the same
streams and prompt sequence.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from broker.local_redis import LocalRedis, LocalRedisConfig
from broker.signing import SECRET_ENV, write_secret_file

from . import config as run_config
from . import env_config, preflight, services
from .plots import write_plots


def _spawn(args: list[str], log: Path, env: dict, *, console: bool = False) -> subprocess.Popen:
    """A child in a new session: Ctrl-C reaches only the launcher, which then stops children in
    order. Output goes to `log`; with `console`, to the console as well (a thread copies it)."""
    out = open(log, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", *args],
        stdout=subprocess.PIPE if console else out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    if console:
        proc.tee = threading.Thread(target=_tee, args=(proc.stdout, out), daemon=True)
        proc.tee.start()
    else:
        out.close()
    return proc


def _tee(src, log) -> None:
    with src, log:
        for line in iter(src.readline, b""):
            log.write(line)
            log.flush()
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


def _stop(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def check_redis(url: str, timeout_s: float = 3.0) -> None:
    """ValueError "cannot reach Redis at URL: reason" unless `url` answers PING within `timeout_s`."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
    except redis.exceptions.AuthenticationError as e:
        raise ValueError(f"cannot reach Redis at {env_config.redact_url(url)}: authentication failed ({e})") from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
        text = str(e).lower()
        reason = "connection refused" if "refused" in text else str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"cannot reach Redis at {env_config.redact_url(url)}: {reason}") from None
    except redis.exceptions.ResponseError as e:  # e.g. NOAUTH: a password is needed
        raise ValueError(f"cannot reach Redis at {env_config.redact_url(url)}: {e}") from None
    finally:
        client.close()


CANNOT_START = 2  # what `tandem trainer` / `tandem rollout` exit with for a config or port they refuse


def _changes_on_resume(run_dir: Path, cfg: run_config.RunConfig, accept: bool) -> list:
    """What the resume changes against the folder's config.yaml; ValueError listing them unless accepted."""
    try:
        before = run_config.load(run_dir / "config.yaml")
    except ValueError as e:
        raise ValueError(f"--run-dir {run_dir}: its config.yaml cannot be compared with this run's: {e}") from None
    diff = preflight.changes(before, cfg)
    refused = preflight.needs_acceptance(diff)
    if refused and not accept:
        raise ValueError(
            f"--run-dir {run_dir} was run with other settings: {preflight.describe(refused)}; "
            "pass --accept-changes to resume with them (the previous config.yaml is kept in config-history/)"
        )
    return diff


def _keep_previous_config(run_dir: Path, diff: list) -> None:
    history = run_dir / "config-history"
    history.mkdir(exist_ok=True)
    kept = history / f"config-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    kept.write_bytes((run_dir / "config.yaml").read_bytes())
    print(f"[tandem] resuming with changes: {preflight.describe(diff)} (the previous config: {kept})")


def _env_overrides() -> list[str]:
    """What the services will read from this environment (TLS paths, hosts, ...), so that it is checked
    here first; Redis is the launcher's to choose (its children get the URL it picks)."""
    redis = ("TANDEM_REDIS_URL", *env_config.REDIS_URL_PARTS)
    return env_config.env_overrides({k: v for k, v in os.environ.items() if k not in redis})


def _port_overrides(ports: dict[str, tuple[str, int]]) -> list[str]:
    return [f"{key}={port}" for key, (_, port) in ports.items()]


def _write_ports(run_dir: Path, ports: dict, redis_url: str) -> None:
    """ports.json: {service: {key: "host:port"}} and the Redis URL (password masked); printed once."""
    table = {service: {k: f"{h}:{p}" for k, (h, p) in keys.items()} for service, keys in ports.items()}
    (run_dir / "ports.json").write_text(json.dumps({**table, "redis": env_config.redact_url(redis_url)}, indent=1))
    shown = "; ".join(
        f"{s} " + ", ".join(f"{k.split('.', 1)[1]} {a}" for k, a in keys.items()) for s, keys in table.items()
    )
    print(f"[tandem] ports: {shown} (in {run_dir / 'ports.json'})")


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    return lines[-1] if lines else f"no output (see {log})"


def _checked_plan(config_path, run_dir, overrides, accept_changes):
    """(config, run folder, changes on resume, bound ports): everything that can be wrong with the
    config fails here, before any process or folder exists."""
    cfg = run_config.load(config_path, _env_overrides() + overrides)
    model_config = services.check(cfg)
    preflight.check_workers(cfg)
    preflight.check_devices(cfg)
    preflight.check_memory(cfg, model_config.num_parameters(), cfg.num_rollout_workers)
    run_dir = Path(run_dir or Path("runs") / f"{cfg.run_id}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    resuming = preflight.check_run_folder(run_dir)
    changed = _changes_on_resume(run_dir, cfg, accept_changes) if resuming else []
    ports = preflight.bind_ports(preflight.port_plan(cfg, cfg.num_rollout_workers))
    if cfg.redis_url:
        check_redis(cfg.redis_url)
    return cfg, run_dir, changed, ports


def _make_run_folder(run_dir: Path, changed: list) -> None:
    """Signals that stop the run in order, the private run folder, the previous config kept on changes."""
    # Ctrl-C and SIGTERM both stop the run in order (explicitly: a shell may have started us
    # with SIGINT ignored, as it does for background jobs).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    os.umask(0o077)  # the run folder is the user's alone: 0700 folders, 0600 files (children inherit)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)  # also a folder made by an older version
    if changed:
        _keep_previous_config(run_dir, changed)


def _with_secret(cfg: run_config.RunConfig, run_dir: Path) -> run_config.RunConfig:
    """The run's secret file: the configured one, the environment's, or run.secret in the folder."""
    if cfg.run_secret_file or os.environ.get(SECRET_ENV):
        return cfg
    secret = run_dir / "run.secret"  # kept on resume: the run's samples stay verifiable
    return dataclasses.replace(cfg, run_secret_file=str(secret if secret.exists() else write_secret_file(secret)))


def _child_env(redis_url: str) -> dict:
    """The services' environment. One BLAS thread per process: trainer and workers share the cores,
    and oversubscribed torch threads are several times slower than one each. The Redis URL (with any
    password) travels in the environment, not in the file."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_REDIS_URL": redis_url}
    for name in env_config.REDIS_URL_PARTS:  # already in the URL
        env.pop(name, None)
    return env


def _spawn_workers(cfg, resolved: Path, ports: dict, logs: Path, env: dict) -> list:
    return [
        _spawn(
            ["rollout", "--config", str(resolved), "--worker-id", f"w{i}", *_port_overrides(ports[f"w{i}"])],
            logs / f"rollout-w{i}.log",
            env,
        )
        for i in range(cfg.num_rollout_workers)
    ]


def _supervise(trainer, workers: list, logs: Path) -> int:
    """Wait for the trainer's exit code; stop it when no worker could start or every worker exited."""
    while True:
        rc = trainer.poll()
        if rc is not None:
            return rc
        unstarted = [i for i, w in enumerate(workers) if w.poll() == CANNOT_START]
        if unstarted:  # a port taken since the check, a file gone: the run cannot be what was asked
            log = logs / f"rollout-w{unstarted[0]}.log"
            print(f"[tandem] rollout worker w{unstarted[0]} could not start: {_last_line(log)}", file=sys.stderr)
            _stop([trainer])
            return CANNOT_START
        dead = [i for i, w in enumerate(workers) if w.poll() is not None]
        if dead and len(dead) == len(workers):
            print(f"[tandem] every rollout worker exited; see {logs}", file=sys.stderr)
            _stop([trainer])
            outage = {w.returncode for w in workers} == {services.REDIS_OUTAGE_EXIT}
            return services.REDIS_OUTAGE_EXIT if outage else 1
        time.sleep(0.5)


def run(config_path: str | None, run_dir: str | None, overrides: list[str], *, accept_changes: bool = False) -> int:
    cfg, run_dir, changed, ports = _checked_plan(config_path, run_dir, overrides, accept_changes)
    _make_run_folder(run_dir, changed)
    redis, trainer, workers, rc = None, None, [], 1
    logs = run_dir / "logs"
    try:
        if not cfg.redis_url:
            redis = LocalRedis(LocalRedisConfig(workdir=run_dir / "redis", appendonly=True))
            cfg = dataclasses.replace(cfg, redis_url=redis.start())
            print(f"[tandem] private redis-server at {cfg.redis_url} (append-only file in {run_dir / 'redis'})")
        cfg = _with_secret(cfg, run_dir)
        resolved = run_dir / "config.yaml"
        resolved.write_text(run_config.dump(cfg))  # the Redis password masked: the services get it below
        print(f"[tandem] run folder {run_dir}")
        env = _child_env(cfg.redis_url)
        _write_ports(run_dir, ports, cfg.redis_url)
        trainer_argv = ["trainer", "--config", str(resolved), "--run-dir", str(run_dir)]
        trainer = _spawn([*trainer_argv, *_port_overrides(ports["trainer"])], logs / "trainer.log", env, console=True)
        workers = _spawn_workers(cfg, resolved, ports, logs, env)
        rc = _supervise(trainer, workers, logs)
        if rc == services.REDIS_OUTAGE_EXIT:
            print(
                f"[tandem] giving up: Redis at {env_config.redact_url(cfg.redis_url)} unreachable for more than "
                f"redis_outage_s={cfg.redis_outage_s:g}s; --run-dir {run_dir} resumes the run",
                file=sys.stderr,
            )
    except KeyboardInterrupt:
        print("\n[tandem] Ctrl-C: stopping the trainer, then the rollout workers, then Redis", file=sys.stderr)
        try:
            if trainer is not None:
                _stop([trainer])
        except KeyboardInterrupt:  # a second Ctrl-C: stop now
            trainer.kill()
        rc = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rest is short: let it finish
        _stop(workers)
        if redis is not None:
            redis.stop()  # last: the trainer and the workers commit to it while they stop
    return _finish(trainer, run_dir, rc)


def _finish(trainer, run_dir: Path, rc: int) -> int:
    """The trainer's last lines, the plots, one summary line; rc passed through."""
    if trainer is not None:
        trainer.tee.join(timeout=5)
    plots = write_plots(run_dir)
    print(
        f"[tandem] trainer exited with {rc}; plots: {', '.join(p.name for p in plots) or 'none'}; "
        f"metrics: {run_dir / 'metrics.jsonl'}; logs: {run_dir / 'logs'}"
    )
    return rc
