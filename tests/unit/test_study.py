"""`tandem study` pieces without running anything: study configs, grid expansion, the statistics of
the report (hand-checked), CPU shares, and the `rollout_recipe` ablation knob's wiring."""

from __future__ import annotations

import math

import pytest
import yaml

from tandem import config as run_config
from tandem import services
from tandem.study import cpu_shares, grid_run_name, load_study, study_run_id
from tandem.study_report import grad_norm_spikes, head_tail_means, moving_average, t_interval

TINY = {"n_layers": 2, "dim": 64, "n_experts": 4, "expert_ffn_dim": 64, "shared_expert_ffn_dim": 64}


def _study(tmp_path, body: dict, name="s.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(body, sort_keys=False))
    return p


def test_grid_expands_in_order_with_names_then_named_runs(tmp_path):
    p = _study(
        tmp_path,
        {
            "base": "demo.yaml",
            "set": {"trainer": {"max_steps": 7}},
            "grid": {"recipe": ["bf16", "int4_qat"], "trainer.backward": ["hp", "dequant"]},
            "runs": {"knob": {"recipe": "int4_qat", "rollout_recipe": "bf16"}},
        },
    )
    runs = load_study(p).expand()
    assert [r.name for r in runs] == [
        "recipe-bf16__backward-hp",
        "recipe-bf16__backward-dequant",
        "recipe-int4_qat__backward-hp",
        "recipe-int4_qat__backward-dequant",
        "knob",
    ]
    assert runs[1].config["trainer"] == {**runs[1].config["trainer"], "backward": "dequant", "max_steps": 7}
    assert runs[1].config["loop"]["max_staleness"] == 2  # from configs/demo.yaml
    assert runs[4].keys == {"recipe": "int4_qat", "rollout_recipe": "bf16"} and runs[4].named
    # The knob run is no alias; nothing else is equal either.
    assert [r.alias_of for r in runs] == [None] * 5


def test_equal_resolved_configs_run_once(tmp_path):
    p = _study(tmp_path, {"grid": {"loop.max_staleness": [1, 2]}, "runs": {"same": {"loop": {"max_staleness": 2}}}})
    runs = load_study(p).expand()
    assert runs[-1].alias_of == "max_staleness-2"


def test_overrides_of_the_study(tmp_path):
    p = _study(
        tmp_path,
        {"grid": {"loop.seed": [0, 1, 2], "recipe": ["bf16"]}, "runs": {"a": {"loop.seed": 5}, "b": {"loop.seed": 6}}},
    )
    s = load_study(p, ["grid.loop.seed=[0]", "runs=[b]", "trainer.max_steps=3"])
    assert s.grid == {"loop.seed": [0], "recipe": ["bf16"]} and list(s.runs) == ["b"]
    assert [r.config["trainer"]["max_steps"] for r in s.expand()] == [3, 3]
    with pytest.raises(ValueError, match="loop.seed is a grid key; write grid.loop.seed"):
        load_study(p, ["loop.seed=3"])
    with pytest.raises(ValueError, match="no named run"):
        load_study(p, ["runs=[zzz]"])


@pytest.mark.parametrize(
    "body, match",
    [
        ({"gird": {}}, "unknown key"),
        ({"grid": {"loop.seed": []}}, "grid.loop.seed must be a non-empty list"),
        ({"grid": {"trainer.max_stepz": [1]}}, "trainer.max_stepz"),
        ({"runs": {"x": {"recipe": "nope"}}}, "run x: .*nope"),
        ({"runs": {"x": {"rollout_recipe": "nope"}}}, "run x: .*nope"),
        ({"runs": {"x": {"keep_bf16.first": -1}}}, "keep_bf16.first=-1"),
        ({"runs": {"a__b": {}}}, "run name"),
        ({"base": "missing.yaml"}, "base 'missing.yaml'"),
        ({}, "no runs"),
    ],
)
def test_bad_study_configs_name_what_is_wrong(tmp_path, body, match):
    with pytest.raises(ValueError, match=match):
        load_study(_study(tmp_path, body)).expand()


def test_shipped_studies_expand():
    ab = load_study("study/ablations.yaml").expand()
    names = {r.name: r for r in ab}
    assert names["int4-matched"].alias_of == "recipe-int4_qat__max_staleness-2"
    assert names["nvfp4-backward-hp"].alias_of == "recipe-nvfp4_moe__max_staleness-2"
    assert names["int4qat-train_bf16-rollout"].alias_of is None
    assert sum(r.alias_of is None for r in ab) == 15 + 6
    assert len(load_study("study/staleness-x-precision.yaml").expand()) == 5 * 5 * 3
    consistency = load_study("study/consistency.yaml").expand()
    assert len(consistency) == 3 * 2 * 2 * 2 and all(len(r.config["run_id"]) <= 64 for r in consistency)
    assert len({r.config["run_id"] for r in consistency}) == len(consistency)
    gpu = load_study("study/consistency-gpu.yaml").expand()
    assert [r.keys for r in gpu] == [r.keys for r in consistency]  # the CPU study's grid, on CUDA
    for r in gpu:  # each a valid run config, exact mode's fp32 trainer included
        cfg = run_config.from_dict(r.config)
        assert (cfg.trainer.device, cfg.rollout.device, cfg.trainer.dtype) == ("cuda", "cuda", "float32")


def test_a_long_run_name_gets_a_run_id_within_the_limit_and_distinct():
    a, b = "recipe-nvfp4_moe__exact-False__routing_replay-False__max_staleness-0", "x" * 64
    assert study_run_id("recipe-bf16__max_staleness-2") == "recipe-bf16.max_staleness-2"
    assert study_run_id(b) == b
    cut = study_run_id(a)
    assert len(cut) == 64 and cut.startswith("recipe-nvfp4_moe.exact-False.routing_replay-False.max_")
    assert cut != study_run_id(a[:-1] + "2")


def test_grid_run_name():
    assert grid_run_name({"recipe": "int4_qat", "keep_bf16.last_fraction": 0.0, "x": "a/b"}) == (
        "recipe-int4_qat__last_fraction-0.0__x-a-b"
    )


# ------------------------------------------------------------------ statistics, by hand


def test_head_tail_means():
    values = [float(i) for i in range(20)]  # k = ceil(0.1 * 20) = 2
    assert head_tail_means(values) == (0.5, 18.5)
    assert head_tail_means([1.0, 2.0, 4.0]) == (1.0, 4.0)  # k = ceil(0.3) = 1


def test_grad_norm_spikes():
    # medians of the earlier steps: [1,1,1] -> 1 (5.1 > 5: spike), [1,1,1,5.1] -> 1 (4.9: none),
    # [1,1,1,5.1,4.9] -> 1 (6: spike); a huge first step has no history and does not count.
    assert grad_norm_spikes([100.0, 1.0, 1.0, 1.0, 5.1, 4.9, 6.0]) == 1  # median after 100 and 1s is 1
    assert grad_norm_spikes([1.0, 1.0, 1.0, 5.1, 4.9, 6.0]) == 2
    assert grad_norm_spikes([1.0, 1.0, 1.0, 5.0]) == 0  # not above 5x


def test_t_interval():
    mean, half = t_interval([1.0, 2.0, 3.0])  # sd 1, t_{0.975,2} = 4.303
    assert mean == 2.0 and math.isclose(half, 4.303 / math.sqrt(3))
    assert t_interval([0.25]) == (0.25, None)
    mean, half = t_interval([0.0, 1.0])  # sd = sqrt(0.5), t_{0.975,1} = 12.706
    assert math.isclose(half, 12.706 * math.sqrt(0.5) / math.sqrt(2))


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_cpu_shares():
    assert cpu_shares(1, [0, 1]) == [[0, 1]]
    assert cpu_shares(2, [3, 1]) == [[1], [3]]
    assert cpu_shares(3, [0, 1]) == [[0], [1], [0]]
    assert cpu_shares(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3, 4]]


# ------------------------------------------------------------------ the rollout_recipe knob


def _cfg(tmp_path, **top):
    return run_config.load(
        None,
        [f"{k}={v}" for k, v in top.items()]
        + [f"model.overrides={TINY}", "trainer.metrics_port=-1", "num_rollout_workers=1"],
    )


def test_the_contract_holds_unless_the_knob_is_named(tmp_path):
    """Trainer and rollouts agree on one fingerprint; a worker on another recipe is refused (its
    fingerprint is not the one the trainer accepts) unless `rollout_recipe` names that recipe."""
    plain = _cfg(tmp_path, recipe="int4_qat")
    assert not plain.contract_breaking
    trainer = services.make_trainer(plain, tmp_path / "a").parts.contracts
    assert trainer.accepted == trainer.fingerprint and not trainer.breaking
    assert services.make_worker(plain, "w0").fingerprint == trainer.accepted
    # The rollouts on bf16 without the knob: a foreign fingerprint, refused by the trainer.
    other = services.make_worker(_cfg(tmp_path, recipe="bf16"), "w0")
    assert other.fingerprint != trainer.accepted
    # Named: the trainer publishes bf16 and accepts it, trains int4 QAT, and says so.
    knob = _cfg(tmp_path, recipe="int4_qat", rollout_recipe="bf16")
    assert knob.contract_breaking
    broken = services.make_trainer(knob, tmp_path / "b").parts.contracts
    assert broken.fingerprint == trainer.fingerprint  # trains (and checkpoints) as int4 QAT
    assert broken.accepted == other.fingerprint == services.make_worker(knob, "w0").fingerprint
    assert broken.breaking and broken.rollout_recipe.name == "bf16"
    # Naming the run's own recipe is no ablation.
    same = _cfg(tmp_path, recipe="int4_qat", rollout_recipe="int4_qat")
    assert not same.contract_breaking
    assert services.make_trainer(same, tmp_path / "c").parts.contracts.accepted == trainer.fingerprint


def test_keep_bf16_overrides_the_recipe(tmp_path):
    cfg = _cfg(tmp_path, recipe="nvfp4_moe")
    base = services.load_recipe(cfg, "nvfp4_moe")
    assert base.keep_bf16_last_fraction == 0.15
    first = services.load_recipe(run_config.load(None, ["keep_bf16.last_fraction=0", "keep_bf16.first=1"]), "nvfp4_moe")
    assert (first.keep_bf16_last_fraction, first.keep_bf16_first) == (0.0, 1)
    assert first.name == base.name and first.fingerprint() != base.fingerprint()
    with pytest.raises(ValueError, match="keep_bf16.last_fraction=2"):
        run_config.load(None, ["keep_bf16.last_fraction=2"])


# ------------------------------------------------------------------ the report from run folders


def _fake_run(run_dir, rewards, *, quant=0.0, stale=0.0, dropped=0, breaking=False):
    """A finished run folder as `tandem study` leaves it (metrics rows with the fields the report reads)."""
    import json

    run_dir.mkdir(parents=True)
    rows = [
        {
            "step": i + 1,
            "reward_mean": r,
            "logp_abs_diff": quant + stale,
            "logp_abs_diff_quant": quant,
            "logp_abs_diff_stale": stale,
            "kl_k3": 0.001,
            "staleness_mean": 1.0,
            "dropped_stale": dropped,
            "samples": 10,
            "grad_norm": 1.0,
            "contract_breaking": breaking,
        }
        for i, r in enumerate(rewards)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "attempts.jsonl").write_text(json.dumps({"start": 0.0, "end": 12.5, "rc": 0, "commit": "abc"}) + "\n")
    (run_dir / "done.json").write_text("{}\n")


@pytest.mark.slow
def test_report_pairs_seeds_against_bf16(tmp_path):
    import csv

    from tandem.study_report import write_report

    p = _study(
        tmp_path,
        {
            "grid": {"recipe": ["bf16", "int4_qat"], "loop.seed": [0, 1, 2]},
            "runs": {"knob": {"recipe": "int4_qat", "rollout_recipe": "bf16"}},
        },
    )
    study = load_study(p, ["trainer.max_steps=10"])
    runs = study.expand()
    out = tmp_path / "out"
    # final rewards (last step of 10): bf16 0.5, 0.6, 0.7; int4 0.4, 0.6, 0.5 -> diffs -0.1, 0, -0.2
    finals = {"recipe-bf16__seed-0": 0.5, "recipe-bf16__seed-1": 0.6, "recipe-bf16__seed-2": 0.7}
    finals |= {"recipe-int4_qat__seed-0": 0.4, "recipe-int4_qat__seed-1": 0.6, "recipe-int4_qat__seed-2": 0.5}
    for name, final in finals.items():
        _fake_run(out / name, [0.1] * 9 + [final], stale=0.05, dropped=10 if "bf16" in name else 0)
    _fake_run(out / "knob", [0.1] * 9 + [0.3], quant=0.02, breaking=True)
    write_report(study, runs, out, command="tandem study s.yaml")
    with open(out / "summary.csv") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    assert float(rows["recipe-int4_qat__seed-1"]["final_reward"]) == 0.6
    assert math.isclose(float(rows["recipe-int4_qat__seed-1"]["reward_change"]), 0.5)
    assert math.isclose(float(rows["recipe-bf16__seed-0"]["dropped_stale_frac"]), 10 / 110)
    assert rows["knob"]["contract_breaking"] == "True" and rows["knob"]["rollout_recipe"] == "bf16"
    assert float(rows["knob"]["wall_time_s"]) == 12.5
    report = (out / "report.md").read_text()
    # int4 vs bf16 over 3 paired seeds: mean -0.1, sd 0.1, half-width 4.303 * 0.1 / sqrt(3) = 0.248
    line = next(ln for ln in report.splitlines() if ln.startswith("| recipe=int4_qat |"))
    assert "| 3 | 0.5 | 0.6 | -0.1 | ±0.248 |" in line
    line = next(ln for ln in report.splitlines() if ln.startswith("| knob |"))
    assert "bf16 (contract broken)" in line and "n/a (1 seed)" in line and "recipe-bf16__seed-0" in line
    assert "Contract-breaking ablations** (trainer and rollouts on different recipes" in report
    assert "the runs ran at: `abc`" in report
    for png in ("reward_curves.png", "mismatch_named_runs.png"):
        assert (out / png).stat().st_size > 1000


def test_a_changed_grid_or_run_list_replaces_the_description_with_what_ran(tmp_path):
    from tandem.study import describe

    grid = {"recipe": ["bf16", "int4_qat"], "loop.max_staleness": [0, 1, 2]}
    assert describe("text", grid, dict(grid), ["a"], ["a"]) == "text"
    assert describe("text", grid, {**grid, "loop.max_staleness": [0, 2]}, ["a", "b"], ["b"]) == (
        "What ran: the grid recipe in [bf16, int4_qat] x loop.max_staleness in [0, 2]; named runs: b."
        " (The study file's description is left out: grid.loop.max_staleness=[0, 2], runs=[b] on the command line"
        " changed what it describes.)"
    )
    assert describe("", {}, {"loop.seed": [0]}, [], []) == "What ran: the grid loop.seed in [0]; named runs: none."
    p = _study(tmp_path, {"description": "five stalenesses", "grid": {"loop": {"max_staleness": [0, 1, 2, 4, 8]}}})
    assert load_study(p, ["grid.loop.max_staleness=[0, 1, 2, 4, 8]"]).description == "five stalenesses"
    study = load_study(p, ["grid.loop.max_staleness=[0,1]"])
    assert study.description.startswith("What ran: the grid loop.max_staleness in [0, 1]; named runs: none.")
    assert study.source["description"] == study.description  # DIR/study.yaml says the same


@pytest.mark.slow
def test_report_figures_have_titles_readable_legends_and_integer_ticks(tmp_path):
    from tandem.study_report import LEGEND_FONTSIZE, figures, summary_rows, write_report

    p = _study(
        tmp_path,
        {
            "description": "stalenesses 0, 1 and 2",
            "grid": {"recipe": ["bf16", "int4_qat"], "loop.max_staleness": [0, 1, 2]},
            "runs": {"knob": {"recipe": "int4_qat", "rollout_recipe": "bf16"}},
        },
    )
    study = load_study(p, ["grid.loop.max_staleness=[0,1]"])
    runs, out = study.expand(), tmp_path / "out"
    for run in runs:
        _fake_run(out / run.name, [0.1, 0.2, 0.3], quant=0.001, stale=0.05, breaking=run.name == "knob")
    made = figures(study, runs, summary_rows(runs, out), out)
    assert [name for name, _ in made] == [
        "reward_curves.png",
        "mismatch_vs_staleness.png",
        "kl_vs_staleness.png",
        "dropped_vs_staleness.png",
        "mismatch_named_runs.png",
    ]
    for name, fig in made:
        fig.canvas.draw()
        titles = [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes]
        assert any(t.startswith(f"{study.name}: ") for t in titles), (name, titles)
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            legends = [ax.get_legend()] if ax.get_legend() else fig.legends  # many series: one below the panels
            assert legends and all(t.get_fontsize() >= LEGEND_FONTSIZE >= 9 for lg in legends for t in lg.get_texts())
            if ax.get_xlabel() in ("trainer step", "max_staleness"):  # 3 steps; staleness 0 and 1
                lo, hi = ax.get_xlim()
                ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
                assert len(ticks) >= 2 and all(t == int(t) for t in ticks), (name, ticks)
    report = write_report(study, runs, out, command="tandem study s.yaml grid.loop.max_staleness=[0,1]").read_text()
    assert "stalenesses 0, 1 and 2" not in report
    assert "What ran: the grid recipe in [bf16, int4_qat] x loop.max_staleness in [0, 1]; named runs: knob." in report


def test_a_consistency_grid_plots_router_agreement_with_one_legend_below_many_series(tmp_path):
    import json

    from tandem.study_report import figures, summary_rows

    grid = {"recipe": ["bf16", "int4_qat"], "loop.exact": [False, True], "loop.routing_replay": [False, True]}
    study = load_study(_study(tmp_path, {"grid": grid | {"loop.max_staleness": [0, 1]}}))
    runs, out = study.expand(), tmp_path / "out"
    for run in runs:
        _fake_run(out / run.name, [0.1, 0.2], quant=0.0 if run.keys["loop.exact"] else 1e-7, stale=0.01)
        if run.keys["loop.routing_replay"]:  # the trainer writes router agreement under replay only
            path = out / run.name / "metrics.jsonl"
            rows = [json.loads(ln) | {"router_agree_frac": 0.9} for ln in path.read_text().splitlines()]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = summary_rows(runs, out)
    assert {r["router_agree_frac"] for r in rows} == {0.9, None}
    made = dict(figures(study, runs, rows, out))
    agree = made["router_agreement_vs_staleness.png"]
    assert len(agree.legends) == 1 and len(agree.legends[0].get_texts()) == 4  # the replayed settings only
    mismatch = made["mismatch_vs_staleness.png"]
    assert len(mismatch.legends[0].get_texts()) == 8 and all(ax.get_legend() is None for ax in mismatch.axes)
    assert mismatch.axes[0].get_ylim()[0] == 0  # |Δ log p| with exact zeros: symlog from 0, no negative half
