"""Hugging Face Hub ids where the config takes a model, tokenizer or dataset directory.

These keys take a local path or a Hub id (a local path that exists always wins, as with
``from_pretrained``), and fetch only what they read:

* ``trainer.init_from``, ``rollout.policy``, ``env.retrieval.encoder.model`` (and each
  ``env.sources[i].retrieval.encoder.model``; ``nemo-orch index build|import --encoder`` too):
  an HF model repository, its config and generation config, safetensors weights and index,
  tokenizer and chat template;
* ``tokenizer.path``: a model repository's tokenizer and chat template;
* ``env.path`` (and each ``env.sources[i].path``): a dataset repository's ``.parquet``,
  ``.jsonl`` and ``.json`` files (its metadata, :data:`METADATA_FILES`, is never data);
* ``grpo.ppo.critic_init_from``: a model repository holding a nemo-orch critic checkpoint, every
  file of it.

Spelling: ``org/name[@revision][:path/in/repo]``. ``revision`` is a branch, a tag or a commit
hash (default ``main``); ``path`` a file or folder inside the repository (a model in a
subfolder, one file of a dataset). Without a path, a dataset resolves to its one data file, or
to the folder of its shards when they are the shards of one split
(``data/train-00000-of-00003.parquet`` ...; the readers take such a folder); anything else is
ambiguous and refused, listing the files to choose from (``env.path=org/name:data/test.jsonl``).
For example: ``trainer.init_from=Qwen/Qwen3-8B``, ``env=toolscale env.path=nvidia/ToolScale``
(its parquet file), ``env=qa env.path=natolambert/GeneralThought-430K-filtered``.

Resolution happens once, when the config is validated: each id is replaced by the local
snapshot directory (``<cache>/models--org--name/snapshots/<commit>``, or the file inside it), so
every check and reader downstream sees a local path. ``HF_HUB_CACHE`` / ``HF_HOME`` (the
cache), ``HF_TOKEN`` (private and gated repositories) and ``HF_HUB_OFFLINE`` are read from the
environment when the config is loaded.
A saved config (:func:`nemo_orch.config.to_yaml`) writes a snapshot path back as the pinned id
``org/name@<commit>[:path]``, so loading it elsewhere fetches, or finds in that machine's cache,
the same revision.

Offline (compute nodes without network): fetch on a node that has it, into the cache the jobs
use, by loading the config once there (``nemo-orch train ... --print-config`` downloads just
what the run reads) or with ``hf download org/name`` (``--repo-type dataset`` for datasets);
then run the jobs with ``HF_HUB_OFFLINE=1``. An id that is not in the cache then fails at load,
naming the key, the id and the cache.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants
from omegaconf import DictConfig, OmegaConf

from nemo_orch.config.base import ConfigError, resolve_conf_path

log = logging.getLogger(__name__)

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# The row files of datasets: what a dataset id fetches and nemo_orch.data.records reads (a
# directory of them: a split's shards).
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
# What the datasets library writes beside the rows (a .json that holds no rows).
METADATA_FILES = frozenset(
    {"dataset_infos.json", "dataset_info.json", "dataset_dict.json", "state.json"}
)


def is_data_file(path: Path) -> bool:
    """Whether ``path`` is a file of rows: a data suffix, and not the datasets library's
    metadata."""
    return (
        path.suffix.lower() in DATA_SUFFIXES and path.name not in METADATA_FILES and path.is_file()
    )


@dataclass(frozen=True)
class RepoKind:
    """What a key holds: the repository type, the files fetched (null: all) and the file that
    every such snapshot has (null: none to check)."""

    noun: str
    repo_type: str
    patterns: tuple[str, ...] | None
    marker: str | None

    def allow_patterns(self, path: str | None) -> list[str] | None:
        """The files to fetch: this kind's, under ``path`` when the id names one (and ``path``
        itself, when it is a file)."""
        if path is None:
            return None if self.patterns is None else list(self.patterns)
        return [path, *(f"{path}/{pattern}" for pattern in self.patterns or ("*",))]


MODEL = RepoKind(
    "model",
    "model",
    (
        "config.json",
        "generation_config.json",
        "*.safetensors",
        "*.safetensors.index.json",
        *_TOKENIZER_FILES,
    ),
    "config.json",
)
TOKENIZER = RepoKind("tokenizer", "model", _TOKENIZER_FILES, "tokenizer_config.json")
DATASET = RepoKind("dataset", "dataset", tuple(f"*{suffix}" for suffix in DATA_SUFFIXES), None)
# A nemo-orch checkpoint (Megatron shards, manifest, config): every file is needed.
CHECKPOINT = RepoKind("checkpoint", "model", None, "nemo_orch.json")

_KEYS = {
    "trainer.init_from": MODEL,
    "rollout.policy": MODEL,
    "tokenizer.path": TOKENIZER,
    "grpo.ppo.critic_init_from": CHECKPOINT,
}
# Under ``env`` and under each of a mixture's ``env.sources[i]``.
_SOURCE_KEYS = {"path": DATASET, "retrieval.encoder.model": MODEL}

_ID = re.compile(r"(?P<repo>[^/@:\s]+/[^/@:\s]+)(?:@(?P<revision>[^:\s]+))?(?::(?P<path>\S+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# datasets' push_to_hub names its shards so: data/train-00000-of-00003.parquet.
_SHARD = re.compile(r"(?P<split>.+)-\d{5}-of-(?P<count>\d{5})")


@dataclass(frozen=True)
class HubId:
    """``org/name[@revision][:path]``."""

    repo: str
    revision: str | None = None
    path: str | None = None

    @classmethod
    def parse(cls, value: str) -> HubId | None:
        """The id ``value`` spells, or None when it cannot be one (then it is a local path)."""
        match = _ID.fullmatch(value)
        if match is None or value.startswith((".", "~")):
            return None
        path = match["path"]
        if path is not None and (path.startswith("/") or ".." in Path(path).parts):
            return None
        from huggingface_hub.utils import HFValidationError, validate_repo_id  # a 0.1 s import

        try:
            validate_repo_id(match["repo"])
        except HFValidationError:
            return None
        return cls(match["repo"], match["revision"], path.rstrip("/") if path else None)

    def __str__(self) -> str:
        return (
            self.repo
            + (f"@{self.revision}" if self.revision else "")
            + (f":{self.path}" if self.path else "")
        )


def hub_cache_dir() -> Path:
    """The cache as the environment names it now: huggingface_hub reads ``HF_HUB_CACHE`` and
    ``HF_HOME`` once, when imported, and a process may set them later (a test, a launcher)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as the environment sets it now (read at call time, as the cache)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return (value or "").upper() in constants.ENV_VARS_TRUE_VALUES


def _hub_keys(tree: DictConfig) -> Iterator[tuple[str, RepoKind]]:
    """Every key of ``tree`` that takes a Hub id, with what it holds."""
    yield from _KEYS.items()
    sources = OmegaConf.select(tree, "env.sources") or []
    for prefix in ("env", *(f"env.sources[{index}]" for index in range(len(sources)))):
        for key, kind in _SOURCE_KEYS.items():
            yield f"{prefix}.{key}", kind


def resolve_hub_ids(tree: DictConfig) -> None:
    """Replace each Hub id of the keys that take one by the local path of its snapshot,
    fetching what the cache lacks. Local paths are left alone (resolving again is a no-op)."""
    for key, kind in _hub_keys(tree):
        value = OmegaConf.select(tree, key)
        resolved = resolve_path(value, kind, key) if isinstance(value, str) else value
        if resolved != value:
            OmegaConf.update(tree, key, resolved, merge=False)


def resolve_path(value: str, kind: RepoKind, key: str) -> str:
    """``value`` when it is a local path (relative: to the working directory, else ``conf/``)
    or cannot be an id (a missing path, left for the key's own check to name); else the local
    path of the Hub id it spells."""
    if resolve_conf_path(value).exists():
        return value
    hub_id = HubId.parse(value)
    return value if hub_id is None else str(_resolve(hub_id, kind, key))


def pin_hub_paths(tree: DictConfig) -> None:
    """The reverse, for a config that is saved: each snapshot path of the keys that take an id
    becomes the id pinned to its commit, ``org/name@<commit>[:path]``."""
    for key, kind in _hub_keys(tree):
        value = OmegaConf.select(tree, key)
        pinned = _pinned_id(value, kind) if isinstance(value, str) else None
        if pinned is not None:
            OmegaConf.update(tree, key, str(pinned), merge=False)


def _pinned_id(path: str, kind: RepoKind) -> HubId | None:
    """The id of a path inside a cached snapshot of ``kind``'s repository type
    (``.../<type>s--org--name/snapshots/<commit>[/path]``), else None."""
    parts = Path(path).parts
    for index in range(len(parts) - 2):
        folder = parts[index].split(constants.REPO_ID_SEPARATOR)
        if (
            len(folder) == 3
            and folder[0] == f"{kind.repo_type}s"
            and parts[index + 1] == "snapshots"
            and _COMMIT.fullmatch(parts[index + 2])
        ):
            inside = "/".join(parts[index + 3 :])
            return HubId(f"{folder[1]}/{folder[2]}", parts[index + 2], inside or None)
    return None


def _resolve(hub_id: HubId, kind: RepoKind, key: str) -> Path:
    """The local path of ``hub_id``'s snapshot (or of the file or folder inside it that
    ``key`` reads), fetched into :func:`hub_cache_dir` unless already there."""
    snapshot = _snapshot(hub_id, kind, key)
    if hub_id.path is not None:
        target = snapshot / hub_id.path
        if not target.exists():
            raise ConfigError(
                f"{key}: {hub_id}: the {kind.noun} repository has no file or folder {hub_id.path}"
            )
    elif kind is DATASET:
        target = _data_target(snapshot, hub_id, key)
    else:
        target = snapshot
    if kind.marker is not None and not (target / kind.marker).is_file():
        raise ConfigError(
            f"{key}: {hub_id}: no {kind.marker} in {target}: not a {kind.noun} "
            f"(or a partial download: fetch it again with the Hub reachable)"
        )
    return target


def _snapshot(hub_id: HubId, kind: RepoKind, key: str) -> Path:
    """The snapshot folder of ``hub_id`` in the cache, ``kind``'s files fetched into it unless
    offline; a failure is a :class:`ConfigError` naming ``key`` and the id."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = hub_cache_dir(), hub_offline()
    where = f"{key}: {hub_id}"
    if not offline:
        log.info("%s: resolving the %s on the Hugging Face Hub (cache %s)", where, kind.noun, cache)
    try:
        return Path(
            snapshot_download(
                hub_id.repo,
                repo_type=kind.repo_type,
                revision=hub_id.revision,
                allow_patterns=kind.allow_patterns(hub_id.path),
                cache_dir=cache,
                local_files_only=offline,
            )
        )
    except LocalEntryNotFoundError as error:
        cached = "only partly in" if isinstance(error, IncompleteSnapshotError) else "not in"
        reason = (
            "HF_HUB_OFFLINE=1"
            if offline
            else f"the Hub could not be reached ({type(error.__cause__ or error).__name__})"
        )
        raise ConfigError(
            f"{where} is {cached} the Hugging Face cache {cache} and {reason}: "
            f"fetch it where the Hub is reachable, into this cache "
            f"({_download_command(hub_id, kind)}, or load this config there "
            f"once); no local path {hub_id} exists either"
        ) from None
    except GatedRepoError:
        raise ConfigError(
            f"{where}: a gated {kind.noun} repository: accept its terms on the "
            f"Hub and set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{where}: neither a local path nor a {kind.repo_type} repository on "
            f"the Hugging Face Hub (a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(
            f"{where}: the {kind.repo_type} repository {hub_id.repo} has no "
            f"revision {hub_id.revision}"
        ) from None
    except HfHubHTTPError as error:
        raise ConfigError(
            f"{where}: the Hugging Face Hub refused the download ({str(error).splitlines()[0]})"
        ) from None


def _download_command(hub_id: HubId, kind: RepoKind) -> str:
    words = ["hf download", hub_id.repo]
    if kind.repo_type != "model":
        words.append(f"--repo-type {kind.repo_type}")
    if hub_id.revision:
        words.append(f"--revision {hub_id.revision}")
    return " ".join(words)


def _data_target(snapshot: Path, hub_id: HubId, key: str) -> Path:
    """A dataset snapshot's one data file, or the folder of one split's shards."""
    files = sorted(
        path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*") if is_data_file(path)
    )
    if not files:
        raise ConfigError(f"{key}: {hub_id}: the dataset holds no {', '.join(DATA_SUFFIXES)} file")
    if len(files) == 1:
        return snapshot / files[0]
    shards = _shard_folder(files)
    if shards is not None:
        return snapshot / shards
    listed = ", ".join(files[:8]) + (f", ... ({len(files) - 8} more)" if len(files) > 8 else "")
    raise ConfigError(
        f"{key}: {hub_id}: the dataset holds several data files ({listed}); name "
        f"the one to read: {key}={dataclasses.replace(hub_id, path=files[0])}"
    )


def _shard_folder(files: list[str]) -> str | None:
    """The folder of ``files`` when they are all the shards of one split, alone in it."""
    folders = {str(Path(file).parent) for file in files}
    shards = [_SHARD.fullmatch(Path(file).stem) for file in files]
    if len(folders) != 1 or not all(shards):
        return None
    splits = {(shard["split"], shard["count"]) for shard in shards}
    if len(splits) != 1 or int(next(iter(splits))[1]) != len(files):
        return None
    return folders.pop()
