"""Question / reference-answer files (:func:`nemo_orch.envs.qa.readers.read_qa`: JSONL,
JSON or parquet, columns configurable, GeneralThought-430K's as they are), with presets for
HLE and FRAMES (their published columns and rules); scored exact or numeric first, then by the
judge of ``reward.judge_*`` (a judge failure is counted, never silently scored wrong).
``train`` / ``validation`` split the file by a hash of the task id; ``test`` is the whole
file; ``notes["skipped"]`` counts the rows left out and why (e.g. HLE's image questions).

``env.retrieval.scope`` sets what each question may retrieve (its ``allowed_documents``): the
whole index (``open``), its whitelist entry (``whitelist``) or the row's own documents
(``oracle``); ``notes["retrieval"]`` states the setting in every report."""

from __future__ import annotations

import dataclasses

from nemo_orch.config import Config, EnvSourceConfig, resolve_conf_path
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.tasks import Task
from nemo_orch.envs.qa import readers
from nemo_orch.envs.tasks import TaskFileEnvironment


class QAEnvironment(TaskFileEnvironment):
    def read(self, config: Config, source: EnvSourceConfig) -> list[Task]:
        assert source.path is not None  # checked when the config was loaded
        path = resolve_conf_path(source.path)
        if source.preset == "hle":
            loaded = readers.read_hle(path)
        elif source.preset == "frames":
            loaded = readers.read_frames(path)
        else:
            loaded = readers.read_qa(
                path,
                id_column=source.id_column,
                question_columns=tuple(source.question_columns),
                answer_columns=tuple(source.answer_columns),
                documents_column=source.documents_column,
            )
        self.notes["skipped"] = loaded.skipped
        self.notes["retrieval"] = source.retrieval.describe()
        return scoped(loaded.tasks, source)


def scoped(tasks: list[Task], source: EnvSourceConfig) -> list[Task]:
    """The tasks with the documents ``source.retrieval.scope`` lets each retrieve."""
    setting = source.retrieval
    if setting.scope == "oracle":
        missing = [task.id for task in tasks if task.allowed_documents is None]
        if missing:
            raise DataError(
                f"{source.path}: retrieval scope oracle, but {len(missing)} rows "
                f"have no documents of their own (e.g. {missing[:3]})"
            )
        return tasks
    if setting.scope == "open":
        return [dataclasses.replace(task, allowed_documents=None) for task in tasks]
    assert setting.whitelist is not None  # checked when the config was loaded
    whitelist = readers.read_whitelist(resolve_conf_path(setting.whitelist))
    missing = [task.id for task in tasks if task.id not in whitelist]
    if missing:
        raise DataError(
            f"{setting.whitelist}: no whitelist entry for {len(missing)} of "
            f"{len(tasks)} questions of {source.path} (e.g. {missing[:3]})"
        )
    return [dataclasses.replace(task, allowed_documents=whitelist[task.id]) for task in tasks]
