"""Every command README.md and docs/running.md show works as shown.

Each command in their `bash` blocks and each inline `tandem ...`, `make ...`, `pip ...` span is
either run here in its cheap, side-effect-free form (RUN: `--help`, `--explain`, `plan`,
`formats`, `probe` on the tiny model, `inspect` of a written manifest, `import-hf` of a tiny
checkpoint, `study --report-only` on an empty folder, the one-line error forms) or listed in SKIPPED_BY_DESIGN with the reason; a command in neither fails the test, so a
new one must be classified. Every path, make target, pip extra, config key and override the docs
name exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem import config
from tandem.cli import COMMANDS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/running.md")
PREFIXES = ("tandem ", "tandem:", "make ", "pip ", "python3 ", "bash ")


def write_manifest(folder: Path) -> None:
    """folder/manifest.pb: version 3 of the demo model under nvfp4_moe, as a trainer publishes it."""
    from policy import manifest as mf
    from policy.contract import contract_from_recipe
    from policy.formats.params import quantize_params
    from policy.model import ModelConfig, Transformer
    from policy.recipe import Recipe

    cfg, recipe = ModelConfig.preset("demo"), Recipe.load("nvfp4_moe")
    tensors = quantize_params(dict(Transformer(cfg, seed=0).named_parameters()), recipe.plan(cfg))
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)
    built = mf.build_manifest(version=3, parent_version=2, contract=contract, tensors=tensors)
    mf.write_manifest(folder / "manifest.pb", built.manifest)


def write_hf_model(folder: Path) -> None:
    """folder/hf: a tiny Hugging Face Qwen3-MoE checkpoint."""
    import transformers

    c = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(c).save_pretrained(folder / "hf")


@dataclass(frozen=True, kw_only=True)
class Form:
    """One cheap invocation: `tandem ARGS` from the repository root ({tmp} in an argument: an empty
    folder, into which `setup` first writes the inputs), its exit status and what its output names
    (stdout when it succeeds; the one stderr line when it exits 2)."""

    args: tuple[str, ...]
    rc: int = 0
    names: tuple[str, ...] = ()
    setup: Callable[[Path], None] | None = None


def helps(sub: str, *names: str) -> Form:
    return Form(args=(sub, "--help"), names=(f"usage: tandem {sub}", *names))


FORMS = {
    "run --help": helps("run", "--run-dir", "--explain", "--accept-changes", "key=value"),
    "trainer --help": helps("trainer", "--config", "--run-dir"),
    "rollout --help": helps("rollout", "--config", "--worker-id"),
    "formats --help": helps("formats"),
    "plan --help": helps("plan", "--model", "--json"),
    "probe --help": helps("probe", "--recipe", "--run-dir", "--version"),
    "inspect --help": helps("inspect", "target"),
    "import-hf --help": helps("import-hf", "--recipe"),
    "export --help": helps("export", "--version", "--out", "hf", "compressed-tensors", "fp8-block", "nvfp4"),
    "study --help": helps("study", "--out", "--jobs", "--report-only"),
    "explain key": Form(args=("run", "--explain", "trainer.max_steps"), names=("trainer.max_steps (int",)),
    "explain section": Form(
        args=("run", "--explain", "trainer.tls"), names=("trainer.tls.cert", "trainer.tls.key", "trainer.tls.client_ca")
    ),
    "explain with a config": Form(
        args=("run", "configs/demo.yaml", "--explain", "loop"), names=("loop.max_staleness", "loop.seed")
    ),
    "bad override": Form(
        args=("run", "configs/demo.yaml", "trainer.max_steps=true"),
        rc=2,
        names=("tandem run: config trainer.max_steps: expected int, got True",),
    ),
    "bad override, no file": Form(
        args=("run", "trainer.max_steps=true"), rc=2, names=("tandem run: config trainer.max_steps: expected int",)
    ),
    "trainer without a config": Form(args=("trainer",), rc=2, names=("--config FILE or set TANDEM_CONFIG",)),
    "rollout without a config": Form(args=("rollout",), rc=2, names=("--config FILE or set TANDEM_CONFIG",)),
    "formats": Form(
        args=("formats", "--rows", "128", "--cols", "128", "--repeats", "1"),
        names=("bits/value", "rel error", "MB/s", "bf16", "fp8_block", "mxfp8", "nvfp4", "int4"),
    ),
    "plan": Form(
        args=("plan", "nvfp4_moe", "--model", "qwen3-30b-a3b"),
        names=("recipe nvfp4_moe", "qwen3-30b-a3b", "nvfp4/tensor", "bf16", "activation sites"),
    ),
    "plan --json": Form(
        args=("plan", "nvfp4_moe", "--model", "qwen3-30b-a3b", "--json"),
        names=('"recipe": "nvfp4_moe"', '"parameters"', '"activations"', '"summary"'),
    ),
    "probe": Form(
        args=("probe", "--recipe", "nvfp4_moe", "--batch", "2", "--seq-len", "16"),
        names=("bf16~qat", "bf16~packed", "qat~packed", "bitwise equal: True"),
    ),
    "probe a missing run": Form(args=("probe", "--run-dir", "runs/no-such-run"), rc=2, names=("runs/no-such-run",)),
    "inspect": Form(
        args=("inspect", "{tmp}/manifest.pb", "--tensors", "3"),
        setup=write_manifest,
        names=("policy version 3 (parent 2)", "contract fingerprint", "recipe                nvfp4_moe", "more"),
    ),
    "import-hf": Form(
        args=("import-hf", "{tmp}/hf", "--recipe", "nvfp4_moe"),
        setup=write_hf_model,
        names=("recipe nvfp4_moe", "nvfp4/tensor", "on disk:"),
    ),
    "inspect a missing file": Form(args=("inspect", "no-such-manifest.json"), rc=2, names=("no-such-manifest.json",)),
    "import-hf a missing folder": Form(
        args=("import-hf", "no-such-model", "--recipe", "nvfp4_moe"), rc=2, names=("no-such-model",)
    ),
    "export a missing run": Form(
        args=("export", "runs/no-such-run", "--format", "hf", "--out", "no-such-out"), rc=2, names=("runs/no-such-run",)
    ),
    "study report of nothing": Form(
        args=("study", "configs/study/ablations.yaml", "--report-only", "--out", "{tmp}"), names=("report.md",)
    ),
}

# A docs command -> the FORMS run for it.
RUN = {
    "tandem run configs/demo.yaml [--run-dir DIR] [key=value ...]": ("run --help", "bad override"),
    "tandem run --explain KEY": ("explain key", "explain section"),
    "tandem run --explain trainer.tls": ("explain section",),
    "tandem run": ("run --help", "explain with a config"),
    "tandem run key=value ...": ("bad override, no file",),
    "tandem run: config trainer.max_steps: expected int, got True": ("bad override",),
    "tandem trainer --config FILE [--run-dir DIR]": ("trainer --help", "trainer without a config"),
    "tandem trainer": ("trainer --help",),
    "tandem rollout --config FILE [--worker-id ID]": ("rollout --help", "rollout without a config"),
    "tandem rollout": ("rollout --help",),
    "tandem formats": ("formats --help", "formats"),
    "tandem plan nvfp4_moe --model qwen3-30b-a3b [--json]": ("plan --help", "plan", "plan --json"),
    "tandem plan": ("plan --help", "plan"),
    "tandem probe --recipe nvfp4_moe": ("probe --help", "probe"),
    "tandem probe --run-dir runs/demo-… [--version V]": ("probe --help", "probe a missing run"),
    "tandem inspect ADDRESS|FILE": ("inspect --help", "inspect", "inspect a missing file"),
    "tandem import-hf DIR --recipe R": ("import-hf --help", "import-hf", "import-hf a missing folder"),
    "tandem export RUN_DIR|ADDRESS [--version V] --format FMT --out DIR": ("export --help", "export a missing run"),
    "tandem export": ("export --help",),
    "tandem study configs/study/ablations.yaml [--out DIR] [--jobs N] [key=value ...]": (
        "study --help",
        "study report of nothing",
    ),
    "tandem study CONFIG": ("study --help",),
}

# A docs command -> why it is not run here (its paths, targets and config are still checked below).
SKIPPED_BY_DESIGN = {
    "make demo": "installs .venv and runs the whole demo (minutes); `make -n demo` is checked",
    "make test": "installs .venv and runs the whole suite; `make -n test` is checked",
    "make test-fast": "installs .venv and runs the unit tests; `make -n test-fast` is checked",
    "make lint": "installs .venv; `make -n lint` is checked",
    "tandem run configs/demo.yaml": "the whole demo run (minutes); its config loads below",
    "tandem run configs/demo.yaml loop.seed=S": "a whole demo run per seed; loop.seed is a key checked below",
    "tandem run configs/demo.yaml --run-dir runs/demo-…": "resumes a whole demo run; test_launcher.py runs and resumes a short one",
    "tandem run configs/gpu-h200.yaml": "the whole loop on an H200; its config loads below",
    "pip install -e '.[gpu]'": "installs packages (Triton); the extra is checked in pyproject.toml",
    "python3 bench/make_e2e_model.py --config configs/gpu-h200.yaml": "writes a 4.36B-parameter fixture for the GPU",
    "bash bench/run_e2e_device.sh": "GPU runs on the device machine",
    "bash bench/run_study_device.sh": "a study on the device machine; its config expands in test_study.py",
}

# Backticked dotted names that are no config keys.
NOT_CONFIG_KEYS = {"rollout.engine.generate": "a Python function", "trainer.log": "the trainer's log file"}
# Overrides the docs show as refused.
BAD_OVERRIDES = {"trainer.max_steps=true"}


def doc_text(doc: str) -> str:
    return (ROOT / doc).read_text()


def prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def spans(text: str) -> list[str]:
    """Backticked spans outside code blocks, whitespace collapsed (a span may break across lines)."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose(text))]


def documented_commands(text: str) -> list[str]:
    """The lines of `bash` blocks (comments cut) and the inline command spans, in order, once each."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        found += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    found += [s for s in spans(text) if s.startswith(PREFIXES) or s == "tandem run"]
    return list(dict.fromkeys(found))


ALL_COMMANDS = list(dict.fromkeys(c for doc in DOCS for c in documented_commands(doc_text(doc))))


def tandem(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TANDEM_CONFIG": ""},
        timeout=timeout,
    )


def test_every_documented_command_is_run_or_skipped_by_design():
    unclassified = [c for c in ALL_COMMANDS if c not in RUN and c not in SKIPPED_BY_DESIGN]
    assert not unclassified, f"classify these docs commands in RUN or SKIPPED_BY_DESIGN: {unclassified}"
    stale = [c for c in [*RUN, *SKIPPED_BY_DESIGN] if c not in ALL_COMMANDS]
    assert not stale, f"no longer in the docs: {stale}"
    assert not set(RUN) & set(SKIPPED_BY_DESIGN)
    assert {f for forms in RUN.values() for f in forms} == set(FORMS), "every form runs for a docs command"


def test_every_subcommand_is_in_the_docs_and_has_its_help_run():
    subs = {c.split()[1].rstrip(":") for c in ALL_COMMANDS if c.startswith("tandem ")}
    assert subs == set(COMMANDS), "the docs name every `tandem` subcommand and no other"
    run = {f for c in ALL_COMMANDS if c in RUN for f in RUN[c]}
    assert {f"{s} --help" for s in subs} <= run


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORMS))
def test_form(name, tmp_path):
    form = FORMS[name]
    if form.setup is not None:
        form.setup(tmp_path)
    res = tandem(*(a.replace("{tmp}", str(tmp_path)) for a in form.args))
    out = res.stdout + res.stderr
    assert res.returncode == form.rc, (res.returncode, out[-3000:])
    assert "Traceback" not in out
    if form.rc == 2:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and res.stdout == "", out
        shown = lines[0]
    else:
        shown = res.stdout
    for needle in form.names:
        assert needle in shown, (needle, shown[-3000:])


def repo_paths(doc: str) -> list[tuple[str, str]]:
    """(as written, repo-relative path) of every repo path in a backticked span or a command, and of
    every relative link (relative to the doc's folder)."""
    text, base = doc_text(doc), Path(doc).parent
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = "|".join(re.escape(d) for d in {p.split("/")[0] for p in tracked.split() if "/" in p})
    words = " ".join(spans(text) + documented_commands(text)).replace(":", " ").split()
    found = [(w, w) for w in words if re.fullmatch(rf"({top})/[\w./#-]*", w)]
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"^[a-z]+:", link):
            found.append((link, os.path.normpath(base / link)))
    return found


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_named_exists(doc):
    paths = repo_paths(doc)
    assert len(paths) > 5
    for written, path in paths:
        file, _, anchor = path.partition("#")
        assert (ROOT / file).exists(), f"{doc} names {written!r}: {file} is not in the repository"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / file).read_text(), flags=re.M)
            assert anchor in {slug(h) for h in headings}, f"{doc} links {written!r}: no such heading"


def test_every_name_in_the_readme_layout_exists():
    layout = re.search(r"## Layout\n\n```\n(.*?)```", doc_text("README.md"), flags=re.S).group(1)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = {Path(p).name for p in tracked}
    dirs = {part for p in tracked for part in Path(p).parts[:-1]}
    names = re.findall(r"(?<![\w.])([\w-]+\.(?:py|sh|md|yaml|proto)|[\w-]+/)", layout)
    assert len(names) > 50
    missing = [n for n in names if (n.rstrip("/") not in dirs if n.endswith("/") else n not in files)]
    assert not missing, f"README's Layout names what the repository lacks: {missing}"


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_every_make_target_named_exists():
    named = set()
    for doc in DOCS:
        named |= set(re.findall(r"`make ([\w-]+)`", doc_text(doc)))
        named |= {c.split()[1] for c in documented_commands(doc_text(doc)) if c.startswith("make ")}
    assert {"demo", "test", "test-fast", "lint", "protos"} <= named
    assert named <= make_targets(), named - make_targets()


@pytest.mark.parametrize(
    "target,runs",
    [
        ("demo", ["tandem run configs/demo.yaml"]),
        ("test", ["ruff check .", "ruff format --check .", "pytest -q"]),
        ("test-fast", ["pytest tests/unit", '-m "not slow"']),
        ("lint", ["ruff check .", "ruff format --check ."]),
    ],
)
def test_make_targets_run_what_the_readme_says(target, runs):
    res = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for cmd in runs:
        assert cmd in res.stdout, (cmd, res.stdout)


def test_make_venv_installs_the_torch_the_readme_names():
    torch = re.search(r"install `(torch==[\d.]+)`", doc_text("README.md")).group(1)
    res = subprocess.run(["make", "-n", "-B", "venv"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert torch in res.stdout and '-e ".[dev]"' in res.stdout, res.stdout


def test_the_pip_extras_named_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set(re.findall(r"\.\[(\w+)\]", doc_text("README.md") + (ROOT / "Makefile").read_text()))
    assert {"gpu", "dev"} <= named <= set(extras)


SECTIONS = "loop|trainer|rollout|model|task|logging"


def keys_shown(text: str) -> list[str]:
    """Backticked dotted config keys (`trainer.publish_every`), and those set to a placeholder
    (`loop.seed=S`)."""
    words = " ".join(spans(text)).split()
    keys = [s for s in spans(text) if re.fullmatch(rf"({SECTIONS})\.[a-z_.]+", s)]
    keys += [w.split("=")[0] for w in words if re.fullmatch(rf"({SECTIONS})\.[a-z_.]+=[A-Z]+", w)]
    return [k for k in keys if k not in NOT_CONFIG_KEYS]


def overrides_shown(text: str) -> list[str]:
    """`a.b=v` in spans and bash blocks (comments too) and `a.b: v` spans, as overrides; values in
    capitals (`loop.seed=S`) are placeholders."""
    blocks = " ".join(re.findall(r"```bash\n(.*?)```", text, flags=re.S))
    words = " ".join(spans(text)).split() + blocks.split()
    shown = [w for w in words if re.fullmatch(rf"({SECTIONS})\.[a-z_.]+=[^A-Z\s]+", w)]
    pairs = [re.fullmatch(rf"((?:{SECTIONS})\.[a-z_.]+): ([^A-Z\s]+)", s) for s in spans(text)]
    return shown + [f"{m.group(1)}={m.group(2)}" for m in pairs if m]


@pytest.mark.parametrize("doc", DOCS)
def test_every_config_key_and_override_named_is_valid(doc):
    keys, overrides = keys_shown(doc_text(doc)), overrides_shown(doc_text(doc))
    assert keys and overrides
    for key in keys:
        config.explain(key)  # raises ValueError naming an unknown key
    for item in overrides:
        if item in BAD_OVERRIDES:
            with pytest.raises(ValueError, match=item.split("=")[0]):
                config.load("configs/demo.yaml", [item])
        else:
            config.load("configs/demo.yaml", [item])


def test_every_config_file_named_loads():
    named = {p for doc in DOCS for _, p in repo_paths(doc) if re.fullmatch(r"configs/[\w-]+\.yaml", p)}
    assert {"configs/demo.yaml", "configs/arith_jsonl.yaml", "configs/gpu-h200.yaml"} <= named
    for path in named:
        config.load(ROOT / path)


def test_ci_runs_make_test():
    assert "`.ci/run` runs `make test`" in " ".join(doc_text("README.md").split())
    assert re.search(r"^make test\b", (ROOT / ".ci/run").read_text(), flags=re.M)
