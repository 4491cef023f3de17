"""policy.configfile: the one reader of YAML config files and key=value overrides."""

from __future__ import annotations

import pytest

from policy.configfile import parse_override, read_mapping, set_dotted
from policy.recipe import Recipe
from tandem.study import load_study


def test_overrides_parse_as_yaml_and_set_dotted_creates_sections():
    data = {"trainer": {"lr": 0.1}}
    for item in ["trainer.max_steps=3", "model.overrides={n_layers: 2}", " run_id = x"]:
        set_dotted(data, *parse_override(item))
    assert data == {"trainer": {"lr": 0.1, "max_steps": 3}, "model": {"overrides": {"n_layers": 2}}, "run_id": "x"}
    with pytest.raises(ValueError, match=r"override 'trainer.lr.x': 'lr' is not a section"):
        set_dotted(data, "trainer.lr.x", 1)
    with pytest.raises(ValueError, match=r"override '=3' is not key=value"):
        parse_override("=3")


def test_read_mapping_names_the_file_line_and_column(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("")
    assert read_mapping(p, "f") == {}
    p.write_text("a: 1\nb: [2\n")
    with pytest.raises(ValueError, match=r"^f: YAML syntax error \(line 3, column 1\)"):
        read_mapping(p, "f")
    p.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="^f: expected a mapping at the top, got list$"):
        read_mapping(p, "f")
    with pytest.raises(ValueError, match=r"^f: cannot read it \(FileNotFoundError"):
        read_mapping(tmp_path / "nope.yaml", "f")


def test_run_study_and_recipe_files_share_the_messages(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [x\n")
    with pytest.raises(ValueError, match=r"^study config .*bad.yaml: YAML syntax error \(line 2"):
        load_study(bad)
    with pytest.raises(ValueError, match=r"^recipe file '.*bad.yaml': YAML syntax error \(line 2"):
        Recipe.load(bad)
    good = tmp_path / "s.yaml"
    good.write_text("name: s\nbase: demo.yaml\n")
    with pytest.raises(ValueError, match=r"^override trainer.lr: YAML syntax error"):
        load_study(good, ["trainer.lr=[1"])
