"""``env.*``: where every stage's tasks come from (one source or a weighted mixture)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_orch.config.base import _require, resolve_conf_path
from nemo_orch.config.dialect import DEFAULT_DIALECT, parse_dialect

ENV_KINDS = ("offline", "toolscale", "tau2", "qa", "tasks", "mixture")
# `nemo-orch eval --benchmark NAME` is `env=NAME`: the presets of conf/env/ that name one source.
BENCHMARKS = ("offline", "toolscale", "tau2", "qa", "hle", "frames", "tasks")
QA_PRESETS = ("hle", "frames")
RETRIEVAL_SCOPES = ("open", "whitelist", "oracle")
ENCODER_POOLINGS = ("mean", "last_token", "cls")
ENCODER_PRESETS = ("qwen3-embedding", "e5", "bge")
# Which options each kind reads (beyond kind, name, weight, limit and tools); another one set is
# a mistake, not silently ignored.
_KIND_OPTIONS = {
    "offline": set(),
    "toolscale": {"path", "domain"},
    "tau2": {"domain", "split", "user", "tau2_domains", "path"},
    "qa": {
        "path",
        "preset",
        "id_column",
        "question_columns",
        "answer_columns",
        "documents_column",
        "retrieval",
    },
    "tasks": {"path"},
}


def _field_default(cls: type, name: str) -> object:
    (found,) = [item for item in dataclasses.fields(cls) if item.name == name]
    return found.default_factory() if found.default is dataclasses.MISSING else found.default


@dataclass
class UserConfig:
    """tau2's user (``env.user``): with ``base_url`` null, the scenario is stated up front and
    no one answers (not comparable with tau2-bench); with it set, an LLM behind that
    OpenAI-compatible endpoint plays tau2's user simulator (its system prompt, guidelines, message
    conversion and stop rule), served through the project's HTTP client (``timeout_s``,
    ``max_retries``, ``max_in_flight``, the key read from ``api_key_env``).

    ``max_steps`` and ``max_errors`` end an episode as tau2's orchestrator does (each agent,
    user or tool-results message is a step; each failed tool call, either side's, an error).
    The user's tokens are priced at ``input_usd_per_million`` / ``output_usd_per_million``
    (null: ``model``'s list price where ``tools/pricing.py`` knows it, else 0) and kept apart
    from the orchestrator's and the experts' cost. ``seed`` (null: the episode's, so each trial
    of a task has its own) is sent with every request. ``dialect``: how the endpoint is asked
    (:mod:`nemo_orch.config.dialect`; ``openai-reasoning`` for gpt-5, the reference's user, which
    takes no temperature or top_p)."""

    base_url: Optional[str] = None
    # The user's model name at base_url.
    model: Optional[str] = None
    api_key_env: Optional[str] = None
    # Sampling temperature of the user's replies (tau2's DEFAULT_LLM_ARGS_USER).
    temperature: float = 0.0
    # Nucleus sampling of the user's replies (null: not sent).
    top_p: Optional[float] = None
    # Most tokens of each user reply (null: not sent).
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    timeout_s: float = 120.0
    max_retries: int = 3
    max_in_flight: int = 16
    input_usd_per_million: Optional[float] = None
    output_usd_per_million: Optional[float] = None
    max_steps: int = 200
    max_errors: int = 10
    dialect: Any = DEFAULT_DIALECT

    @property
    def simulated(self) -> bool:
        """An LLM plays the user (tau2's protocol)."""
        return self.base_url is not None

    def _check(self, where: str) -> None:
        _require(
            self.base_url is None or self.model is not None,
            f"{where}.model: an LLM user needs its model name ({where}.base_url is set)",
        )
        _require(
            self.max_steps >= 1 and self.max_errors >= 1,
            f"{where}.max_steps and {where}.max_errors must be >= 1",
        )
        _require(
            self.timeout_s > 0 and self.max_retries >= 0 and self.max_in_flight >= 1,
            f"{where}: need timeout_s > 0, max_retries >= 0 and max_in_flight >= 1",
        )
        parse_dialect(self.dialect, f"{where}.dialect")


@dataclass
class EncoderConfig:
    """The encoder an index was built with (``env.retrieval.encoder``): ``model`` ``hashing``
    (the offline default) or a local Hugging Face model directory; for the latter, ``preset``
    (``qwen3-embedding``: last-token pooling, the reference's instruction before queries only;
    ``e5``, ``bge``) and ``pooling`` / ``query_prefix`` / ``document_prefix`` over it (null:
    the preset's, else mean pooling and no prefix)."""

    model: str = "hashing"
    preset: Optional[str] = None
    pooling: Optional[str] = None
    query_prefix: Optional[str] = None
    document_prefix: Optional[str] = None
    # Most tokens of a text the encoder reads.
    max_length: int = 512

    def options(self) -> str | dict[str, object]:
        """What :func:`nemo_orch.tools.encoders.make_encoder` takes."""
        if self.model == "hashing":
            return "hashing"
        return {
            "model_dir": str(resolve_conf_path(self.model)),
            "preset": self.preset,
            "pooling": self.pooling,
            "query_prefix": self.query_prefix,
            "document_prefix": self.document_prefix,
            "max_length": self.max_length,
        }

    def _check(self, where: str) -> None:
        hf = self.model != "hashing"
        _require(
            not hf or resolve_conf_path(self.model).is_dir(),
            f"{where}.model: neither 'hashing' nor a local Hugging Face model directory: "
            f"{self.model}",
        )
        _require(
            hf
            or (self.preset, self.pooling, self.query_prefix, self.document_prefix) == (None,) * 4,
            f"{where}: the hashing encoder takes no preset, pooling or prefix",
        )
        _require(
            self.preset in (None, *ENCODER_PRESETS),
            f"{where}.preset must be null|{'|'.join(ENCODER_PRESETS)}, got {self.preset!r}",
        )
        _require(
            self.pooling in (None, *ENCODER_POOLINGS),
            f"{where}.pooling must be null|{'|'.join(ENCODER_POOLINGS)}, got {self.pooling!r}",
        )
        _require(self.max_length >= 1, f"{where}.max_length must be >= 1")


@dataclass
class RetrievalConfig:
    """How a question-answering benchmark retrieves (``env.retrieval``): what ``search``'s
    query, once written, brings its expert (:class:`~nemo_orch.tools.document_search.
    DocumentSearch`).

    ``scope``: which documents a question may get. ``open``: the whole index; ``whitelist``: the
    ids ``whitelist`` (a JSON file ``{question id: [doc ids]}``, the reference's
    ``examples.json``) lists for the question, kept from the ``depth`` best hits of the whole
    index, as the reference filters; ``oracle``: the row's own documents (FRAMES' ``wiki_links``,
    a ``qa`` file's ``documents_column``), searched exactly; not comparable with the reference,
    which never hands a question its gold pages.

    ``index``: the index directory (``nemo-orch index build`` / ``index import``; null: no local
    index, web search only) and ``encoder`` the encoder it was built with; ``mode``: ``dense``
    (the reference's), ``hybrid`` or ``sparse``; ``depth``: hits fetched per query;
    ``score_threshold``: keep hits whose dense cosine score is above it (dense mode only: fused
    ranks have no such scale); ``top_k``: documents handed on (each cut at
    ``max_chars_per_doc``; the expert reads what fits its context budget); fewer than
    ``fallback_below`` left: the fallback web search (the ``search`` tool's ``fallback`` part)
    runs the query too (0: never).

    The policy's own ``retriever`` calls (its ``top_k`` up to the declaration's ``max_top_k``)
    are not governed by this, only by the scope.
    """

    scope: str = "open"
    whitelist: Optional[str] = None
    index: Optional[str] = None
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    mode: str = "dense"
    depth: int = 150
    score_threshold: Optional[float] = None
    top_k: int = 150
    max_chars_per_doc: int = 2000
    fallback_below: int = 0

    def describe(self) -> str:
        """The setting, one line for every report."""
        source = {
            "open": "the whole index",
            "whitelist": f"the question's whitelist ({self.whitelist})",
            "oracle": "ORACLE: each question's own documents; not comparable with the reference",
        }[self.scope]
        if self.index is None:
            return f"{self.scope}: {source}; no local index: web search only"
        threshold = "" if self.score_threshold is None else f", cosine > {self.score_threshold:g}"
        fallback = (
            f", web search below {self.fallback_below} documents" if self.fallback_below else ""
        )
        return (
            f"{self.scope}: {source}; {self.mode} top {self.depth}{threshold} -> "
            f"{self.top_k} documents to the expert{fallback}"
        )

    def _check(self, where: str) -> None:
        _require(
            self.scope in RETRIEVAL_SCOPES,
            f"{where}.scope must be {'|'.join(RETRIEVAL_SCOPES)}, got {self.scope!r}",
        )
        _require(
            (self.scope == "whitelist") == (self.whitelist is not None),
            f"{where}.whitelist: scope whitelist needs a JSON file of question id -> "
            f"document ids (or set {where}.scope=open)"
            if self.scope == "whitelist"
            else f"{where}.whitelist: only scope whitelist reads one (scope is {self.scope})",
        )
        for key in ("whitelist", "index"):
            value = getattr(self, key)
            _require(
                value is None or resolve_conf_path(value).exists(),
                f"{where}.{key}: no such file or directory: {value}",
            )
        self.encoder._check(f"{where}.encoder")
        _require(
            self.mode in ("dense", "hybrid", "sparse"),
            f"{where}.mode must be dense|hybrid|sparse, got {self.mode!r}",
        )
        _require(
            self.score_threshold is None or self.mode == "dense",
            f"{where}.score_threshold applies to the dense cosine score: set {where}.mode="
            f"dense (the {self.mode} search's scores are fused ranks or BM25's) or drop "
            "the threshold",
        )
        _require(
            self.depth >= 1 and 1 <= self.top_k <= self.depth,
            f"{where}: need depth >= 1 and 1 <= top_k <= depth (got depth {self.depth}, "
            f"top_k {self.top_k})",
        )
        _require(
            self.fallback_below >= 0 and self.max_chars_per_doc >= 1,
            f"{where}: need fallback_below >= 0 and max_chars_per_doc >= 1",
        )


@dataclass
class EnvSourceConfig:
    """One task source: an environment of ``kind`` (:data:`ENV_KINDS`, less ``mixture``) with its
    options. ``name`` labels it in metrics and reports (null: the kind, or the preset).

    * ``offline``: the main job's world (tasks generated from the run's seed);
    * ``toolscale``: domain tasks; ``path`` a directory of ``<domain>/domain.json`` +
      ``tasks.jsonl`` (null: ``synth.out_dir``) or a ToolScale ``.parquet`` file or the folder of
      a split's shards (its rows run on the installed domains of ``tools.domains``); ``domain``:
      one domain (null: all);
    * ``tau2``: tau2-bench's ``domain`` (extra ``tau2``); evaluation runs its ``split``,
      training its ``train`` split; ``user``: who answers the agent (:class:`UserConfig`);
      ``tau2_domains``: directories registered with tau2 as domains of their own, each named by
      its directory and in tau2's layout (``tools.py``, ``data_model.py``, ``db.json``,
      ``policy.md``, optionally ``tasks.json``; see :mod:`nemo_orch.envs.tau2.external`);
      ``path``: the domain's tasks instead of its own, the rows of a ToolScale ``.parquet``
      file in the published layout (or a ``.json`` / ``.jsonl`` list of tau2 tasks) whose
      ``user_scenario.instructions.domain`` is ``domain``; a file is one task set, no splits;
    * ``qa``: question / reference-answer rows, ``path`` a ``.jsonl``, ``.json`` or ``.parquet``
      file, columns ``id_column``, the first present of ``question_columns`` and of
      ``answer_columns``, optionally ``documents_column`` (the ids retrieval may return);
      ``preset`` ``hle`` or ``frames`` reads the benchmark's published columns instead;
    * ``tasks``: a task JSONL file (``path``; the format of ``nemo-orch rollout --tasks``).

    A relative ``path`` is read from the working directory, else from ``conf/`` (where samples
    ship).

    ``limit``: only the first N tasks (after filters). ``weight`` (> 0): a mixture's share of
    each step's prompts. ``tools``: tool declarations offered beside the environment's own
    tools (a domain's, tau2's); null: ``tools.declarations`` (the ``tools=`` group), except for
    tau2, whose protocol has only its domain's tools.
    """

    kind: str = "offline"
    name: Optional[str] = None
    path: Optional[str] = None
    domain: Optional[str] = None
    split: str = "test"
    limit: Optional[int] = None
    weight: float = 1.0
    tools: Optional[list[str]] = None
    preset: Optional[str] = None
    id_column: str = "id"
    question_columns: list[str] = field(default_factory=lambda: ["question", "problem", "prompt"])
    answer_columns: list[str] = field(
        default_factory=lambda: ["answer", "reference_answer", "reference", "solution"]
    )
    documents_column: Optional[str] = None
    user: UserConfig = field(default_factory=UserConfig)
    tau2_domains: list[str] = field(default_factory=list)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)

    @property
    def label(self) -> str:
        return self.name or self.preset or self.kind

    def _check(self, where: str) -> None:
        _require(
            self.kind in ENV_KINDS
            and self.kind != "mixture"
            or isinstance(self, EnvConfig)
            and self.kind == "mixture",
            f"{where}.kind: unknown environment kind {self.kind!r}; kinds: {', '.join(ENV_KINDS)}",
        )
        if self.kind == "mixture":
            return
        for option in set().union(*_KIND_OPTIONS.values()) - _KIND_OPTIONS[self.kind]:
            _require(
                getattr(self, option) == _field_default(EnvSourceConfig, option),
                f"{where}.{option}: a {self.kind} environment has no option {option} "
                f"(its options: {', '.join(sorted(_KIND_OPTIONS[self.kind])) or 'none'})",
            )
        _require(self.limit is None or self.limit >= 1, f"{where}.limit must be null or >= 1")
        _require(self.weight > 0, f"{where}.weight must be > 0")
        _require(
            self.path is None or resolve_conf_path(self.path).exists(),
            f"{where}.path: no such file or directory: {self.path}",
        )
        for index, path in enumerate(self.tools or []):
            _require(
                resolve_conf_path(path).exists(),
                f"{where}.tools[{index}]: no such file or directory: {path}",
            )
        for index, path in enumerate(self.tau2_domains):
            _require(
                resolve_conf_path(path).is_dir(),
                f"{where}.tau2_domains[{index}]: no such directory: {path}",
            )
        _require(
            self.preset in (None, *QA_PRESETS),
            f"{where}.preset must be null|{'|'.join(QA_PRESETS)}, got {self.preset!r}",
        )
        _require(
            self.kind not in ("qa", "tasks") or self.path is not None,
            f"{where}.path: a {self.kind} environment reads a file: set {where}.path (a "
            "local file, or a Hugging Face dataset id: org/name[@revision][:file])",
        )
        self.user._check(f"{where}.user")
        self.retrieval._check(f"{where}.retrieval")
        _require(
            self.retrieval.scope != "oracle"
            or self.preset == "frames"
            or self.documents_column is not None,
            f"{where}.retrieval.scope=oracle reads each row's own documents: FRAMES' "
            f"wiki_links (preset frames) or a documents_column",
        )
        _require(
            self.documents_column is None or self.retrieval.scope == "oracle",
            f"{where}.documents_column: a row's own documents are read only by "
            f"{where}.retrieval.scope=oracle (scope is {self.retrieval.scope})",
        )
        _require(
            self.kind != "tau2" or self.domain is not None,
            f"{where}.domain: a tau2 environment needs its domain (airline, retail, "
            "telecom, mock, or a directory's name in tau2_domains)",
        )


@dataclass
class EnvConfig(EnvSourceConfig):
    """Where every stage's tasks come from (``conf/env/``): one source (the fields of
    :class:`EnvSourceConfig`) or, with ``kind: mixture``, the weighted ``sources``; each step of
    GRPO draws its prompts from them by weight with the step's seed. ``val_fraction``: the share
    of a file's or a training split's tasks held out for validation (by a hash of the task id,
    so the split never depends on order or seed)."""

    sources: list[EnvSourceConfig] = field(default_factory=list)
    val_fraction: float = 0.05

    def __post_init__(self) -> None:  # a source is checked here, where its index is known
        self._check("env")
        _require(0 <= self.val_fraction < 1, "env.val_fraction must be in [0, 1)")
        if self.kind != "mixture":
            _require(not self.sources, "env.sources: only kind=mixture has sources")
            return
        _require(len(self.sources) >= 1, "env.sources: a mixture needs at least one source")
        for index, source in enumerate(self.sources):
            source._check(f"env.sources[{index}]")
        labels = [source.label for source in self.sources]
        _require(
            len(set(labels)) == len(labels),
            f"env.sources: two sources are labelled alike ({', '.join(labels)}); give "
            "them distinct names",
        )

    def source_list(self) -> list[EnvSourceConfig]:
        """The sources: a mixture's, or this one."""
        return list(self.sources) if self.kind == "mixture" else [self]
