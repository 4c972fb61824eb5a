"""Config composition, validation and the CLI's handling of user mistakes."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from nemo_orch import cli
from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError


def test_default_tree_composes_all_groups():
    cfg = config_lib.load()
    assert cfg.model.preset == "micro"
    assert 1e6 < cfg.model.num_parameters() < 10e6  # "a few million parameters"
    assert (
        cfg.tools.declarations,
        cfg.reward.combination,
        cfg.rollout.engine,
        cfg.launcher.executor,
    ) == (["tools/orchestra"], "preference", "hf", "local")


@pytest.mark.parametrize("recipe", config_lib.recipes())
def test_every_recipe_composes_into_a_valid_config_of_its_own_run(recipe, tmp_path):
    """A recipe (``make train-long``'s among them) passes every section's checks, and its runs
    go to a directory named after it, apart from the default job's. (A SLURM recipe's job
    directory is the user's to give.)"""
    config = config_lib.load([f"recipe={recipe}", f"launcher.slurm.job_dir={tmp_path}"])
    assert config.run.name == recipe
    assert config.run.dir != config_lib.load([]).run.dir


@pytest.mark.parametrize("preset,params", [("qwen3-0.6b", 0.6e9), ("qwen3-8b", 8.2e9)])
def test_presets_have_qwen3_sizes(preset, params):
    cfg = config_lib.load([f"model={preset}"])
    assert cfg.model.num_parameters() == pytest.approx(params, rel=0.05)


def test_overrides_are_typed():
    cfg = config_lib.load(
        [
            "trainer.optim.lr=0.5",
            "parallel.dp=2",
            "trainer.global_batch_size=32",
            "trainer.micro_batch_size=8",
        ]
    )
    assert cfg.trainer.optim.lr == 0.5 and cfg.parallel.dp == 2 and cfg.num_microbatches == 2


@pytest.mark.parametrize(
    "override,named",
    [
        ("trainer.no_such_key=1", "trainer.no_such_key"),
        ("+trainer.no_such_key=1", "trainer.no_such_key"),
        ("trainer.optim.lr=fast", "trainer.optim.lr"),
        ("model=qwen3-9000b", "model/qwen3-9000b"),
        ("data.sft_path=/nonexistent/data.jsonl", "/nonexistent/data.jsonl"),
        ("model.fp8=hybrid", "model.fp8"),
        ("parallel.tp=3", "parallel.tp"),
        ("trainer.micro_batch_size=3", "trainer.global_batch_size"),
    ],
)
def test_user_mistakes_name_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace("+", r"\+")):
        config_lib.load([override])


def test_fp8_is_valid_with_transformer_engine():
    cfg = config_lib.load(["model=qwen3-8b", "model.fp8=hybrid", "model.fp8_recipe=tensorwise"])
    assert cfg.model.fp8 == "hybrid"


def test_print_config_round_trips(capsys):
    assert cli.main(["train", "--print-config", "trainer.max_steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_steps"] == 7
    assert config_lib.validate(printed).trainer.max_steps == 7


def test_cli_reports_unknown_key_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "nemo_orch.cli", "train", "trainer.no_such_key=1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == cli.EXIT_USER_ERROR
    assert "trainer.no_such_key" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_key_inside_a_dict_value_is_named():
    with pytest.raises(ConfigError, match=r"Unknown config key 'data\.demo_routers\.no_such'"):
        config_lib.load(["data.demo_routers={strongest: 1, no_such: 0}"])


def test_a_new_key_of_an_open_mapping_needs_a_plus_and_the_pages_spell_it_so():
    """tools.endpoints holds no alias by default: Hydra adds one only as +key=VALUE. Spelled
    without it, the error says how; every page spells it so."""
    url = "http://127.0.0.1:8001/v1"
    assert config_lib.load([f"+tools.endpoints.math={url}"]).tools.endpoints == {"math": url}
    with pytest.raises(
        ConfigError,
        match=r"Unknown config key 'tools\.endpoints\.math'\. A new "
        r"key of tools\.endpoints is added with \+: \+tools\.endpoints\.math=",
    ):
        config_lib.load([f"tools.endpoints.math={url}"])
    root = Path(__file__).parents[1]
    # a page's override of an alias (the launcher's --endpoint argument names a key, not this)
    spelled = re.compile(r"(?<![+\w.'])tools\.endpoints\.[\w<>-]+=")
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    assert [
        f"{page.name}: {line.strip()}"
        for page in pages
        for line in page.read_text().splitlines()
        if spelled.search(line)
    ] == []


def test_saved_config_reloads(tmp_path):
    cfg = config_lib.load(["run.name=abc"])
    path = tmp_path / "config.yaml"
    path.write_text(config_lib.to_yaml(cfg))
    assert config_lib.load_saved(path) == cfg
    assert config_lib.load_saved(path, ["trainer.optim.lr=0.1"]).trainer.optim.lr == 0.1
    path.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="config.yaml"):
        config_lib.load_saved(path)


def test_a_config_saved_before_keys_moved_still_loads(tmp_path):
    """A checkpoint's config.yaml written before grpo.eval_tasks became eval.tasks (and the
    eval.data family moved under env.*) loads, keeping the new keys' saved values."""
    cfg = config_lib.load(["eval.tasks=7"])
    path = tmp_path / "config.yaml"
    path.write_text(
        config_lib.to_yaml(cfg)
        .replace("grpo:\n", "grpo:\n  eval_tasks: 300\n", 1)
        .replace("eval:\n", "eval:\n  limit: 5\n  data: null\n", 1)
    )
    assert "eval_tasks: 300" in path.read_text() and "limit: 5" in path.read_text()
    assert config_lib.load_saved(path) == cfg


def test_schema_defaults_are_the_shipped_defaults():
    # One set of defaults: the YAML tree and the dataclasses must not drift apart, and every
    # field is in the YAML tree (a key missing there cannot be overridden from the command line).
    assert config_lib.load() == config_lib.Config()
    tree = config_lib.compose()
    missing = [
        f"{section.name}.{field.name}"
        for section in dataclasses.fields(config_lib.Config)
        for field in dataclasses.fields(
            section.type if isinstance(section.type, type) else getattr(config_lib, section.type)
        )
        if field.name not in tree[section.name]
    ]
    assert missing == []


def test_the_optimizer_keys_moved_and_old_configs_load_with_their_values(tmp_path):
    with pytest.raises(ConfigError, match=r"grpo\.lr is now grpo\.optim\.lr"):
        config_lib.load(["grpo.lr=1e-5"])
    # What a run saved before each stage's optimizer became a section of its own.
    tree = OmegaConf.create(config_lib.to_yaml(config_lib.load()))
    del tree.trainer["optim"], tree.grpo["optim"]
    tree.trainer.lr, tree.trainer.warmup_steps, tree.grpo.lr, tree.grpo.min_lr = 0.5, 3, 1e-5, 1e-6
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(tree))
    loaded = config_lib.load_saved(path)
    assert (loaded.trainer.optim.lr, loaded.trainer.optim.warmup_steps) == (0.5, 3)
    assert (loaded.grpo.optim.lr, loaded.grpo.optim.min_lr) == (1e-5, 1e-6)
    assert loaded.grpo.optim.warmup_steps == 0  # the rest: each stage's defaults
    assert loaded.trainer.optim.min_lr == config_lib.load().trainer.optim.min_lr


def test_an_override_that_does_not_parse_names_its_key():
    with pytest.raises(
        ConfigError,
        match=r"^trainer\.max_steps: cannot parse "
        r"'trainer\.max_steps=\[1,': .*quote values",
    ):
        config_lib.load(["trainer.max_steps=[1,"])


def _own_keys(path: Path) -> dict:
    return {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"}


def _composed_over(group: str, path: Path) -> dict:
    """What the option file ``path`` of ``group`` composes over: the section's dataclass
    defaults (the env presets' ``schema``), then each option its own defaults list names,
    composed (``grpo/ppo.yaml`` over ``default``)."""
    parents = [
        name
        for name in (yaml.safe_load(path.read_text()) or {}).get("defaults", [])
        if name not in ("_self_", "schema")
    ]
    base = OmegaConf.structured(getattr(config_lib.Config(), group))
    for parent in parents:
        parent_path = path.with_name(f"{parent}.yaml")
        base = OmegaConf.merge(base, _composed_over(group, parent_path), _own_keys(parent_path))
    return OmegaConf.to_container(base)


def _restated(tree: dict, base: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in tree.items():
        if key == "defaults" or key not in base:
            continue
        if value == base[key]:
            found.append(prefix + key)
        elif isinstance(value, dict) and isinstance(base[key], dict):
            found += _restated(value, base[key], f"{prefix}{key}.")
    return found


def test_conf_files_state_only_what_differs_from_the_defaults():
    """A group option (``conf/<group>/<option>.yaml``) and ``train.yaml`` compose over the
    dataclasses' defaults: a key equal to what it composes over states a fact twice. Recipes
    compose over the whole default selection and are whole configurations, so they are not
    held to it."""
    sections = set(config_lib.Config.__dataclass_fields__)
    restated = {}
    for path in sorted(config_lib.CONF_DIR.rglob("*.yaml")):
        relative = path.relative_to(config_lib.CONF_DIR)
        tree = yaml.safe_load(path.read_text()) or {}
        if len(relative.parts) == 1:
            base = OmegaConf.to_container(OmegaConf.structured(config_lib.Config))
            found = _restated(_own_keys(path), base)
        elif len(relative.parts) == 2 and relative.parts[0] in sections:
            found = _restated(tree, _composed_over(relative.parts[0], path))
        else:  # recipes, and the declarations and samples the options name
            continue
        if found:
            restated[str(relative)] = found
    assert not restated, restated
