"""``reward.*``: how finished groups of trajectories are scored."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_orch.config.base import _require
from nemo_orch.config.dialect import DEFAULT_DIALECT, parse_dialect

# The judge templates shipped in conf/reward/judges/ (see nemo_orch.reward.judge).
JUDGE_TEMPLATES = ("default", "reference", "hle_official")


@dataclass
class RewardConfig:
    """How finished groups of trajectories are scored (see :mod:`nemo_orch.reward`).

    ``combination``: ``toolorchestra`` (wrong -> 0; right -> preference-weighted sum of
    group-min-max-normalized features, cost and latency entering negated), ``weighted``
    (per-component group baselines, weighted: GDPO-style), ``linear`` (``linear_*``
    coefficients; USD and seconds divided by their references) or ``preference`` (the
    preference vector on a fixed scale, USD over ``usd_reference``, a right answer floored at
    0: the offline world's utility; the main job's default, ``reward=utility``). The LLM judge is used for answers
    that are neither empty, too long nor an exact match, when ``judge_base_url`` is set; each
    request gets ``judge_timeout_s`` and at most ``judge_max_retries`` retries (with backoff),
    after which the answer counts as a judge failure; the judge is asked in ``judge_dialect``
    (:mod:`nemo_orch.config.dialect`; ``openai-reasoning`` for gpt-5 or o3-mini, the reference's
    and HLE's judges), and one that refuses a parameter stops the run. With ``endpoint`` (a
    reward server's ``http://host:port``: ``nemo-orch serve reward``) answers are scored there,
    the answers scored together sent in requests of up to ``endpoint_batch_size`` (at most the
    server's ``serve.max_batch_size``), each request given ``endpoint_timeout_s`` and
    ``endpoint_max_retries``; the judge is then the server's.
    ``judge_template`` picks how the judge is asked and its reply read
    (``conf/reward/judges/NAME.yaml``): ``default`` (nemo-orch's one-word verdict), ``reference``
    (ToolOrchestra's ``<correct>True</correct>``) or ``hle_official`` (the official HLE judge's
    structured output).
    """

    combination: str = "preference"
    # A numeric answer matches the reference within this relative tolerance (math.isclose's).
    numeric_rel_tol: float = 1e-6
    # A numeric answer matches the reference within this absolute tolerance (math.isclose's).
    numeric_abs_tol: float = 1e-9
    # An answer longer than this many words is wrong, unread.
    max_answer_words: int = 500
    judge_base_url: Optional[str] = None
    # The judge's model name at judge_base_url.
    judge_model: Optional[str] = None
    # The environment variable holding the judge's API key (null: none sent).
    judge_api_key_env: Optional[str] = None
    judge_max_retries: int = 2
    judge_timeout_s: float = 60.0
    judge_template: str = "default"
    judge_dialect: Any = DEFAULT_DIALECT
    endpoint: Optional[str] = None
    endpoint_timeout_s: float = 300.0
    endpoint_max_retries: int = 2
    endpoint_batch_size: int = 64
    # weighted: weight of each component's group-baselined value
    weights: dict[str, float] = field(
        default_factory=lambda: {"outcome": 1.0, "cost": 0.3, "latency": 0.1, "preference": 0.2}
    )
    # linear: alpha * outcome - beta * usd/usd_reference - gamma * s/seconds_reference + delta * pref
    linear_alpha: float = 0.6
    # linear: the cost coefficient (USD over usd_reference).
    linear_beta: float = 0.25
    # linear: the latency coefficient (seconds over seconds_reference).
    linear_gamma: float = 0.1
    # linear: the preference coefficient.
    linear_delta: float = 0.05
    usd_reference: float = 0.01
    # Seconds that count as one unit of latency in the linear combination.
    seconds_reference: float = 10.0
    # advantages and filters

    # A trajectory's baseline is the mean reward of the rest of its group (else the group's).
    leave_one_out: bool = False
    # Advantages are clipped to [-advantage_clip, advantage_clip].
    advantage_clip: float = 3.0
    # Added to a group's reward std before dividing by it.
    advantage_eps: float = 1e-6
    # Trajectories with a format error get no loss.
    drop_format_errors: bool = False
    # Trajectories that never answered get no loss.
    drop_unanswered: bool = False
    # A group whose rewards spread less than this trains nothing (no signal for GRPO's group
    # baseline).
    min_group_std: float = 1e-6

    def __post_init__(self) -> None:
        _require(
            self.combination in ("toolorchestra", "weighted", "linear", "preference"),
            f"reward.combination must be toolorchestra|weighted|linear|preference, "
            f"got {self.combination!r}",
        )
        _require(
            self.numeric_rel_tol >= 0 and self.numeric_abs_tol >= 0,
            "reward.numeric_rel_tol and reward.numeric_abs_tol must be >= 0",
        )
        _require(self.max_answer_words >= 1, "reward.max_answer_words must be >= 1")
        _require(
            self.judge_base_url is None or self.judge_model is not None,
            "reward.judge_base_url needs reward.judge_model",
        )
        _require(
            self.judge_max_retries >= 0 and self.judge_timeout_s > 0,
            "reward.judge_max_retries must be >= 0 and reward.judge_timeout_s > 0",
        )
        _require(
            self.judge_template in JUDGE_TEMPLATES,
            f"reward.judge_template must be {'|'.join(JUDGE_TEMPLATES)}, "
            f"got {self.judge_template!r}",
        )
        parse_dialect(self.judge_dialect, "reward.judge_dialect")
        _require(
            self.endpoint is None or self.judge_base_url is None,
            "reward.endpoint scores on a reward server, which has its own judge: set "
            "reward.judge_base_url there, not here",
        )
        _require(
            self.endpoint_max_retries >= 0
            and self.endpoint_timeout_s > 0
            and self.endpoint_batch_size >= 1,
            "reward.endpoint_max_retries must be >= 0, reward.endpoint_timeout_s > 0 and "
            "reward.endpoint_batch_size >= 1",
        )
        _require(
            self.usd_reference > 0 and self.seconds_reference > 0,
            "reward.usd_reference and reward.seconds_reference must be > 0",
        )
        _require(
            self.advantage_clip > 0 and self.advantage_eps > 0,
            "reward.advantage_clip and reward.advantage_eps must be > 0",
        )
        _require(self.min_group_std >= 0, "reward.min_group_std must be >= 0")
