"""What `tandem run` checks before it starts a process or makes a folder, beyond the config's own
validation; each problem is a ValueError whose one line names the key, value, port or folder.

1. Ports: every listening port of the run, by its key (-1 = off: none). Worker i binds a fixed
   `rollout.*port` P at P + i; 0 is a free port the launcher picks below the kernel's ephemeral
   range (where no program's port 0 or outgoing connection lands between the pick and the
   service's bind). Two keys fixed to one port are refused, naming both; a fixed port another
   program holds is refused (bind test).
2. Memory: at least 16 bytes a parameter for the trainer (fp32 weights, gradients, two AdamW
   moments) and 4 for each rollout worker on the CPU (its dequantized fp32 weights), summed per
   device; more than that device's memory is refused with both figures.
3. Run folder: absent, empty, or holding `config.yaml` (a run's) or `study-run.yaml` (a study's).
4. Resume: every leaf key whose value differs from the folder's `config.yaml` (`redis_url` and
   `run_secret_file` left empty are the launcher's to fill: not a change). Only the ports,
   `trainer.max_steps` and `num_rollout_workers` change without `--accept-changes`.
5. Devices: `trainer.device` and `rollout.device` name a device this machine has.
"""

from __future__ import annotations

import errno
import os
import random
import socket
from pathlib import Path

from .config import RunConfig

TRAINER_PORTS = ("trainer.grpc_port", "trainer.metrics_port", "trainer.health.port")
WORKER_PORTS = ("rollout.metrics_port", "rollout.health.port")
RELAY_PORT = "rollout.relay_port"  # a worker's port too, where rollout.relay is on
RESUME_FREE = ("trainer.max_steps", "num_rollout_workers", *TRAINER_PORTS, *WORKER_PORTS, RELAY_PORT)
LAUNCHER_FILLED = ("redis_url", "run_secret_file")
RUN_FOLDER_MARKS = ("config.yaml", "study-run.yaml")


class _Unset:
    def __repr__(self) -> str:
        return "unset"


UNSET = _Unset()


def _get(cfg: RunConfig, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _address(cfg: RunConfig, key: str) -> tuple[str, int]:
    """(host, port) of a port key: the port and the address its section binds it on."""
    section, name = key.rsplit(".", 1)
    host = {"grpc_port": "grpc_host", "metrics_port": "metrics_host", "relay_port": "relay_host"}.get(name, "host")
    return _get(cfg, f"{section}.{host}"), _get(cfg, key)


def port_plan(cfg: RunConfig, workers: int) -> dict[str, dict[str, tuple[str, int]]]:
    """{service: {key: (host, port)}} of the run's listening ports (rule 1); port 0 = a free one."""
    plan = {"trainer": {k: _address(cfg, k) for k in TRAINER_PORTS if _get(cfg, k) >= 0}}
    worker_ports = (*WORKER_PORTS, RELAY_PORT) if cfg.rollout.relay else WORKER_PORTS
    for i in range(workers):
        fixed = {k: _address(cfg, k) for k in worker_ports if _get(cfg, k) >= 0}
        plan[f"w{i}"] = {k: (host, port + i if port else 0) for k, (host, port) in fixed.items()}
    seen: dict[int, str] = {}
    for service, ports in plan.items():
        for key, (_, port) in ports.items():
            where = _what(service, key, port)
            if port and port in seen:
                raise ValueError(f"{seen[port]} and {where}: one port for two servers")
            seen.setdefault(port, where)
    return plan


def bind_ports(plan: dict[str, dict[str, tuple[str, int]]]) -> dict[str, dict[str, tuple[str, int]]]:
    """`plan` with every fixed port checked free (bind test) and every 0 replaced by a free port."""
    taken = {port for ports in plan.values() for _, port in ports.values() if port}
    out = {}
    for service, ports in plan.items():
        out[service] = {}
        for key, (host, port) in ports.items():
            what = _what(service, key, port)
            bound = _bind_test(host, port, what) if port else _pick_port(host, what, taken)
            taken.add(bound)
            out[service][key] = (host, bound)
    return out


def _what(service: str, key: str, port: int) -> str:
    """How a port is named in a refusal: its key and value (and a worker's own port)."""
    index = 0 if service == "trainer" else int(service[1:])
    if not port:
        return key
    return f"{key}={port - index} ({service}'s port {port})" if index else f"{key}={port}"


PICK_FROM = 10000  # the lowest port the launcher picks for 0 (rule 1)


def _below_ephemeral() -> range:
    """Ports from PICK_FROM up to the kernel's ephemeral range (empty where it starts lower)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return range(PICK_FROM, low)


def _pick_port(host: str, what: str, taken: set[int]) -> int:
    """A free port on `host` below the ephemeral range and not in `taken` (rule 1); the kernel's
    choice if none is found."""
    free = [p for p in _below_ephemeral() if p not in taken]
    for port in random.sample(free, min(50, len(free))):
        try:
            return _bind_test(host, port, what)
        except ValueError:
            continue
    return _bind_test(host, 0, what)


def _bind_test(host: str, port: int, what: str) -> int:
    """The port bound on `host` (the kernel's choice for 0), released again; ValueError naming `what`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no owner
        try:
            s.bind((host, port))
        except OSError as e:
            held = " (another program listens there)" if e.errno == errno.EADDRINUSE else ""
            raise ValueError(f"{what}: cannot bind {host}:{port}: {e.strerror or e}{held}") from None
        return int(s.getsockname()[1])


def check_ports(cfg: RunConfig, service: str) -> None:
    """A service about to start: its fixed ports free (rule 1), else the key and port in one line."""
    keys = TRAINER_PORTS if service == "trainer" else WORKER_PORTS
    for key in keys:
        host, port = _address(cfg, key)
        if port > 0:
            _bind_test(host, port, f"{key}={port}")


def memory_needed(n_params: int, cfg: RunConfig, workers: int) -> dict[str, int]:
    """{device: at least these bytes} of parameter memory for the run (rule 2)."""
    need = {_device(cfg.trainer.device): 16 * n_params}
    if cfg.rollout.device == "cpu":
        need["cpu"] = need.get("cpu", 0) + 4 * n_params * workers
    return need


def _device(name: str) -> str:
    return "cuda:0" if name == "cuda" else name


def device_memory(device: str) -> int | None:
    """Bytes of memory of `device` ("cpu": this machine's RAM), or None where it cannot be known."""
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    if not torch.cuda.is_available():
        return None  # refused elsewhere (trainer.device / rollout.device without CUDA)
    return int(torch.cuda.get_device_properties(int(device.partition(":")[2] or 0)).total_memory)


def check_memory(cfg: RunConfig, n_params: int, workers: int, capacity=device_memory) -> None:
    """Rule 2: ValueError with the figures when the model cannot fit."""
    for device, need in memory_needed(n_params, cfg, workers).items():
        have = capacity(device)
        if have is not None and need > have:
            m = cfg.model
            model = f"model.checkpoint={m.checkpoint!r}" if m.checkpoint else f"model.preset={m.preset or 'tiny'!r}"
            model += f", model.overrides={m.overrides}" if m.overrides else ""
            raise ValueError(
                f"{model}: {n_params / 1e9:,.1f}B parameters need at least {_gb(need)} on {device} "
                f"(trainer 16 B a parameter, each CPU rollout worker 4), which has {_gb(have)}"
            )


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def check_devices(cfg: RunConfig) -> None:
    """trainer.device and rollout.device name a device this machine has."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for key, spec in (("trainer.device", cfg.trainer.device), ("rollout.device", cfg.rollout.device)):
        index = int(spec.partition(":")[2] or 0)
        if spec.startswith("cuda") and index >= count:
            have = f"only {count} CUDA device(s)" if count else "no CUDA device is available"
            raise ValueError(f"{key}={spec!r}: {have} here")


def check_workers(cfg: RunConfig) -> None:
    if cfg.num_rollout_workers < 1:
        raise ValueError(
            f"num_rollout_workers={cfg.num_rollout_workers}: `tandem run` needs at least 1 rollout worker "
            "(without one the trainer waits for trajectories forever)"
        )


def check_run_folder(path: Path) -> bool:
    """Rule 3: True for a run folder to resume, False for a new or empty one; else ValueError."""
    if not path.exists():
        return False
    if not path.is_dir():
        raise ValueError(f"--run-dir {path}: not a folder")
    if any((path / mark).is_file() for mark in RUN_FOLDER_MARKS):
        return (path / "config.yaml").is_file()
    entries = sorted(p.name for p in path.iterdir())
    if entries:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise ValueError(
            f"--run-dir {path}: not empty ({shown}) and not a run folder (no config.yaml): "
            "name a new or empty folder, or a run folder to resume"
        )
    return False


def changes(old: RunConfig, new: RunConfig) -> list[tuple[str, object, object]]:
    """Rule 4: (key, old value, new value) of every leaf key that differs, sorted by key."""
    a, b = _flat(old.to_dict()), _flat(new.to_dict())
    out = []
    for key in sorted(set(a) | set(b)):
        if key in LAUNCHER_FILLED and b.get(key) == "":
            continue
        if a.get(key, UNSET) != b.get(key, UNSET):
            out.append((key, a.get(key, UNSET), b.get(key, UNSET)))
    return out


def needs_acceptance(diff: list[tuple[str, object, object]]) -> list[tuple[str, object, object]]:
    """The changes that `--accept-changes` must allow (rule 4)."""
    return [d for d in diff if d[0] not in RESUME_FREE]


def describe(diff: list[tuple[str, object, object]]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):  # a section, or a mapping value (model.overrides): its keys
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out
