#!/usr/bin/env python3
"""Black-box smoke test of a running tidegate, using only the Python standard library.

    python3 scripts/smoke.py http://127.0.0.1:8080 --key KEY --model chat-default

It checks, printing one line each, that the instance

- says it is ready (``GET /readyz`` is 200 with ``"status": "ready"``),
- streams a chat answer to its end (``data: [DONE]``, with some text before it, no error event),
- returns the request id it was given in ``X-Request-ID``,
- serves its Prometheus metrics (``GET /metrics`` has the ``tidegate_`` families),
- says which build it is (``GET /version`` has a ``git_sha``),

and exits 0 only if every check passed, 1 otherwise (2 for bad arguments). Because it needs no
installation it runs the same in CI, on a laptop and on a bastion host after a deploy: unit tests
show the code works, this shows the artefact that was deployed works.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

#: Metric families every tidegate process declares, whether or not it has served a request yet
#: (behind a load balancer, /metrics may come from a replica the chat request did not reach).
REQUIRED_FAMILIES = ("tidegate_in_flight_requests", "tidegate_requests")


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str


class Smoke:
    """The checks, against one base URL."""

    def __init__(
        self, base: str, key: str, model: str, timeout: float, metrics_url: str | None = None
    ) -> None:
        self.base = base.rstrip("/")
        self.metrics_url = metrics_url or f"{self.base}/metrics"
        self.key = key
        self.model = model
        self.timeout = timeout
        self.request_id = f"smoke-{secrets.token_hex(8)}"
        self.answer_headers: dict[str, str] | None = None

    def _get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        url = path if path.startswith(("http://", "https://")) else self.base + path
        request = urllib.request.Request(url, method="GET")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, _headers(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, _headers(error.headers), error.read()

    def readiness(self) -> Result:
        status, _, body = self._get("/readyz")
        data = _json(body)
        state = data.get("status") if isinstance(data, dict) else None
        if status == 200 and state == "ready":
            store = data.get("state_store", "?")
            breakers = data.get("breakers") or {}
            shown = ", ".join(f"{k}={v}" for k, v in sorted(breakers.items())) or "none"
            return Result("readiness", True, f"ready (state store {store}; breakers {shown})")
        problems = data.get("problems") if isinstance(data, dict) else None
        return Result("readiness", False, f"HTTP {status}, status {state!r}, problems {problems}")

    def stream(self) -> Result:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Smoke test: answer with a short sentence."}],
            "stream": True,
        }
        request = urllib.request.Request(
            self.base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "Authorization": f"Bearer {self.key}",
                "Content-Type": "application/json",
                "Accept": "text/event-stream",
                "X-Request-ID": self.request_id,
            },
        )
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            self.answer_headers = _headers(error.headers)
            return Result("stream", False, f"HTTP {error.code}: {_error_text(error.read())}")
        with response:
            self.answer_headers = _headers(response.headers)
            kind = self.answer_headers.get("content-type", "")
            if not kind.startswith("text/event-stream"):
                return Result("stream", False, f"content-type {kind!r}, not text/event-stream")
            chunks, chars = 0, 0
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    if chars == 0:
                        return Result("stream", False, f"[DONE] after {chunks} chunks, no text")
                    served = self.answer_headers.get("x-tidegate-served-by", "?")
                    return Result(
                        "stream",
                        True,
                        f"{chunks} chunks, {chars} characters, then [DONE] (served by {served})",
                    )
                event = _json(data.encode())
                if not isinstance(event, dict):
                    return Result("stream", False, f"an event that is not JSON: {data[:80]!r}")
                if "error" in event:
                    return Result("stream", False, f"error event: {_error_text(data.encode())}")
                chunks += 1
                for choice in event.get("choices") or ():
                    chars += len((choice.get("delta") or {}).get("content") or "")
        return Result("stream", False, f"the stream ended after {chunks} chunks without [DONE]")

    def request_id_header(self) -> Result:
        if self.answer_headers is None:
            return Result("request id", False, "no response to read it from")
        got = self.answer_headers.get("x-request-id")
        if got == self.request_id:
            return Result("request id", True, f"X-Request-ID {got} came back")
        if got:
            return Result("request id", False, f"sent {self.request_id}, got back {got}")
        return Result("request id", False, "no X-Request-ID header on the answer")

    def metrics(self) -> Result:
        status, _, body = self._get(self.metrics_url)
        families = _families(body.decode("utf-8", "replace"))
        missing = [name for name in REQUIRED_FAMILIES if name not in families]
        if status == 200 and not missing:
            ours = sum(name.startswith("tidegate_") for name in families)
            return Result("metrics", True, f"{ours} tidegate_* metric families")
        return Result("metrics", False, f"HTTP {status}, missing {', '.join(missing) or '-'}")

    def version(self) -> Result:
        status, _, body = self._get("/version")
        data = _json(body)
        if status == 200 and isinstance(data, dict) and data.get("git_sha"):
            return Result("version", True, f"{data.get('version')} at git {data['git_sha']}")
        return Result("version", False, f"HTTP {status}, body {body[:120]!r}")


def _headers(message: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in message.items()} if message is not None else {}


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _error_text(body: bytes) -> str:
    data = _json(body)
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        error = data["error"]
        return f"{error.get('code')}: {error.get('message')}"
    return repr(body[:200])


def _families(text: str) -> set[str]:
    """The metric family names declared by ``# TYPE name kind`` lines, without ``_total``.

    Exposition formats disagree on whether a counter's family is named with its ``_total``.
    """
    return {
        line.split()[2].removesuffix("_total")
        for line in text.splitlines()
        if line.startswith("# TYPE ") and len(line.split()) >= 4
    }


def _run(check: Callable[[], Result], name: str) -> Result:
    try:
        return check()
    except (OSError, urllib.error.URLError) as exc:  # refused, reset, timed out, DNS
        return Result(name, False, f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("base_url", help="the gateway's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--key", required=True, help="an API key of the gateway")
    parser.add_argument("--model", required=True, help="a model alias the key may use")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per network read")
    parser.add_argument(
        "--metrics-url", help="where /metrics is, when not at the base URL (the admin listener)"
    )
    args = parser.parse_args(argv)
    parts = urlsplit(args.base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        parser.error(f"expected an http:// or https:// URL, got {args.base_url!r}")

    smoke = Smoke(args.base_url, args.key, args.model, args.timeout, args.metrics_url)
    checks: list[tuple[str, Callable[[], Result]]] = [
        ("readiness", smoke.readiness),
        ("stream", smoke.stream),
        ("request id", smoke.request_id_header),
        ("metrics", smoke.metrics),
        ("version", smoke.version),
    ]
    results = []
    for name, check in checks:
        result = _run(check, name)
        results.append(result)
        print(f"{'ok  ' if result.ok else 'FAIL'}  {result.name:<11} {result.detail}", flush=True)
    passed = sum(r.ok for r in results)
    print(f"smoke: {passed} of {len(results)} checks passed against {smoke.base}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
