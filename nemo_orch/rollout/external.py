"""Train any agent loop: the OpenAI-compatible training endpoint (``rollout.agent=external``).

An agent loop of the user's own (a loop over the ``openai`` SDK, the OpenAI Agents SDK,
LangGraph, ...) runs each episode against this endpoint as it runs against a model in
production; the endpoint generates every turn with the rollouts' own engine and records it at the
token level, so GRPO, PPO and DPO train on exactly what the policy sampled. Each episode is the
built-in loop's :class:`~nemo_orch.rollout.episode.Episode` driven from outside: the same
sampling (each turn's seed from the episode's), parsing, decision marks, directed exploration,
observation truncation, turn limits, ledger and template checks; only who runs the tools and
decides when to stop differs.

Routes (``rollout.external.host:port``)::

    POST /v1/episodes/next {"wait_s"?}            -> {"episode": AgentEpisode | null}
    POST /sessions/{id}/v1/chat/completions       the episode's base URL (OpenAI chat, tools,
    GET  /sessions/{id}/v1/models                 streaming, logprobs)
    POST /v1/chat/completions                     the same, the episode's id in ``user``
    GET  /v1/models
    POST /sessions/{id}/tools/{name} {"arguments"} -> {"output", "error", "kind", "answer",
                                                       "cost_usd", "ended"}
    POST /sessions/{id}/end {"answer"?, "correct"?} -> {"termination"}

**Token in, token out.** A conversation the loop sends back is matched against the record: the
messages it sent before and the replies it got, compared by meaning (roles, texts, tool calls'
names and parsed arguments; call ids and formatting aside). When they match, the earlier turns
keep their recorded tokens -- the policy's sampled ids, never the loop's text tokenized again
-- and only the new messages (tool results, a user's words) are appended, cut from the chat
template's rendering as the built-in loop cuts observations. When they do not (the loop edited,
dropped or rewrote its history, or changed its tools), the episode starts a **new branch**: its
token record restarts from the loop's conversation rendered afresh (earlier assistant turns there
are context, loss mask 0), the policy's earlier tokens are left out of training, and
``Trajectory.branches`` counts it (GRPO logs ``rollout/branches``). Never silently merged.

**Tools.** The loop runs the policy's calls: with its own functions, or through the tool route,
which runs the environment's tool under the episode's context and bills it in the ledger (cost,
seconds, kind) as the built-in loop would; a call the policy's last turn did not make is refused
there. A call the loop runs itself is recorded with no cost. A tool result that answers (the
``answer`` tool) ends the episode.

**Sampling is the trainer's**: ``rollout.temperature``/``top_p``/``top_k``/``max_new_tokens`` and
each turn's seed; a request's sampling fields are ignored (GRPO's ratios need the sampling it
trains on). A request after the episode ended (an answer, ``rollout.max_turns`` turns, the
context full, the task's budget spent) gets a 409 naming why; an engine failure a 503.

**The end.** The loop reports it (``end``: its final answer where the policy's own turns gave
none, and ``correct`` if it scores the answer itself: that verdict replaces the environment's
outcome, the cost and preference terms still apply); a Python harness's return ends it too. An
episode whose end is not reported within ``rollout.external.episode_timeout_s``, or whose loop
raised, ends as ``agent_error``: an infrastructure failure, counted and never trained on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import json
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nemo_orch.clients import call_store
from nemo_orch.config import ExternalAgentConfig, RolloutConfig
from nemo_orch.models.tokenizer import escape_markup
from nemo_orch.rollout.agent_episode import STOPPED, AgentEpisode
from nemo_orch.rollout.episode import Episode, RolloutError, TokenHistory
from nemo_orch.rollout.format import ParsedTurn, ToolCall
from nemo_orch.rollout.opening import task_budget
from nemo_orch.rollout.trajectory import CallRecord, Termination, Trajectory, TurnRecord
from nemo_orch.serve.http_server import RequestError, ServerHandle, serve_json
from nemo_orch.serve.openai_requests import (
    chat_messages,
    request_field,
    request_tools,
    stream_options,
)
from nemo_orch.serve.openai_server import STREAMED_LOGPROBS, chat_completion, chat_stream

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0  # the longest a POST /v1/episodes/next waits for an episode
AGENT_ENDPOINT = "agent_endpoint.json"


def load_harness(spec: str) -> Callable[[AgentEpisode], Any]:
    """``module:function`` or ``path/to/file.py:function``: the agent loop to call per episode."""
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where)
            module_spec = importlib.util.spec_from_file_location(f"harness_{path.stem}", path)
            if module_spec is None or module_spec.loader is None or not path.is_file():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        return getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as error:
        raise RolloutError(f"rollout.external.harness={spec}: cannot load it: {error}") from None


def _same(recorded: dict[str, Any], sent: dict[str, Any]) -> bool:
    """Whether a message the loop sent back means the recorded one: its role, its text (a
    reply's with the surrounding whitespace aside) and its tool calls' names and arguments."""
    if recorded["role"] != sent["role"]:
        return False
    ours, theirs = recorded.get("content") or "", sent.get("content") or ""
    if recorded["role"] != "assistant":
        return ours == theirs

    def calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
        return [
            (call["function"]["name"], call["function"]["arguments"])
            for call in message.get("tool_calls") or []
        ]

    return ours.strip() == theirs.strip() and calls(recorded) == calls(sent)


def _ended(session: _Session) -> RequestError:
    return RequestError(
        f"episode {session.id} has ended ({session.termination}): report its end", 409, "conflict"
    )


class _Session:
    """One episode driven by an agent loop: its :class:`Episode`, token record, turns, the
    conversation as the loop holds it (``received``: its messages and the replies it got) and
    how it ended. Touched on the rollout loop only."""

    def __init__(self, episode: Episode, url: str, model: str) -> None:
        self.id, self.episode, self.url, self.model = secrets.token_hex(8), episode, url, model
        self.history: TokenHistory | None = None
        self.turns: list[TurnRecord] = []
        self.received: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self.text = ""  # the last turn's text
        self.pending: list[ToolCall] = []  # the last turn's valid calls not yet run
        self.termination: Termination | None = None
        self.answer: str | None = None
        self.correct: bool | None = None
        self.error: str | None = None
        self.branches = 0
        self.ended = asyncio.Event()
        self.started = time.perf_counter()
        self.calls = call_store.EpisodeScope(episode.scope_name)  # entered by each request

    def describe(self) -> AgentEpisode:
        episode = self.episode
        return AgentEpisode(
            id=self.id,
            url=self.url,
            model=self.model,
            task_id=episode.task.id,
            messages=[dict(message) for message in episode.messages],
            tools=episode.schemas,
        )

    # ------------------------------------------------------------------ the conversation
    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        stream, include_usage = stream_options(body)
        want_logprobs = request_field(body, "logprobs", bool, False)
        if stream and want_logprobs:
            raise RequestError(STREAMED_LOGPROBS)
        messages = chat_messages(body.get("messages"))
        tools = request_tools(body) or []
        if self.termination is not None:
            raise _ended(self)
        self._take(messages, tools)
        history = self.history
        assert history is not None  # _take made it
        start = len(history.ids)
        with call_store.within(self.calls):
            turn = await self.episode.policy_turn(history, len(self.turns), self.turns)
        if isinstance(turn, Termination):
            self._stop(turn)
            if turn == Termination.ENGINE_ERROR:  # the policy's infrastructure: nothing to wait for
                self.ended.set()
                raise RequestError(
                    f"the policy's engine failed: {self.turns[-1].finish_reason}",
                    503,
                    "server_error",
                )
            raise _ended(self)
        record, self.text, parsed = turn
        self.pending = [call for call in parsed.calls if call.valid]
        record.calls += [
            CallRecord(tool=call.name, arguments=call.arguments, error=call.error)
            for call in parsed.calls
            if not call.valid
        ]
        if parsed.answer is not None:
            self._stop(Termination.ANSWER, parsed.answer)
        return self._reply(record, start, want_logprobs, stream, include_usage)

    def _take(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
        """Make the record hold ``messages``: the first request's are the prompt; a later one's
        either extend the record (its new messages appended) or start a new branch."""
        if self.history is None:
            self._branch(messages, tools)
            return
        self._settle_calls()
        budget = task_budget(self.episode.task)
        if budget is not None and sum(turn.cost_usd for turn in self.turns) > budget:
            self._stop(Termination.BUDGET)
            raise _ended(self)
        known = len(self.received)
        new = messages[known:]
        if (
            tools == self.tools
            and new
            and all(_same(ours, theirs) for ours, theirs in zip(self.received, messages))
            and all(message["role"] != "assistant" for message in new)
        ):
            observations = [
                {
                    "role": message["role"],
                    "content": self.episode.observation(message["content"] or ""),
                }
                for message in new
            ]
            if not self.episode.append_messages(self.history, observations):
                self._stop(Termination.CONTEXT_LIMIT)
                raise _ended(self)
            self.received += new
        else:
            self.branches += 1
            log.info(
                "episode %s: the agent loop's conversation left the record: branch %d",
                self.id,
                self.branches,
            )
            self._branch(messages, tools)
        limit = self.episode.max_turns
        if limit is not None and len(self.turns) >= limit:
            self._stop(Termination.MAX_TURNS)
            raise _ended(self)

    def _branch(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
        """A token record from ``messages`` rendered afresh, all of it context."""
        self.tools, self.received = tools, list(messages)
        self.episode.offer(tools)
        tokenizer = self.episode.tokenizer
        self.episode.messages = [
            message
            if message["role"] == "assistant"
            else {
                "role": message["role"],
                "content": escape_markup(message["content"] or "", tokenizer),
            }
            for message in messages
        ]
        self.history = TokenHistory(
            self.episode.encode(self.episode.render(generation_prompt=True))
        )

    def _reply(
        self, record: TurnRecord, start: int, want_logprobs: bool, stream: bool, include_usage: bool
    ) -> dict[str, Any]:
        """The turn (its tokens from ``start``) as an OpenAI chat completion (``<tool_call>``
        markup as ``tool_calls``), kept in ``received`` as the loop will hold it."""
        history = self.history
        assert history is not None
        end = start + record.output_tokens
        tokenizer = self.episode.tokenizer
        response = chat_completion(
            self.model,
            self.text,
            record.finish_reason,
            (record.input_tokens, record.output_tokens),
            calls_turn=sum(m["role"] == "assistant" for m in self.received) if self.tools else None,
            token_logprobs=[
                (tokenizer.decode([token]), value)
                for token, value in zip(history.ids[start:end], history.logprobs[start:end])
            ]
            if want_logprobs
            else None,
        )
        self.received += chat_messages([response["choices"][0]["message"]])
        return chat_stream(response, include_usage) if stream else response

    # ------------------------------------------------------------------ tools and the end
    async def tool(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        arguments = request_field(body, "arguments", dict, {})
        if self.termination is not None:
            raise _ended(self)
        call = next((c for c in self.pending if c.name == name and c.arguments == arguments), None)
        if call is None:
            raise RequestError(
                f"the policy's last turn made no call {name}({json.dumps(arguments)}) "
                f"that is still to run",
                409,
                "conflict",
            )
        self.pending.remove(call)
        with call_store.within(self.calls):
            (result,) = await self.episode.run_calls(
                ParsedTurn(calls=[call]), self.turns[-1], self.text
            )
        if result.answer is not None:
            self._stop(Termination.ANSWER, result.answer)
        return {
            "output": result.observation,
            "error": result.error,
            "kind": str(result.kind),
            "answer": result.answer,
            "cost_usd": result.cost_usd,
            "ended": self.termination,
        }

    def _settle_calls(self) -> None:
        """The last turn's calls the loop ran itself: recorded, at no cost known here."""
        if self.turns:
            self.turns[-1].calls += [
                CallRecord(tool=call.name, arguments=call.arguments) for call in self.pending
            ]
        self.pending = []

    def _stop(self, termination: Termination, answer: str | None = None) -> None:
        if self.termination is None:
            self.termination, self.answer = termination, answer

    def end(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = request_field(body, "answer", str)
        self.correct = request_field(body, "correct", bool)
        self._settle_calls()
        if self.termination is None:
            self._stop(Termination.AGENT_STOP if answer is None else Termination.ANSWER, answer)
        elif (
            self.answer is None
            and answer is not None
            and self.termination != Termination.ENGINE_ERROR
        ):
            self.answer = answer
        self.ended.set()
        return {"termination": str(self.termination)}

    def fail(self, error: str) -> None:
        """The agent loop failed or abandoned the episode (unless it ended already)."""
        if not self.ended.is_set():
            self.termination, self.error = Termination.AGENT_ERROR, error
            self.ended.set()

    def trajectory(self) -> Trajectory:
        history = self.history or TokenHistory([])
        return self.episode.trajectory(
            history,
            self.turns,
            self.termination or Termination.AGENT_ERROR,
            self.answer,
            time.perf_counter() - self.started,
            agent_error=self.error,
            agent_correct=self.correct,
            branches=self.branches,
        )


class ExternalAgents:
    """The training endpoint (module docstring): ``run`` is the episode runner's agent
    (:func:`~nemo_orch.rollout.runner.run_episodes`), for at most ``max_episodes`` episodes in
    flight (``rollout.max_concurrent_episodes``). Start it on the rollout loop
    (``await start()``) and close it there."""

    def __init__(self, config: ExternalAgentConfig, model: str, max_episodes: int = 64) -> None:
        self.config, self.model, self.max_episodes = config, model, max_episodes
        self.harness = None if config.harness is None else load_harness(config.harness)
        self.sessions: dict[str, _Session] = {}
        self._queue: asyncio.Queue[_Session] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: ServerHandle | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._requests: set[concurrent.futures.Future] = set()  # touched by the HTTP threads
        self._closing = False
        self.url = ""

    async def start(self, directory: Path | None = None) -> str:
        """Serve the routes; returns the endpoint's URL (also written to ``directory``'s
        :data:`AGENT_ENDPOINT`, where loops in processes of their own find it)."""
        self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
        session = "/sessions/{session}"
        self._http = serve_json(
            {
                ("GET", "/v1/models"): lambda _: self._models(),
                ("GET", f"{session}/v1/models"): lambda _, session: self._models(),
                ("POST", "/v1/chat/completions"): lambda body: self._chat(body, None),
                ("POST", f"{session}/v1/chat/completions"): self._chat,
                ("POST", f"{session}/tools/{{tool}}"): self._tool,
                ("POST", f"{session}/end"): self._end,
                ("POST", "/v1/episodes/next"): self._next,
            },
            self.config.host,
            self.config.port,
            name="agent-endpoint",
        )
        self.url = f"http://{self._http.host}:{self._http.port}"
        if directory is not None:
            (directory / AGENT_ENDPOINT).write_text(json.dumps({"url": self.url}) + "\n")
        log.info("agent loops take episodes from %s/v1/episodes/next", self.url)
        if self.harness is not None:
            # A thread for every episode in flight: one waiting for a thread would run out
            # its time before it began.
            self._threads = concurrent.futures.ThreadPoolExecutor(
                self.max_episodes, thread_name_prefix="agent-loop"
            )
        return self.url

    async def close(self) -> None:
        self._closing = True
        for request in list(self._requests):  # requests waiting on the loop: answered 503
            request.cancel()
        if self._http is not None:
            await asyncio.to_thread(self._http.close)
        for session in list(self.sessions.values()):
            session.fail("the rollouts stopped")
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    async def run(self, episode: Episode) -> Trajectory:
        """``episode`` run by the agent loop: handed to the harness (or queued for loops that
        ask), its end awaited at most ``episode_timeout_s``."""
        if episode.user is not None:
            raise RolloutError(
                "rollout.agent=external: the agent loop talks to no user party; an environment "
                "with a user (tau2) needs rollout.agent=builtin"
            )
        session = _Session(episode, self.url, self.model)
        self.sessions[session.id] = session
        try:
            if self.harness is not None:
                asyncio.get_running_loop().run_in_executor(
                    self._threads, self._call_harness, session
                )
            else:
                await self._queue.put(session)
            try:
                await asyncio.wait_for(session.ended.wait(), self.config.episode_timeout_s)
            except TimeoutError:
                session.fail(
                    f"abandoned: no end reported within {self.config.episode_timeout_s:g} s "
                    "(rollout.external.episode_timeout_s)"
                )
        finally:
            del self.sessions[session.id]
        return session.trajectory()

    def _call_harness(self, session: _Session) -> None:
        """The harness on ``session``'s episode, in a thread of its own; its return ends the
        episode where it reported no end, its exception fails it."""
        try:
            self.harness(session.describe())
        except Exception as error:
            log.warning("the agent loop failed on episode %s", session.id, exc_info=True)
            self._loop.call_soon_threadsafe(
                session.fail, f"the agent loop raised {type(error).__name__}: {error}"
            )
            return
        self._loop.call_soon_threadsafe(lambda: None if session.ended.is_set() else session.end({}))

    # ------------------------------------------------------------------ routes
    def _on_loop(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """``coroutine``'s result, run on the rollout loop; a 503 once the rollouts end."""
        if self._closing:
            coroutine.close()
            raise RequestError("the rollouts have ended", STOPPED, "server_error")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        self._requests.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise RequestError("the rollouts have ended", STOPPED, "server_error") from None
        finally:
            self._requests.discard(future)

    def _session(self, session: str | None) -> _Session:
        found = self.sessions.get(session or "")
        if found is None:
            raise RequestError(
                f"no episode {session!r} is in flight (name it in the path "
                "/sessions/<id>/v1 or in 'user')",
                404,
                "not_found_error",
            )
        return found

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "nemo-orch"}],
        }

    def _chat(self, body: dict[str, Any], session: str | None) -> Any:
        model = request_field(body, "model", str)
        if model is not None and model != self.model:
            raise RequestError(
                f"the model '{model}' does not exist; this endpoint trains '{self.model}'",
                404,
                "not_found_error",
            )
        found = self._session(session or request_field(body, "user", str))
        return self._on_loop(found.chat(body))

    def _tool(self, body: dict[str, Any], session: str, tool: str) -> dict[str, Any]:
        return self._on_loop(self._session(session).tool(tool, body))

    def _end(self, body: dict[str, Any], session: str) -> dict[str, Any]:
        found = self._session(session)

        async def end() -> dict[str, Any]:
            return found.end(body)

        return self._on_loop(end())

    def _next(self, body: dict[str, Any]) -> dict[str, Any]:
        wait_s = float(request_field(body, "wait_s", (int, float), 30.0))
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise RequestError(f"'wait_s' must be in [0, {MAX_WAIT_S:g}]")

        async def take() -> dict[str, Any] | None:
            while True:  # an episode abandoned in the queue is not handed out
                try:
                    session = await asyncio.wait_for(self._queue.get(), wait_s)
                except TimeoutError:
                    return None
                if not session.ended.is_set():
                    return asdict(session.describe())

        return {"episode": self._on_loop(take())}


def external_agents(rollout: RolloutConfig, model: str) -> ExternalAgents | None:
    """The training endpoint ``rollout.agent=external`` asks for, serving the policy as
    ``model``; None for the built-in loop."""
    if rollout.agent != "external":
        return None
    return ExternalAgents(rollout.external, model, rollout.max_concurrent_episodes)
