"""The ``gemini`` provider type: Google's Gemini API, or Gemini on Vertex AI.

Both speak the same ``generateContent`` wire format; they differ in the URL and in the
credential:

- the Gemini API: ``POST {base_url}/v1beta/models/{model}:generateContent`` with the API key in
  the ``x-goog-api-key`` header (never in the URL, where a log would keep it);
- Vertex AI: ``POST {base_url}/v1/projects/{project}/locations/{location}/publishers/google/
  models/{model}:generateContent`` with an OAuth bearer token from a service account, made and
  refreshed by google-auth (the optional extra ``tidegate[gemini]``, imported only for Vertex).
  The refresh is a blocking HTTP call and runs in a worker thread, one at a time.

Streams use ``:streamGenerateContent?alt=sse``. The translation both ways and the error mapping
are in :mod:`tidegate.providers.gemini_wire`; docs/providers/gemini.md has the tables.
Embeddings use ``:batchEmbedContents`` on the Gemini API; Vertex AI's publisher models embed
through another API, so :meth:`GeminiProvider.embed` refuses there without a call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from pathlib import Path
from typing import Annotated, Any, Protocol
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.providers.base import JSONObject, MalformedChunk, Provider, StreamEnd, StreamItem
from tidegate.providers.gemini_wire import (
    GeminiStreamTranslator,
    from_generate_response,
    gemini_error_for,
    generate_response_problem,
    prompt_block,
    to_generate_request,
)
from tidegate.providers.redact import Redactor
from tidegate.providers.translate import includes_usage
from tidegate.providers.transport import (
    HTTPAnswer,
    answer_object,
    exception_to_error,
    json_events,
    post_json,
    stream_events,
)
from tidegate.providers.wire import EncodingFormat, embeddings_response
from tidegate.timers import timeout_after

__all__ = [
    "API_BASE_URL",
    "ApiKeyAuth",
    "GeminiAuth",
    "GeminiOptions",
    "GeminiProvider",
    "SafetySettingOption",
    "ServiceAccountAuth",
    "VertexOptions",
    "build",
    "vertex_base_url",
]

K = ProviderErrorKind

#: Where the Gemini API answers.
API_BASE_URL = "https://generativelanguage.googleapis.com"
#: The OAuth scope a Vertex AI call needs.
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
_EXTRA = "pip install 'tidegate[gemini]'"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SafetySettingOption(_Strict):
    """One ``safetySettings`` entry sent with every request (Google's names, as they are)."""

    category: Annotated[str, Field(min_length=1)]
    threshold: Annotated[str, Field(min_length=1)]


class VertexOptions(_Strict):
    """Gemini on Vertex AI, with a service account's credentials."""

    #: The service account's JSON key file (relative to the config file's folder).
    service_account_file: Path
    #: The Google Cloud project; by default the ``project_id`` of the key file.
    project: Annotated[str, Field(min_length=1)] | None = None
    #: The region (``us-central1``, ``europe-west4``) or ``global``.
    location: Annotated[str, Field(min_length=1, pattern=r"^[a-z0-9-]+$")] = "us-central1"


class GeminiOptions(BaseModel):
    """The ``gemini:`` section of a provider of this type."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The API version in the URL: ``v1beta`` for the Gemini API, ``v1`` for Vertex AI.
    api_version: Annotated[str, Field(pattern=r"^v[0-9a-z]+$")] | None = None
    #: Send to Vertex AI with a service account instead of the Gemini API with a key.
    vertex: VertexOptions | None = None
    #: ``safetySettings`` added to every generateContent request.
    safety_settings: tuple[SafetySettingOption, ...] = ()


# --------------------------------------------------------------------------- credentials


class GeminiAuth(Protocol):
    """Gives the headers that authenticate one request."""

    @property
    def secrets(self) -> tuple[str, ...]:
        """What must never appear in an error message (the key, the current token)."""
        ...

    async def headers(self, *, within: float, provider: str) -> Mapping[str, str]:
        """The credential headers, within ``within`` seconds."""
        ...


class ApiKeyAuth:
    """The Gemini API's key, in the ``x-goog-api-key`` header."""

    __slots__ = ("_headers", "secrets")

    def __init__(self, api_key: str) -> None:
        self._headers = {"x-goog-api-key": api_key}
        self.secrets: tuple[str, ...] = (api_key,)

    async def headers(self, *, within: float, provider: str) -> Mapping[str, str]:
        return self._headers


class ServiceAccountAuth:
    """A bearer token from google-auth credentials, refreshed in a worker thread when it is
    missing or about to expire (google-auth's own margin); one refresh at a time.

    ``credentials`` is a ``google.auth.credentials.Credentials`` (``valid``, ``token``,
    ``refresh(request)``); ``request`` the google-auth transport its refresh uses.
    """

    __slots__ = ("_credentials", "_lock", "_request")

    def __init__(self, credentials: Any, request: Any) -> None:
        self._credentials = credentials
        self._request = request
        self._lock = asyncio.Lock()

    @property
    def secrets(self) -> tuple[str, ...]:
        token = self._credentials.token
        return (token,) if isinstance(token, str) and token else ()

    async def headers(self, *, within: float, provider: str) -> Mapping[str, str]:
        if not self._credentials.valid:
            await self._refresh(within, provider)
        return {"Authorization": f"Bearer {self._credentials.token}"}

    async def _refresh(self, within: float, provider: str) -> None:
        try:
            async with timeout_after(within), self._lock:
                if not self._credentials.valid:  # another call may have refreshed meanwhile
                    await asyncio.to_thread(self._credentials.refresh, self._request)
        except TimeoutError:
            raise ProviderError(
                K.TIMEOUT, f"no access token within {within:g}s", provider=provider
            ) from None
        except Exception as exc:
            raise _refresh_error(exc, provider) from exc


def _refresh_error(exc: Exception, provider: str) -> ProviderError:
    """A failed token refresh: refused credentials are ``auth``, a network failure
    ``connection``; the text is cleaned (it may quote the token endpoint's answer)."""
    from google.auth import exceptions

    text = Redactor().message(str(exc))
    if isinstance(exc, exceptions.RefreshError):
        retryable = bool(getattr(exc, "retryable", False))
        kind = K.CONNECTION if retryable else K.AUTH
        message = f"the access token refresh failed: {text}"
        return ProviderError(kind, message, provider=provider, retryable=retryable)
    if isinstance(exc, exceptions.TransportError):
        return ProviderError(K.CONNECTION, f"the token endpoint failed: {text}", provider=provider)
    error = exception_to_error(
        exc, provider=provider, timeout_message="the token refresh timed out"
    )
    if error is None:
        raise exc
    return error


def service_account_auth(path: Path, where: str) -> tuple[ServiceAccountAuth, str]:
    """Credentials from a service account key file, and the file's ``project_id``;
    :class:`ConfigError` (naming ``where``) when google-auth is missing or the file is bad."""
    try:
        from google.auth.transport.requests import Request
        from google.oauth2 import service_account
    except ImportError:
        raise ConfigError(f"{where}: Vertex AI needs google-auth ({_EXTRA})") from None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        credentials = service_account.Credentials.from_service_account_info(  # type: ignore[no-untyped-call]
            info, scopes=[CLOUD_PLATFORM_SCOPE]
        )
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {str(path)!r} ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError) as exc:
        # ValueError covers bad JSON too; the text names the missing field, never the key.
        reason = type(exc).__name__ if isinstance(exc, KeyError) else str(exc).split("\n")[0]
        raise ConfigError(
            f"{where}: {str(path)!r} is not a service account key ({reason})"
        ) from None
    project = info.get("project_id") if isinstance(info, dict) else None
    return ServiceAccountAuth(credentials, Request()), project if isinstance(project, str) else ""


# --------------------------------------------------------------------------- the provider


class GeminiProvider:
    """Chat completions, streams and embeddings from Gemini, in the OpenAI wire format.

    ``models_url`` is everything before ``/{model}:generateContent``:
    ``https://generativelanguage.googleapis.com/v1beta/models``, or Vertex AI's
    ``.../v1/projects/{p}/locations/{l}/publishers/google/models`` (no embeddings there).
    ``extra`` is merged into every generateContent request (``safetySettings``). ``session``
    is borrowed, never closed; ``clock`` stamps ``created`` and reads ``Retry-After`` dates.
    """

    def __init__(
        self,
        name: str,
        models_url: str,
        session: aiohttp.ClientSession,
        *,
        auth: GeminiAuth,
        extra: JSONObject | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.models_url = models_url.rstrip("/")
        self._session = session
        self._auth = auth
        self._extra = dict(extra or {})
        self._clock: Clock = clock or SystemClock()
        self._vertex = "/publishers/" in self.models_url
        self._secrets: tuple[str, ...] = ()
        self._redactor = Redactor()

    def __repr__(self) -> str:
        return f"GeminiProvider(name={self.name!r}, models_url={self.models_url!r})"

    @property
    def redactor(self) -> Redactor:
        """Cleans error text of the current secrets (rebuilt when a token is refreshed)."""
        secrets = self._auth.secrets
        if secrets != self._secrets:
            self._secrets, self._redactor = secrets, Redactor(secrets)
        return self._redactor

    def _url(self, body: JSONObject, method: str) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ProviderError(K.BAD_REQUEST, "the request names no model", provider=self.name)
        return f"{self.models_url}/{quote(model.removeprefix('models/'), safe='')}:{method}"

    async def _headers(self, within: float) -> dict[str, str]:
        credential = await self._auth.headers(within=within, provider=self.name)
        return {"Content-Type": "application/json", **credential}

    async def _post(self, url: str, payload: JSONObject, within: float) -> HTTPAnswer:
        loop = asyncio.get_running_loop()
        started = loop.time()
        headers = await self._headers(within)
        left = max(0.0, within - (loop.time() - started))
        return await post_json(
            self._session,
            url,
            headers=headers,
            payload=payload,
            timeout=left,
            provider=self.name,
            redactor=self.redactor,
        )

    def _answer(
        self, answer: HTTPAnswer, problem_of: Callable[[JSONObject], str | None]
    ) -> JSONObject:
        return answer_object(
            answer,
            problem_of,
            error_for=self._error_for,
            provider=self.name,
            redactor=self.redactor,
        )

    async def complete(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """POST ``:generateContent`` and translate the answer into a ``chat.completion``."""
        url = self._url(body, "generateContent")
        answer = await self._post(url, self._payload(body), timeout)

        def problem_of(data: JSONObject) -> str | None:
            blocked = prompt_block(data, self.name)
            if blocked is not None:
                raise blocked
            return generate_response_problem(data)

        data = self._answer(answer, problem_of)
        return from_generate_response(
            data, created=int(self._clock.wall()), model=str(body["model"]), provider=self.name
        )

    async def stream(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """POST ``:streamGenerateContent?alt=sse`` and yield OpenAI chunks.

        Gemini sends no end marker: ``StreamEnd(done_seen=True)`` means every candidate came
        with its ``finishReason``.
        """
        url = self._url(body, "streamGenerateContent") + "?alt=sse"
        payload = self._payload(body)
        translator = GeminiStreamTranslator(
            created=int(self._clock.wall()),
            model=str(body["model"]),
            include_usage=includes_usage(body),
            provider=self.name,
            redactor=self.redactor,
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        headers = await self._headers(timeout)
        events = stream_events(
            self._session,
            url,
            headers={**headers, "Accept": "text/event-stream"},
            payload=payload,
            provider=self.name,
            timeout=max(0.0, timeout - (loop.time() - started)),
            chunk_timeout=chunk_timeout,
            total_timeout=total_timeout,
            error_for=self._error_for,
            redactor=self.redactor,
        )
        async with aclosing(json_events(events)) as items:
            async for item in items:
                if isinstance(item, MalformedChunk):
                    yield item
                    continue
                for chunk in translator.feed(item[1]):
                    yield chunk
        for chunk in translator.finish():
            yield chunk
        yield StreamEnd(done_seen=translator.done)

    async def embed(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """POST ``:batchEmbedContents`` (the Gemini API only) and answer OpenAI's shape."""
        if self._vertex:
            raise ProviderError(
                K.BAD_REQUEST,
                "embeddings are not offered through Vertex AI's generateContent endpoint",
                provider=self.name,
            )
        texts = _embedding_inputs(body.get("input"), self.name)
        url = self._url(body, "batchEmbedContents")
        model = "models/" + str(body["model"]).removeprefix("models/")
        entry: JSONObject = {"model": model}
        if isinstance(body.get("dimensions"), int):
            entry["outputDimensionality"] = body["dimensions"]
        payload = {
            "requests": [{**entry, "content": {"parts": [{"text": text}]}} for text in texts]
        }
        answer = await self._post(url, payload, timeout)
        data = self._answer(answer, lambda data: _embeddings_problem(data, len(texts)))
        encoding: EncodingFormat = "base64" if body.get("encoding_format") == "base64" else "float"
        return embeddings_response(
            model=str(body["model"]),
            vectors=[item["values"] for item in data["embeddings"]],
            prompt_tokens=0,
            encoding_format=encoding,
        )

    async def aclose(self) -> None:
        """Nothing to release: the session belongs to whoever created it."""

    def _payload(self, body: JSONObject) -> JSONObject:
        return {**to_generate_request(body, provider=self.name), **self._extra}

    def _error_for(self, answer: HTTPAnswer) -> ProviderError:
        return gemini_error_for(
            answer, provider=self.name, now_wall=self._clock.wall(), redactor=self.redactor
        )


def _embedding_inputs(value: Any, provider: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return list(value)
    raise ProviderError(
        K.BAD_REQUEST,
        "Gemini embeds text: input must be a string or a list of them",
        provider=provider,
    )


def _embeddings_problem(data: JSONObject, count: int) -> str | None:
    embeddings = data.get("embeddings")
    if not isinstance(embeddings, list) or len(embeddings) != count:
        return "not one embedding per input"
    for item in embeddings:
        values = item.get("values") if isinstance(item, dict) else None
        if not isinstance(values, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            return "an embedding whose values are not a list of numbers"
    return None


# --------------------------------------------------------------------------- from the config


def vertex_base_url(location: str) -> str:
    """Vertex AI's endpoint for ``location`` (``global`` has no regional host)."""
    if location == "global":
        return "https://aiplatform.googleapis.com"
    return f"https://{location}-aiplatform.googleapis.com"


def _vertex(
    where: str, options: GeminiOptions, base_url: str | None, base_dir: Path
) -> tuple[ServiceAccountAuth, str]:
    """The service-account credentials and the models URL for a ``gemini.vertex`` section."""
    vertex = options.vertex
    assert vertex is not None
    key_file = vertex.service_account_file
    path = key_file if key_file.is_absolute() else base_dir / key_file
    auth, file_project = service_account_auth(path, f"{where}.gemini.vertex.service_account_file")
    project = vertex.project or file_project
    if not project:
        raise ConfigError(f"{where}.gemini.vertex.project: not set, and not in the key file")
    base = (base_url or vertex_base_url(vertex.location)).rstrip("/")
    models_url = (
        f"{base}/{options.api_version or 'v1'}/projects/{quote(project, safe='')}"
        f"/locations/{vertex.location}/publishers/google/models"
    )
    return auth, models_url


def build(
    name: str,
    *,
    model: str,
    base_url: str | None,
    api_key: str | None,
    options: GeminiOptions | None,
    session: aiohttp.ClientSession,
    clock: Clock,
    base_dir: Path,
) -> Provider:
    """The provider for one config section (files named in ``options`` relative to base_dir)."""
    options = options or GeminiOptions()
    where = f"providers.{name}"
    if not model.strip():
        raise ConfigError(f"{where}.model: must name a Gemini model")
    extra: JSONObject = {}
    if options.safety_settings:
        extra["safetySettings"] = [s.model_dump() for s in options.safety_settings]
    if options.vertex is None:
        if not api_key:
            raise ConfigError(
                f"{where}: the Gemini API needs api_key_file (or gemini.vertex for Vertex AI)"
            )
        version = options.api_version or "v1beta"
        models_url = f"{(base_url or API_BASE_URL).rstrip('/')}/{version}/models"
        auth: GeminiAuth = ApiKeyAuth(api_key)
    else:
        if api_key:
            raise ConfigError(
                f"{where}.api_key_file: Vertex AI uses gemini.vertex.service_account_file, "
                "not an API key"
            )
        auth, models_url = _vertex(where, options, base_url, base_dir)
    return GeminiProvider(name, models_url, session, auth=auth, extra=extra, clock=clock)
