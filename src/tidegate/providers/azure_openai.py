"""The ``azure_openai`` provider type: one Azure OpenAI deployment (docs/providers/azure_openai.md).

The body is the OpenAI Chat Completions body, so this module reuses the OpenAI provider's
reading of answers, errors and streams (:func:`~tidegate.providers.openai.openai_answer`,
:func:`~tidegate.providers.openai.openai_error_for`,
:func:`~tidegate.providers.openai.openai_chunks`); what differs is where a request goes and how
it is signed:

- ``POST {base_url}/openai/deployments/{deployment}/chat/completions?api-version=...`` (and
  ``/embeddings``); ``deployment`` defaults to the provider's ``model``, and the body's
  ``model`` is set to the deployment (Azure routes by the URL; the SDK sends the same);
- ``api-key: <key>`` from ``api_key_file``, or ``Authorization: Bearer <token>`` from
  ``token_file``, which is read again whenever the file changes (a rotated Entra ID token is
  used without a restart). Exactly one of the two is configured.

Failures map to kinds as follows (the first matching row wins):

========================================================  ==================  =========
what Azure said                                           kind                retryable
========================================================  ==================  =========
429 (``Retry-After``/``retry-after-ms`` kept)             ``rate_limited``    yes
code ``context_length_exceeded``                          ``context_length``  no
400 code ``content_filter`` (a refused prompt; the
filtered categories are named in the message)             ``content_filter``  no
404 (``DeploymentNotFound``, a wrong ``api-version``)     ``not_found``       no
401, 403                                                  ``auth``            no
408, 504, or no answer within the timeout                 ``timeout``         yes
503                                                       ``overloaded``      yes
any other 5xx                                             ``server``          yes
any other 4xx                                             ``bad_request``     no
refused, reset, DNS failure, a body cut off               ``connection``      yes
a 2xx that is not an answer                               ``malformed``       yes
========================================================  ==================  =========

A filtered *completion* is not an error: Azure answers 200 with ``finish_reason:
"content_filter"``, and that answer (or stream) reaches the caller as it is, as the OpenAI and
Anthropic providers hand over a filtered answer or a refusal (``/v1/messages`` shows it as
``stop_reason: "refusal"``). Azure's stream opens with a chunk that has no choices and only
``prompt_filter_results``; it is dropped. Every message is cleaned by
:class:`~tidegate.providers.redact.Redactor`, which knows the key, or the last tokens read.
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field
from yarl import URL

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.providers.base import JSONObject, Provider, StreamItem
from tidegate.providers.openai import openai_answer, openai_chunks, openai_error_for
from tidegate.providers.redact import Redactor, request_id_of
from tidegate.providers.transport import (
    HeadersSeen,
    HTTPAnswer,
    error_info,
    parse_json_object,
    post_json,
    stream_events,
)

__all__ = [
    "DEFAULT_API_VERSION",
    "AzureCredential",
    "AzureEndpoint",
    "AzureOpenAIOptions",
    "AzureOpenAIProvider",
    "azure_error_for",
    "build",
]

#: The latest generally available ``api-version`` of Azure OpenAI's dated inference API.
DEFAULT_API_VERSION: Final = "2024-10-21"

K = ProviderErrorKind

#: Azure's deployment names: letters, digits, ``-``, ``_`` and ``.``, at most 64 characters.
_DEPLOYMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: How many bearer tokens, the current one included, stay known to the redactor.
_TOKENS_REMEMBERED = 3


class AzureOpenAIOptions(BaseModel):
    """The ``azure_openai:`` section of a provider of this type."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The deployment to call; ``None``: the provider's ``model``.
    deployment: Annotated[str, Field(pattern=f"^{_DEPLOYMENT.pattern}$")] | None = None
    #: The ``api-version`` query parameter: a dated version, GA or ``-preview``.
    api_version: Annotated[str, Field(pattern=r"^\d{4}-\d{2}-\d{2}(-preview)?$")] = (
        DEFAULT_API_VERSION
    )
    #: A file holding a Microsoft Entra ID access token, sent as ``Authorization: Bearer``;
    #: instead of the provider's ``api_key_file``. Relative to the config file's folder.
    token_file: Path | None = None


@dataclass(frozen=True, slots=True)
class AzureEndpoint:
    """Where one deployment's requests go: ``{base_url}/openai/deployments/{deployment}/...``."""

    base_url: str
    deployment: str
    api_version: str = DEFAULT_API_VERSION

    def url(self, operation: Literal["chat/completions", "embeddings"]) -> URL:
        """The URL of ``operation``, with the ``api-version`` query."""
        base = URL(self.base_url.rstrip("/"))
        path = base / "openai" / "deployments" / self.deployment
        for part in operation.split("/"):
            path = path / part
        return path.with_query({"api-version": self.api_version})


class AzureCredential:
    """The ``api-key`` header from a key, or ``Authorization: Bearer`` from a token file.

    The token file is looked at (one ``stat``) before every request and read again when its
    inode, size or modification time changed; a file that cannot be read, or is empty, at that
    moment (a rotation in progress) leaves the last token in use. ``version`` counts the tokens
    read, so that a user of the credential knows when to rebuild what depends on it.
    """

    __slots__ = ("_key", "_path", "_stamp", "_token", "recent", "version")

    def __init__(self, *, api_key: str | None = None, token_file: Path | None = None) -> None:
        if (api_key is None) == (token_file is None):
            raise ValueError("give exactly one of api_key and token_file")
        self._key = api_key
        self._path = token_file
        self._stamp: tuple[int, int, int] | None = None
        self._token = ""
        #: The last tokens read, newest last: secrets to keep out of error messages.
        self.recent: deque[str] = deque(maxlen=_TOKENS_REMEMBERED)
        self.version = 0
        if token_file is not None:
            self._stamp, self._token = self._load(token_file)
            self.recent.append(self._token)
            self.version = 1

    @staticmethod
    def _load(path: Path) -> tuple[tuple[int, int, int], str]:
        """The file's stamp, then its token (in this order: a file replaced in between is read
        again next time); ``OSError``, or ``ValueError`` for an empty file."""
        info = os.stat(path)
        token = path.read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError("the file is empty")
        return (info.st_ino, info.st_mtime_ns, info.st_size), token

    def refresh(self) -> None:
        """Read the token file again if it changed since it was last read."""
        if self._path is None:
            return
        try:
            info = os.stat(self._path)
            if (info.st_ino, info.st_mtime_ns, info.st_size) == self._stamp:
                return
            stamp, token = self._load(self._path)
        except (OSError, ValueError):
            return  # the next request looks again; meanwhile the last token is used
        self._stamp = stamp
        if token != self._token:
            self._token = token
            self.recent.append(token)
            self.version += 1

    def headers(self) -> dict[str, str]:
        """The authentication header, as of the last :meth:`refresh`."""
        if self._key is not None:
            return {"api-key": self._key}
        return {"Authorization": f"Bearer {self._token}"}

    def secrets(self) -> list[str]:
        """Every value this credential has sent or may send."""
        return [self._key] if self._key is not None else list(self.recent)


def _filtered_categories(body: bytes, redactor: Redactor) -> list[str]:
    """The categories Azure's ``innererror.content_filter_result`` marks as filtered."""
    data = parse_json_object(body)
    error = data.get("error") if data is not None else None
    inner = error.get("innererror") if isinstance(error, dict) else None
    result = inner.get("content_filter_result") if isinstance(inner, dict) else None
    if not isinstance(result, dict):
        return []
    return [
        redactor.code(name)
        for name, verdict in result.items()
        if isinstance(verdict, dict) and verdict.get("filtered") is True and redactor.code(name)
    ]


def azure_error_for(
    answer: HTTPAnswer,
    *,
    provider: str,
    now_wall: float,
    redactor: Redactor,
) -> ProviderError:
    """The :class:`ProviderError` for an unsuccessful Azure OpenAI answer: the OpenAI
    provider's mapping (see the module's table), and for a refused prompt the filtered
    categories named in the message (``HTTP 400 content_filter (violence): ...``)."""
    error = openai_error_for(answer, provider=provider, now_wall=now_wall, redactor=redactor)
    if error.kind is not K.CONTENT_FILTER:
        return error
    categories = _filtered_categories(answer.body, redactor)
    if not categories:
        return error
    info = error_info(answer.body)
    status = f"HTTP {answer.status} " if answer.status >= 300 else ""
    message = redactor.message(
        info.message,
        head=f"{status}content_filter ({', '.join(categories)})",
        request_id=request_id_of(answer.headers) or info.request_id,
    )
    return ProviderError(
        error.kind,
        message,
        provider=provider,
        retryable=error.retryable,
        retry_after=error.retry_after,
        status=error.status,
    )


def _is_annotation(item: StreamItem) -> bool:
    """Azure's chunk with no choices that only reports the prompt's filter results."""
    return (
        isinstance(item, dict)
        and "prompt_filter_results" in item
        and not item.get("choices")
        and not item.get("usage")
    )


class AzureOpenAIProvider:
    """Chat completions, streams and embeddings from one Azure OpenAI deployment.

    ``session`` is the process's shared ``aiohttp.ClientSession``, borrowed and never closed.
    ``clock`` is read only to interpret an HTTP-date ``Retry-After``.
    """

    #: Told every answer's headers (the headroom it reports), when the gateway watches them.
    headers_seen: HeadersSeen | None = None
    headroom_dialect = "openai"

    def __init__(
        self,
        name: str,
        endpoint: AzureEndpoint,
        credential: AzureCredential,
        session: aiohttp.ClientSession,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self._credential = credential
        self._session = session
        self._clock: Clock = clock or SystemClock()
        self._chat_url = endpoint.url("chat/completions")
        self._embeddings_url = endpoint.url("embeddings")
        self._version = -1
        self._headers: dict[str, str] = {}
        self._redactor = Redactor()
        self._signed()

    def __repr__(self) -> str:
        return (
            f"AzureOpenAIProvider(name={self.name!r}, base_url={self.endpoint.base_url!r}, "
            f"deployment={self.endpoint.deployment!r})"
        )

    def _signed(self) -> tuple[dict[str, str], Redactor]:
        """The headers for the next request and the redactor for its errors (both rebuilt when
        the credential read a new token)."""
        credential = self._credential
        credential.refresh()
        if credential.version != self._version:
            self._version = credential.version
            self._headers = {"Content-Type": "application/json", **credential.headers()}
            self._redactor = Redactor(credential.secrets())
        return self._headers, self._redactor

    async def complete(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """POST ``chat/completions`` with ``stream: false``."""
        return await self._post(self._chat_url, self._payload(body, stream=False), timeout, "chat")

    async def stream(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """POST ``chat/completions`` with ``stream: true``: the chunks as the OpenAI provider
        reads them, without Azure's opening ``prompt_filter_results`` chunk."""
        headers, redactor = self._signed()
        error_for = self._error_for(redactor)
        events = stream_events(
            self._session,
            str(self._chat_url),
            headers={**headers, "Accept": "text/event-stream"},
            payload=self._payload(body, stream=True),
            provider=self.name,
            timeout=timeout,
            chunk_timeout=chunk_timeout,
            total_timeout=total_timeout,
            error_for=error_for,
            redactor=redactor,
            observe=self.headers_seen,
        )
        async with aclosing(openai_chunks(events, error_for)) as items:
            async for item in items:
                if not _is_annotation(item):
                    yield item

    async def embed(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """POST ``embeddings`` (the deployment must be an embeddings model)."""
        payload = {**body, "model": self.endpoint.deployment}
        return await self._post(self._embeddings_url, payload, timeout, "embeddings")

    async def aclose(self) -> None:
        """Nothing to release: the session belongs to whoever created it."""

    async def _post(
        self,
        url: URL,
        payload: JSONObject,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
        endpoint: Literal["chat", "embeddings"],
    ) -> JSONObject:
        headers, redactor = self._signed()
        answer = await post_json(
            self._session,
            url,
            headers=headers,
            payload=payload,
            timeout=timeout,
            provider=self.name,
            redactor=redactor,
            observe=self.headers_seen,
        )
        if not 200 <= answer.status < 300:
            raise self._error_for(redactor)(answer)
        return openai_answer(
            answer,
            endpoint=endpoint,
            provider=self.name,
            now_wall=self._clock.wall(),
            redactor=redactor,
        )

    def _payload(self, body: JSONObject, *, stream: bool) -> JSONObject:
        payload: dict[str, Any] = {**body, "model": self.endpoint.deployment, "stream": stream}
        if not stream:
            payload.pop("stream_options", None)  # refused on a non-streamed call
        return payload

    def _error_for(self, redactor: Redactor) -> Callable[[HTTPAnswer], ProviderError]:
        def error_for(answer: HTTPAnswer) -> ProviderError:
            return azure_error_for(
                answer, provider=self.name, now_wall=self._clock.wall(), redactor=redactor
            )

        return error_for


def _endpoint(
    name: str, model: str, base_url: str | None, options: AzureOpenAIOptions
) -> AzureEndpoint:
    where = f"providers.{name}"
    url = URL(base_url or "")
    if not url.absolute or url.scheme not in ("http", "https"):
        raise ConfigError(f"{where}.base_url: an http(s) URL is needed, got {base_url!r}")
    if url.query_string or "/deployments" in url.path:
        raise ConfigError(
            f"{where}.base_url: the resource's endpoint only (https://<resource>.openai.azure.com);"
            " the deployment and api-version are set under azure_openai"
        )
    deployment = options.deployment or model
    if not _DEPLOYMENT.fullmatch(deployment):
        key = "azure_openai.deployment" if options.deployment else "model"
        raise ConfigError(f"{where}.{key}: {deployment!r} is not an Azure deployment name")
    return AzureEndpoint(str(url), deployment, options.api_version)


def _credential(
    name: str, api_key: str | None, options: AzureOpenAIOptions, base_dir: Path
) -> AzureCredential:
    where = f"providers.{name}"
    if api_key is not None and options.token_file is not None:
        raise ConfigError(
            f"{where}.azure_openai.token_file: set either api_key_file or"
            " azure_openai.token_file, not both"
        )
    if options.token_file is None:
        if api_key is None:
            raise ConfigError(
                f"{where}.api_key_file: an azure_openai provider needs api_key_file"
                " or azure_openai.token_file"
            )
        if not api_key:
            raise ConfigError(f"{where}.api_key_file: the file is empty")
        return AzureCredential(api_key=api_key)
    path = options.token_file
    path = path if path.is_absolute() else base_dir / path
    try:
        return AzureCredential(token_file=path)
    except OSError as exc:
        raise ConfigError(
            f"{where}.azure_openai.token_file: cannot read {str(path)!r} ({exc.strerror})"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"{where}.azure_openai.token_file: {str(path)!r}: {exc}") from None


def build(
    name: str,
    *,
    model: str,
    base_url: str | None,
    api_key: str | None,
    options: AzureOpenAIOptions | None,
    session: aiohttp.ClientSession,
    clock: Clock,
    base_dir: Path,
) -> Provider:
    """The provider for one config section (files named in ``options`` relative to base_dir).

    Raises :class:`ConfigError` naming the key: no credential or both, an unreadable or empty
    token file, a ``base_url`` that is not the resource's endpoint, a bad deployment name.
    """
    options = options or AzureOpenAIOptions()
    endpoint = _endpoint(name, model, base_url, options)
    credential = _credential(name, api_key, options, base_dir)
    return AzureOpenAIProvider(name, endpoint, credential, session, clock=clock)
