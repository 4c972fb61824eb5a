"""Question / reference-answer files (:func:`nemo_orch.envs.qa.readers.read_qa`: JSONL,
JSON or parquet, columns configurable, GeneralThought-430K's as they are), with presets for
HLE and FRAMES (their published columns and rules); scored exact or numeric first, then by the
judge of ``reward.judge_*`` (a judge failure is counted, never silently scored wrong).
``train`` / ``validation`` split the file by a hash of the task id; ``test`` is the whole
file; ``notes["skipped"]`` counts the rows left out and why (e.g. HLE's image questions)."""

from __future__ import annotations

from nemo_orch.config import Config, EnvSourceConfig, resolve_conf_path
from nemo_orch.envs.qa import readers
from nemo_orch.data.tasks import Task
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
                path, id_column=source.id_column, question_columns=tuple(source.question_columns),
                answer_columns=tuple(source.answer_columns),
                documents_column=source.documents_column)
        self.notes["skipped"] = loaded.skipped
        return loaded.tasks
