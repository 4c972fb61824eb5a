"""Hugging Face Hub ids in the config (:mod:`nemo_orch.config.hub`), resolved offline by the real
huggingface_hub from a cache laid out as huggingface_hub lays out its downloads (blobs, relative
symlinks under ``snapshots/<commit>``, ``refs/<branch>``, the tree listing of the commit)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from huggingface_hub import scan_cache_dir
from omegaconf import OmegaConf
from support.hub_cache import HubCache, offline_hub, parquet_bytes

from nemo_orch import cli
from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError
from nemo_orch.config.hub import HubId
from nemo_orch.envs import build_environment

MODEL = "acme/tiny-qwen3"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    return offline_hub(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def policy_files(random_policy_dir: Path) -> dict[str, bytes]:
    """A tiny Qwen3 and its tokenizer, as an HF model repository holds them."""
    return {path.name: path.read_bytes() for path in random_policy_dir.iterdir()}


def _parquet(rows: list[dict]) -> bytes:
    return parquet_bytes(pa.Table.from_pylist(rows))


def test_the_fixture_lays_out_the_cache_as_huggingface_hub_reads_it(hub, policy_files):
    commit = hub.add(MODEL, policy_files, refs=("main", "v1"))
    (repo,) = scan_cache_dir(hub.root).repos
    (revision,) = repo.revisions
    assert (repo.repo_id, repo.repo_type, revision.commit_hash) == (MODEL, "model", commit)
    assert set(revision.refs) == {"main", "v1"}
    assert {file.file_name for file in revision.files} == set(policy_files)


def test_a_model_id_is_the_policy_its_tokenizer_and_the_start_weights(
    hub, policy_files, random_policy_dir
):
    from transformers import AutoConfig

    from nemo_orch.models.tokenizer import load_tokenizer

    # Files the runs do not read were never fetched: the snapshot is complete without them.
    commit = hub.add(
        MODEL,
        policy_files,
        not_downloaded={"README.md": b"# a tiny Qwen3\n", "original/model.pth": b"pickled"},
    )
    config = config_lib.load(
        [f"rollout.policy={MODEL}", f"tokenizer.path={MODEL}", f"trainer.init_from={MODEL}"]
    )
    snapshot = str(hub.snapshot(MODEL, commit))
    assert (config.rollout.policy, config.tokenizer.path, config.trainer.init_from) == (
        snapshot,
        snapshot,
        snapshot,
    )
    assert AutoConfig.from_pretrained(config.rollout.policy).model_type == "qwen3"
    assert load_tokenizer(config.tokenizer_dir).encode("hello") == load_tokenizer(
        random_policy_dir
    ).encode("hello")


def test_a_revision_is_a_branch_or_a_commit(hub, policy_files):
    first = hub.add(MODEL, policy_files)
    second = hub.add(
        MODEL, {**policy_files, "generation_config.json": b'{"top_k": 20}'}, refs=("v2",)
    )

    defaults = config_lib.compose()

    def policy(value: str) -> str:
        tree = OmegaConf.merge(defaults, {"rollout": {"policy": value}})
        return config_lib.validate(tree).rollout.policy

    assert policy(MODEL) == policy(f"{MODEL}@main") == str(hub.snapshot(MODEL, first))
    assert policy(f"{MODEL}@v2") == policy(f"{MODEL}@{second}") == str(hub.snapshot(MODEL, second))
    with pytest.raises(
        ConfigError, match=f"rollout.policy: {MODEL}@v3 is not in the Hugging Face cache {hub.root}"
    ):
        policy(f"{MODEL}@v3")


def test_a_local_path_wins_over_the_hub(hub, policy_files, tmp_path):
    hub.add(MODEL, policy_files)
    local = tmp_path / MODEL
    local.mkdir(parents=True)
    (local / "tokenizer_config.json").write_bytes(policy_files["tokenizer_config.json"])
    assert config_lib.load([f"tokenizer.path={MODEL}"]).tokenizer.path == MODEL


def test_a_toolscale_dataset_id_is_its_parquet_file_read_by_the_environment(hub, toolscale_dir):
    from nemo_orch.data.domain_tasks import read_domain_tasks

    shop = read_domain_tasks(toolscale_dir / "shop" / "tasks.jsonl")
    file = "data/train-00000-of-00001.parquet"
    commit = hub.add(
        "acme/toolscale",
        {file: _parquet([task.to_json() for task in shop])},
        repo_type="dataset",
        not_downloaded={"README.md": b"# ToolScale\n"},
    )
    config = config_lib.load(
        [
            "env=toolscale",
            "env.path=acme/toolscale",
            f"tools.domains=[{toolscale_dir / 'shop' / 'domain.json'}]",
        ]
    )
    assert config.env.path == str(hub.snapshot("acme/toolscale", commit, "dataset") / file)
    env = build_environment(config)
    assert [task.id for task in env.tasks("test", None, 0)] == [f"shop/{task.id}" for task in shop]


def test_a_dataset_in_shards_is_their_folder_read_by_the_qa_environment(hub):
    rows = [
        {
            "question_id": i,
            "question": f"What is {i} + {i}?",
            "reference_answer": str(2 * i),
            "model_reasoning": "...",
        }
        for i in range(6)
    ]
    commit = hub.add(
        "acme/thoughts",
        {
            "data/train-00000-of-00002.parquet": _parquet(rows[:4]),
            "data/train-00001-of-00002.parquet": _parquet(rows[4:]),
        },
        repo_type="dataset",
    )
    config = config_lib.load(["env=qa", "env.path=acme/thoughts", "env.id_column=question_id"])
    assert config.env.path == str(hub.snapshot("acme/thoughts", commit, "dataset") / "data")
    tasks = build_environment(config).tasks("test", None, 0)
    assert [(task.id, task.answer) for task in tasks] == [(str(i), str(2 * i)) for i in range(6)]


# What the datasets library writes beside a split's rows: never data.
DATASET_INFOS = b'{"default": {"splits": {"train": {"name": "train", "num_examples": 3}}}}'
CARD = {
    "README.md": b"---\nconfigs: [{config_name: default, data_files: data/train-*}]\n---\n",
    ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n",
}


def test_a_sharded_toolscale_split_beside_its_metadata_is_one_dataset(hub, toolscale_dir):
    from nemo_orch.data.domain_tasks import read_domain_tasks

    shop = [task.to_json() for task in read_domain_tasks(toolscale_dir / "shop" / "tasks.jsonl")]
    commit = hub.add(
        "acme/toolscale",
        {
            "data/train-00000-of-00002.parquet": _parquet(shop[:2]),
            "data/train-00001-of-00002.parquet": _parquet(shop[2:]),
            "data/dataset_infos.json": DATASET_INFOS,
            **CARD,
        },
        repo_type="dataset",
    )
    config = config_lib.load(
        [
            "env=toolscale",
            "env.path=acme/toolscale",
            f"tools.domains=[{toolscale_dir / 'shop' / 'domain.json'}]",
        ]
    )
    assert config.env.path == str(hub.snapshot("acme/toolscale", commit, "dataset") / "data")
    env = build_environment(config)
    assert [task.id for task in env.tasks("test", None, 0)] == [
        f"shop/{task['id']}" for task in shop
    ]


def test_a_sharded_task_file_split_is_one_dataset(hub):
    rows = [
        {"id": f"t{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)
    ]
    lines = [
        b"".join(json.dumps(row).encode() + b"\n" for row in part) for part in (rows[:3], rows[3:])
    ]
    hub.add(
        "acme/tasks",
        {
            "train-00000-of-00002.jsonl": lines[0],
            "train-00001-of-00002.jsonl": lines[1],
            "dataset_infos.json": DATASET_INFOS,
        },
        repo_type="dataset",
    )
    tasks = build_environment(config_lib.load(["env=tasks", "env.path=acme/tasks"])).tasks(
        "test", None, 0
    )
    assert [(task.id, task.answer) for task in tasks] == [
        (row["id"], row["answer"]) for row in rows
    ]


def test_a_dataset_of_several_splits_names_the_files_to_choose_from(hub):
    row = _parquet([{"question": "q", "answer": "a"}])
    commit = hub.add(
        "acme/qa",
        {"data/test-00000-of-00001.parquet": row, "data/train-00000-of-00001.parquet": row},
        repo_type="dataset",
    )
    with pytest.raises(
        ConfigError,
        match=r"env.path: acme/qa: the dataset holds several data "
        r"files \(data/test-00000-of-00001.parquet, data/train-00000-of-00001."
        r"parquet\); name the one to read: env.path=acme/qa:data/test-",
    ):
        config_lib.load(["env=qa", "env.path=acme/qa"])
    chosen = config_lib.load(["env=qa", "env.path=acme/qa:data/train-00000-of-00001.parquet"])
    assert chosen.env.path == str(
        hub.snapshot("acme/qa", commit, "dataset") / "data/train-00000-of-00001.parquet"
    )


def test_a_partial_snapshot_serves_what_it_holds_and_names_what_it_lacks(hub, policy_files):
    weights = ("config.json", "model.safetensors")
    hub.add(
        MODEL,
        {name: data for name, data in policy_files.items() if name not in weights},
        not_downloaded={name: policy_files[name] for name in weights},
    )
    assert config_lib.load([f"tokenizer.path={MODEL}"]).tokenizer.path.startswith(str(hub.root))
    with pytest.raises(
        ConfigError,
        match=f"trainer.init_from: {MODEL} is only partly in the "
        f"Hugging Face cache {hub.root} and HF_HUB_OFFLINE=1",
    ):
        config_lib.load([f"trainer.init_from={MODEL}"])


def test_a_missing_id_offline_exits_2_naming_the_id_and_the_cache(
    hub, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert cli.main(["train", "--print-config", f"trainer.init_from={MODEL}"]) == 2
    assert (
        f"trainer.init_from: {MODEL} is not in the Hugging Face cache {tmp_path}/home/hub "
        f"and HF_HUB_OFFLINE=1: fetch it where the Hub is reachable, into this cache (hf "
        f"download {MODEL}, or load this config there once); no local path {MODEL} exists "
        "either"
    ) in capsys.readouterr().err


def test_a_saved_config_pins_each_commit_and_loads_on_another_machine(
    hub, policy_files, tmp_path, monkeypatch
):
    data = {"data/train-00000-of-00001.jsonl": b'{"question": "q", "answer": "a"}\n'}
    model_commit = hub.add(MODEL, policy_files)
    data_commit = hub.add("acme/qa", data, repo_type="dataset")
    config = config_lib.load(
        [
            f"rollout.policy={MODEL}",
            "env=qa",
            "env.path=acme/qa",
            f"env.retrieval.encoder.model={MODEL}",
        ]
    )
    assert config_lib.replace(config, run=config.run) == config  # local paths resolve to themselves
    saved = tmp_path / "config.yaml"
    saved.write_text(config_lib.to_yaml(config))
    text = saved.read_text()
    assert text.count(f"policy: {MODEL}@{model_commit}\n") == 1
    assert text.count(f"model: {MODEL}@{model_commit}\n") == 1  # the retriever's encoder
    assert f"path: acme/qa@{data_commit}:data/train-00000-of-00001.jsonl\n" in text

    elsewhere = HubCache(tmp_path / "elsewhere")  # the same commits in another machine's cache
    elsewhere.add(MODEL, policy_files)
    elsewhere.add("acme/qa", data, repo_type="dataset")
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere.root))
    loaded = config_lib.load_saved(saved)
    assert (
        loaded.rollout.policy
        == loaded.env.retrieval.encoder.model
        == str(elsewhere.snapshot(MODEL, model_commit))
    )
    assert loaded.env.path == str(
        elsewhere.snapshot("acme/qa", data_commit, "dataset") / "data/train-00000-of-00001.jsonl"
    )


def test_an_index_encoder_id_missing_offline_exits_2(hub, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "a", "text": "volcanoes erupt"}\n')
    assert (
        cli.main(["index", "build", "--corpus", str(corpus), "--out", "index", "--encoder", MODEL])
        == 2
    )
    assert f"--encoder: {MODEL} is not in the Hugging Face cache {hub.root}" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "value,parsed",
    [
        ("Qwen/Qwen3-8B", HubId("Qwen/Qwen3-8B")),
        (
            "nvidia/ToolScale@refs/pr/1:data/train.parquet",
            HubId("nvidia/ToolScale", "refs/pr/1", "data/train.parquet"),
        ),
        ("hashing", None),  # no organization: a local name
        ("runs/sft/checkpoints", None),
        ("./acme/model", None),
        ("acme--x/model", None),  # not a valid repository name
        ("acme/model:../escape", None),
    ],
)
def test_what_spells_an_id(value, parsed):
    assert HubId.parse(value) == parsed
    assert parsed is None or str(parsed) == value
