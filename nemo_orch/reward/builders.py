"""Builder from the validated config to the outcome scorer, for every caller that scores
(environments, Ray's scorer actors, the reward server)."""

from __future__ import annotations

from nemo_orch.config import Config
from nemo_orch.reward.outcome import AnswerScorer, OutcomeScorer
from nemo_orch.reward.remote import RemoteOutcomeScorer
from nemo_orch.tools.domain import build_domains


def build_scorer(config: Config, judge_in_flight: int | None = None) -> AnswerScorer:
    """The outcome scorer: the reward protocol, with the configured domains' databases and at
    most ``judge_in_flight`` judge requests at once (None: no bound); or, with
    ``reward.endpoint``, the reward server that runs it (at most ``judge_in_flight`` requests)."""
    if config.reward.endpoint is not None:
        return RemoteOutcomeScorer(
            config.reward.endpoint,
            timeout_s=config.reward.endpoint_timeout_s,
            max_retries=config.reward.endpoint_max_retries,
            max_in_flight=judge_in_flight,
            batch_size=config.reward.endpoint_batch_size,
        )
    return OutcomeScorer(
        config.reward, domains=build_domains(config.tools), judge_in_flight=judge_in_flight
    )
