"""PyTriton serving: the project's functions as Triton models, with dynamic batching.

A :class:`TextModel` is a function over items, each item a set of named UTF-8 text inputs, e.g.
the reward model's (problem, prediction, reference, metadata). Triton merges concurrent requests
into one batch; the wrapper here decodes and checks every request on its own, runs the model once
over the items of the valid ones and answers each request with its rows.

Bad input never takes the server down and never fails another client's request:

- wrong input names, dtypes or shapes, and more than ``max_batch_size`` items, are refused by
  Triton itself with a 400;
- a request whose content is bad (invalid UTF-8, an item over ``max_item_bytes``, a field the
  model cannot parse) is refused with a 400 whose message is the reason, one line (gRPC:
  INVALID_ARGUMENT); a model that fails answers ``<ExceptionType>: <message>`` (gRPC:
  INTERNAL), its traceback logged here (see :func:`_answer_errors_in_one_line`). When Triton
  merged a bad request with good ones, a 400 would fail those too (PyTriton answers a batch as
  a whole), so there it is answered with its ``error`` output set instead: every model has a
  text output ``error``, empty on success.
  :class:`~nemo_orch.clients.kserve.KServeClient` raises on both.

The bundled Triton server's Python helper would load the system's libpython instead of the
running interpreter's (PLATFORM.md); :func:`ensure_libpython` points the server's library path
at the interpreter's own before Triton starts, so users never set ``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nemo_orch.clients.kserve import ERROR_OUTPUT
from nemo_orch.config import ConfigError, ServeConfig
from nemo_orch.loop_thread import LoopThread
from nemo_orch.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

TEXT = bytes  # a text input or output: BYTES in Triton, UTF-8 here


MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


def _socket_name(model: str) -> str:
    """The longest name PyTriton gives a model's sockets in its workspace."""
    return f"{model}_0_0-server.sock"


class BadRequest(ValueError):
    """The content of a request is unusable; its message goes back to the client."""


@dataclass(frozen=True)
class TextModel:
    """A Triton model over items of named text inputs.

    ``parse`` turns one item (input name -> text) into what ``run`` takes, raising
    :class:`BadRequest` for unusable content; ``run`` answers a batch of parsed items, in order,
    each as a dict with a value for every output. ``outputs`` maps output names to numpy dtypes
    (``bytes`` for text). ``run`` runs on the server's event loop. ``descriptions``: one line
    for every input and output (and optionally ``model``), which clients read in the served
    configuration's ``parameters`` (see :func:`_parameters`).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: dict[str, type]
    parse: Callable[[dict[str, str]], Any]
    run: Callable[[list[Any]], Awaitable[list[dict[str, Any]]]]
    descriptions: Mapping[str, str]

    def __post_init__(self) -> None:
        if ERROR_OUTPUT in self.outputs or ERROR_OUTPUT in self.inputs:
            raise ValueError(f"{self.name}: '{ERROR_OUTPUT}' is reserved")
        tensors = {*self.inputs, *self.outputs}
        if missing := sorted(tensors - set(self.descriptions)):
            raise ValueError(f"{self.name}: no description of {', '.join(missing)}")
        if unknown := sorted(set(self.descriptions) - tensors - {"model"}):
            raise ValueError(f"{self.name}: descriptions of unknown tensors {', '.join(unknown)}")


ERROR_DESCRIPTION = "empty, or why this request was refused (it was merged with good ones)"


def _parameters(model: TextModel) -> dict[str, str]:
    """The model's descriptions as Triton configuration parameters: ``description`` (the
    model's), ``input.<name>`` and ``output.<name>``; Triton's inputs and outputs have no field
    of their own for it."""
    described = (
        {"description": model.descriptions["model"]} if "model" in model.descriptions else {}
    )
    described |= {f"input.{name}": model.descriptions[name] for name in model.inputs}
    described |= {f"output.{name}": model.descriptions[name] for name in model.outputs}
    return described | {f"output.{ERROR_OUTPUT}": ERROR_DESCRIPTION}


def _quiet_client_teardown() -> None:
    """Drop one known-harmless error: PyTriton 0.5.0 checks readiness with tritonclient's gevent
    HTTP client, whose destructor raises ``InvalidThreadUseError`` when the garbage collector
    runs it outside gevent's hub. Every other unraisable error still reaches the old hook."""
    previous = sys.unraisablehook
    if getattr(previous, "nemo_orch_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        owner = getattr(unraisable.object, "__qualname__", "")
        if not (
            owner == "InferenceServerClient.__del__"
            and type(unraisable.exc_value).__name__ == "InvalidThreadUseError"
        ):
            previous(unraisable)

    hook.nemo_orch_quiet = True
    sys.unraisablehook = hook


def ensure_libpython() -> None:
    """Put the running interpreter's library directory first on ``LD_LIBRARY_PATH``, which the
    Triton server (a child process) and its Python helper inherit."""
    libdir = sysconfig.get_config_var("LIBDIR")
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if libdir and (not paths or paths[0] != libdir):
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([libdir, *paths])


@dataclass
class _Request:
    """One request of a batch: its parsed items, or why it was refused; ``size`` is its batch
    dimension (what its answer's arrays must have)."""

    size: int
    items: list[Any] = field(default_factory=list)
    error: str | None = None


class _Batcher:
    """The infer function PyTriton calls with the requests Triton merged into one batch."""

    def __init__(
        self, model: TextModel, loop: LoopThread, metrics: ServeMetrics, max_item_bytes: int
    ) -> None:
        self.model, self.loop, self.metrics = model, loop, metrics
        self.max_item_bytes = max_item_bytes

    def __call__(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        started = time.perf_counter()
        parsed = [self._parse(request) for request in requests]
        items = [item for request in parsed for item in request.items]
        self.metrics.observe_batch(self.model.name, len(requests), len(items))
        bad = [request.error for request in parsed if request.error is not None]
        if len(bad) == len(parsed):
            self._observe(parsed, started)
            raise BadRequest("; ".join(dict.fromkeys(bad)))
        try:
            rows = self.loop.run(self.model.run(items))
        except Exception:
            log.exception("%s: a batch of %d items failed", self.model.name, len(items))
            self._observe(parsed, started, failed=True)
            raise
        if len(rows) != len(items):
            raise RuntimeError(f"{self.model.name}: {len(rows)} answers for {len(items)} items")
        answers, start = [], 0
        for request in parsed:
            count = len(request.items)
            answers.append(self._arrays(rows[start : start + count], request))
            start += count
        self._observe(parsed, started)
        return answers

    def _parse(self, request: Any) -> _Request:
        size = next(iter(request.values())).shape[0]  # Triton checked every input has it
        try:
            columns = {
                name: self._texts(name, request.data.get(name)) for name in self.model.inputs
            }
            counts = {len(values) for values in columns.values()}
            if len(counts) != 1:
                raise BadRequest("every input must carry the same number of items")
            rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
            return _Request(size, [self.model.parse(row) for row in rows])
        except BadRequest as error:
            return _Request(size, error=str(error))

    def _texts(self, name: str, array: np.ndarray | None) -> list[str]:
        if array is None:
            raise BadRequest(f"missing input '{name}'")
        texts = []
        for index, value in enumerate(array.reshape(-1)):
            if not isinstance(value, bytes):
                raise BadRequest(f"input '{name}' must be BYTES (UTF-8 text)")
            if len(value) > self.max_item_bytes:
                raise BadRequest(
                    f"input '{name}' item {index}: {len(value)} bytes > "
                    f"max_item_bytes={self.max_item_bytes}"
                )
            try:
                texts.append(value.decode("utf-8"))
            except UnicodeDecodeError as error:
                raise BadRequest(
                    f"input '{name}' item {index} is not valid UTF-8 "
                    f"({error.reason} at byte {error.start})"
                ) from None
        return texts

    def _arrays(self, rows: list[dict[str, Any]], request: _Request) -> dict[str, np.ndarray]:
        if request.error is not None:  # refused, but merged with good requests: see the module
            shape = (request.size, 1)
            return {
                ERROR_OUTPUT: np.full(shape, request.error.encode(), dtype=object),
                **{
                    name: np.full(shape, b"", dtype=object)
                    if dtype is TEXT
                    else np.zeros(shape, dtype=dtype)
                    for name, dtype in self.model.outputs.items()
                },
            }
        arrays = {ERROR_OUTPUT: np.array([[b""] for _ in rows], dtype=object)}
        for name, dtype in self.model.outputs.items():
            if dtype is TEXT:
                arrays[name] = np.array([[str(row[name]).encode()] for row in rows], dtype=object)
            else:
                arrays[name] = np.array([[row[name]] for row in rows], dtype=dtype)
        return arrays

    def _observe(self, parsed: list[_Request], started: float, failed: bool = False) -> None:
        seconds = time.perf_counter() - started
        for request in parsed:
            if failed:
                self.metrics.observe(self.model.name, "error", seconds, "model_error")
            elif request.error is not None:
                self.metrics.observe(self.model.name, "bad_request", seconds, "bad_content")
            else:
                self.metrics.observe(self.model.name, "ok", seconds)


def _repository(directory: Path, models: Sequence[TextModel]) -> Path:
    """A model repository naming the served models, so that its index (``POST
    /v2/repository/index``, tritonclient's ``get_model_repository_index``) lists them. PyTriton
    loads each model with a config and files of its own, which take precedence over what is
    here; without this the index would list PyTriton's workspace (``tritonserver``)."""
    for model in models:
        (directory / model.name / "1").mkdir(parents=True)
        (directory / model.name / "config.pbtxt").write_text(
            f'name: "{model.name}"\nbackend: "python"\n'
        )
    return directory


def _describe(bound: Any, model: TextModel) -> None:
    """Put the model's descriptions into the configuration PyTriton generates for it. PyTriton
    0.5.0 (pinned, PLATFORM.md) has no setting for configuration parameters; it writes its
    cached config's ``backend_parameters`` as ``parameters``, so they are added there before
    ``run`` loads the model (``tests/serve/test_triton.py`` reads them back from Triton)."""
    config = bound._get_triton_model_config()
    described = _parameters(model)
    if clash := set(config.backend_parameters) & set(described):
        raise RuntimeError(f"{model.name}: PyTriton already sets {', '.join(sorted(clash))}")
    config.backend_parameters.update(described)


# PyTriton 0.5.0's proxy model (pytriton/proxy/model.py, the file PyTriton loads into Triton for
# every model) raises the inference function's error, and Triton answers it with the tracebacks
# of both processes, server paths included. Here the proxy answers each request with an error
# response of one line instead, as PyTriton's own decoupled path does: a bad request's reason
# (gRPC status INVALID_ARGUMENT), else the failure's last line (INTERNAL); Triton's HTTP server
# answers both with 400. The traceback stays in the server's log (`_Batcher`).
_PROXY_RAISES = """\
                    triton_responses_or_error = pb_utils.TritonModelException(  # pytype: disable=module-attr
                        responses_payload.decode("utf-8")
                    )
"""
_PROXY_ANSWERS = """\
                    triton_responses_or_error = _one_line_errors(
                        triton_requests, responses_payload.decode("utf-8")
                    )
"""
_ONE_LINE_ERRORS = f"""

def _one_line_errors(triton_requests, formatted):  # added by nemo-orch (nemo_orch/serve/triton.py)
    raised = formatted.strip().splitlines()[-1]  # the traceback's last line: "type: message"
    refused = "{BadRequest.__module__}.{BadRequest.__qualname__}: "
    if raised.startswith(refused):
        message, code = raised[len(refused):], pb_utils.TritonError.INVALID_ARG
    else:
        message, code = raised, pb_utils.TritonError.INTERNAL
    return [pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
            for _ in triton_requests]
"""


def _answer_errors_in_one_line(bound: Any) -> None:
    """Load ``bound`` (a PyTriton model) with the proxy above."""
    files = bound.get_proxy_model_files()
    key = next(name for name in files if name.endswith("/model.py"))
    proxy = files[key].decode()
    if proxy.count(_PROXY_RAISES) != 1:
        raise RuntimeError(
            "PyTriton's proxy model is not 0.5.0's (pinned, PLATFORM.md): "
            "nemo_orch/serve/triton.py cannot answer its errors in one line"
        )
    files[key] = (proxy.replace(_PROXY_RAISES, _PROXY_ANSWERS) + _ONE_LINE_ERRORS).encode()
    bound.get_proxy_model_files = lambda: files


class TritonServer:
    """Running Triton models (see :func:`serve_models`); ``close`` stops Triton, releases the
    resources, stops the models' loop and the metrics export, and removes PyTriton's
    workspace."""

    def __init__(
        self,
        models: Sequence[TextModel],
        config: ServeConfig,
        resources: Sequence[AbstractAsyncContextManager] = (),
    ) -> None:
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig

        # PyTriton logs every refused request with two tracebacks; the metrics count them and
        # failures of the models themselves are logged here.
        logging.getLogger("pytriton.proxy.inference").setLevel(logging.ERROR)
        self.models = list(models)
        self.host = config.host
        self._resources = AsyncExitStack()
        self.metrics = ServeMetrics("triton")
        self.workspace = Path(
            tempfile.mkdtemp(prefix="nemo-orch-triton-", dir=config.workspace_root)
        )
        longest = max(len(_socket_name(model.name)) for model in self.models)
        if len(str(self.workspace / "t")) + 1 + longest > MAX_SOCKET_PATH:
            self.workspace.rmdir()
            raise ConfigError(
                f"serve.workspace_root: PyTriton's sockets under {self.workspace} "
                f"would be longer than {MAX_SOCKET_PATH} characters, the limit of "
                "a UNIX socket path; choose a shorter directory"
            )
        self.loop = LoopThread("triton-models")
        self._triton = None
        try:
            for resource in resources:
                self.loop.run(self._resources.enter_async_context(resource))
            ensure_libpython()
            _quiet_client_teardown()
            triton_config = TritonConfig(
                http_address=config.host,
                http_port=config.http_port,
                grpc_address=config.host,
                grpc_port=config.grpc_port,
                allow_metrics=False,
                exit_timeout_secs=config.shutdown_timeout_s,
                log_file=self.workspace / "tritonserver.log",
                model_repository=_repository(self.workspace / "models", self.models),
            )
            # PyTriton makes its workspace itself; the short name keeps its socket paths short.
            self._triton = Triton(config=triton_config, workspace=self.workspace / "t")
            for model in self.models:
                self._triton.bind(
                    model_name=model.name,
                    infer_func=_Batcher(model, self.loop, self.metrics, config.max_item_bytes),
                    inputs=[Tensor(name=name, dtype=TEXT, shape=(1,)) for name in model.inputs],
                    outputs=[Tensor(name=ERROR_OUTPUT, dtype=TEXT, shape=(1,))]
                    + [
                        Tensor(name=name, dtype=dtype, shape=(1,))
                        for name, dtype in model.outputs.items()
                    ],
                    config=ModelConfig(
                        max_batch_size=config.max_batch_size,
                        batcher=DynamicBatcher(
                            max_queue_delay_microseconds=config.max_queue_delay_us
                        ),
                    ),
                    strict=True,
                )
                bound = next(
                    m for m in self._triton._model_manager.models if m.model_name == model.name
                )
                _describe(bound, model)
                _answer_errors_in_one_line(bound)
            self._triton.run()
            self.metrics_port = (
                None
                if config.metrics_port is None
                else self.metrics.serve(config.host, config.metrics_port)
            )
        except BaseException:
            self.close()
            raise
        self.url = f"http://{config.host}:{config.http_port}"
        self.grpc_url = f"grpc://{config.host}:{config.grpc_port}"

    def close(self) -> None:
        if self._triton is not None:
            self._triton.stop()
            self._triton = None
        self.metrics.close()
        if self.loop.alive:
            self.loop.run(self._resources.aclose())
            self.loop.stop()
        shutil.rmtree(self.workspace, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_models(
    models: Sequence[TextModel],
    config: ServeConfig,
    resources: Sequence[AbstractAsyncContextManager] = (),
) -> TritonServer:
    """Start ``models`` in one Triton server on ``config.host``, after entering ``resources``
    (what the models use, e.g. a toolbox) on their event loop; returns once Triton answers.
    Stop it with ``close`` (or ``with``)."""
    return TritonServer(models, config, resources)
