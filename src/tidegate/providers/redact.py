"""What of a provider's error text may reach a caller or a log line: never a credential.

An upstream's error text is written by someone else and may say anything. OpenAI's 401 echoes
the key it was sent (``Incorrect API key provided: sk-...``), a proxy may echo the
``Authorization`` header, and a broken or hostile upstream may put any text anywhere. Every
:class:`~tidegate.errors.ProviderError` message the HTTP providers build from upstream text is
made by :meth:`Redactor.message`, so the answer to the caller, a stream's error event and every
log line only ever see the cleaned text. A message keeps what helps the caller: the status, the
provider's own error code, the provider's request id, and a short cleaned text.

Cleaning (:meth:`Redactor.clean`), in this order:

1. invisible format characters (zero-width, bidirectional marks, tag characters) are deleted, so
   that none can split a secret into two harmless halves; other characters that are not
   printable (controls, line breaks) become spaces and runs of spaces one space: a message is
   one line of plain text;
2. the configured secrets (the provider's API key and any secret-looking header it sends) are
   removed wherever they appear, also JSON-escaped or percent-encoded, and whatever their case.
   A secret shorter than :data:`MIN_SUBSTRING_SECRET` characters is removed only where it stands
   as a whole token: its letters also occur inside ordinary words;
3. whatever is shaped like a credential is replaced: ``Bearer``/``Basic`` values, ``api-key:``
   and ``x-api-key:`` values, ``key=``, ``token=``, ``secret=`` and similar query values,
   passwords in URLs, ``sk-``/``sk-ant-``/``pk-``/``rk-`` keys (masked ones too), GitHub,
   Hugging Face, Slack, Google and AWS key ids, JWTs, and long runs of base64 or hex characters
   that mix letters and digits.

A request id is kept only when it is short, made of plain id characters, and neither contains a
secret nor looks like a key (:meth:`Redactor.request_id`); it skips the long-run rule, since
request ids are often long hex or base62 runs themselves.

This is not :mod:`tidegate.gateway.redaction`: that one filters what a *model* says to the user
(deny patterns over answers); this one keeps tidegate's own credentials out of error text, in the
provider layer, which the gateway sits above.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import quote, quote_plus

import orjson

__all__ = [
    "MAX_MESSAGE",
    "MIN_SUBSTRING_SECRET",
    "NO_SECRETS",
    "REDACTED",
    "Redactor",
    "cut",
    "request_id_of",
    "secret_header_values",
]

#: The longest message an upstream error becomes, request id included.
MAX_MESSAGE: Final = 300
#: What stands where a secret or a key-shaped string was.
REDACTED: Final = "[redacted]"
#: Secrets at least this long are removed even from inside a longer token.
MIN_SUBSTRING_SECRET: Final = 8
#: How much upstream text is looked at before cleaning: enough for any real error message, and
#: a bound on the regular expressions' work for a hostile megabyte.
MAX_RAW: Final = 4096

_SPACE_RUNS = re.compile(r"\s{2,}")

#: A label that says a credential follows (kept), then the credential (replaced).
_LABELLED = re.compile(
    r"""(?P<keep>
          (?i:\b(?:bearer|basic)\s+)(?=\S*[A-Z0-9+/=_.\-])(?=\S{8})
        | (?i:\b(?:x-api-key|api[-_]?key|authorization|proxy-authorization)["']?\s*[:=]\s*["']?)
          (?!(?i:bearer|basic)\b)
        | (?i:\b(?:key|token|access[-_]?token|auth[-_]?token|refresh[-_]?token|client[-_]?secret
                  |secret|password|passwd|sig|signature)=)
        | ://[^/\s:@]*:(?=[^/\s@]+@)
      )
      (?P<value>[^\s"'&,;<>@]+)
    """,
    re.VERBOSE,
)

#: Strings that are credentials by their shape alone.
_SHAPED = re.compile(
    r"""
      \b(?:sk|pk|rk)-[\w*\-]{4,}                    # OpenAI, Anthropic (sk-ant-), masked too
    | \b(?:sk|pk|rk)_(?:live|test)_[\w*]{4,}          # Stripe-style
    | \b(?:ghp|gho|ghu|ghs|ghr|github_pat|glpat|hf|xox[abprs])[-_][\w\-]{10,}
    | \bAIza[\w\-]{30,}                               # Google API keys
    | \b(?:AKIA|ASIA)[0-9A-Z]{16}\b                   # AWS access key ids
    | \beyJ[\w\-]{8,}\.[\w\-]{8,}\.[\w\-]*            # JWTs
    """,
    re.VERBOSE,
)

#: Candidates for the long-run rule: see :func:`_looks_random`.
_LONG_RUN = re.compile(r"[A-Za-z0-9+/=_\-]{24,}")
_RUN_SEPARATORS = re.compile(r"[+/=_\-]")
_LONGEST_PLAIN_SEGMENT = 16

_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,99}")
_CODE = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")
_SECRET_HEADER = re.compile(r"auth|key|token|secret|cookie|password", re.IGNORECASE)


def _looks_random(run: str) -> bool:
    """A long run is a key when some stretch of it between separators is long and mixes letters
    and digits: model names and UUIDs break into short words, keys and hashes do not."""
    for segment in _RUN_SEPARATORS.split(run):
        if (
            len(segment) >= _LONGEST_PLAIN_SEGMENT
            and not segment.isdigit()
            and not segment.isalpha()
        ):
            return True
    return False


def _printable(char: str) -> str:
    if char.isprintable():
        return char
    return "" if unicodedata.category(char) == "Cf" else " "


def _replace_run(match: re.Match[str]) -> str:
    run = match.group()
    return REDACTED if _looks_random(run) else run


def cut(text: str, limit: int, *, whole_tokens: bool = False) -> str:
    """``text`` in at most ``limit`` characters, ending in ``…`` when something was cut.

    With ``whole_tokens`` (for text not yet cleaned) a token cut in two is dropped whole: half of
    a secret is still half of it, and too short for the rules above to recognise.
    """
    if len(text) <= limit:
        return text
    head = text[: max(0, limit - 1)]
    if whole_tokens and not text[len(head)].isspace():
        head = head.rpartition(" ")[0] if " " in head else ""
    return head.rstrip() + "…"


def request_id_of(headers: Mapping[str, str], body: Mapping[str, Any] | None = None) -> str:
    """The provider's request id: the ``x-request-id`` or ``request-id`` header (OpenAI,
    Anthropic), else a ``request_id`` in the error body; ``""`` when there is none. Raw: pass it
    through :meth:`Redactor.request_id` before showing it."""
    for name in ("x-request-id", "request-id"):
        value = headers.get(name)
        if value:
            return value
    if body is not None:
        for where in (body, body.get("error")):
            if isinstance(where, Mapping):
                value = where.get("request_id")
                if isinstance(value, str) and value:
                    return value
    return ""


def secret_header_values(headers: Mapping[str, str] | None) -> list[str]:
    """The values of headers whose names say they carry a credential (``api-key``,
    ``Authorization``, ``X-Auth-Token``, ...): secrets to keep out of messages too."""
    if not headers:
        return []
    values: list[str] = []
    for name, value in headers.items():
        if _SECRET_HEADER.search(name) and value:
            values.append(value)
            scheme, _, credential = value.partition(" ")
            if credential and scheme.isalpha():
                values.append(credential.strip())
    return values


class Redactor:
    """Removes ``secrets`` and key-shaped strings from upstream text; built once per provider.

    Empty and ``None`` secrets are ignored, so ``Redactor((api_key,))`` works without a key.
    """

    __slots__ = ("_secrets", "_whole")

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        variants: set[str] = set()
        short: set[str] = set()
        for secret in secrets:
            if not secret:
                continue
            # As it may come back: verbatim, inside a JSON string, or percent-encoded in a URL.
            escaped = orjson.dumps(secret).decode()[1:-1]
            forms = {secret, escaped, quote(secret, safe=""), quote_plus(secret)}
            (variants if len(secret) >= MIN_SUBSTRING_SECRET else short).update(forms)
        self._secrets = _alternation(variants, whole_token=False)
        self._whole = _alternation(short, whole_token=True)

    def clean(self, text: str) -> str:
        """``text`` with invisible characters, secrets and key-shaped strings gone (see the
        module docstring); not shortened."""
        if not text.isprintable():
            text = "".join(_printable(char) for char in text)
        text = _SPACE_RUNS.sub(" ", text).strip()
        if self._secrets is not None:
            text = self._secrets.sub(REDACTED, text)
        if self._whole is not None:
            text = self._whole.sub(REDACTED, text)
        text = _LABELLED.sub(lambda match: match.group("keep") + REDACTED, text)
        text = _SHAPED.sub(REDACTED, text)
        return _LONG_RUN.sub(_replace_run, text)

    def code(self, value: object) -> str:
        """A provider's error code or type fit to show: a short identifier, else ``""``."""
        if not isinstance(value, str) or not _CODE.fullmatch(value):
            return ""
        return value if self.clean(value) == value else ""

    def request_id(self, value: str) -> str:
        """``value`` when it is a plausible request id that carries no secret, else ``""``."""
        if not _REQUEST_ID.fullmatch(value) or _SHAPED.search(value):
            return ""
        for pattern in (self._secrets, self._whole):
            if pattern is not None and pattern.search(value):
                return ""
        return value

    def message(self, text: str, *, head: str = "", request_id: str = "") -> str:
        """The message a caller may see: ``head: text (request id ...)``, cleaned, at most
        :data:`MAX_MESSAGE` characters. ``head`` is tidegate's own words (a status, a code that
        went through :meth:`code`); ``request_id`` is raw and checked here."""
        text = self.clean(cut(text, MAX_RAW, whole_tokens=True))
        body = f"{head}: {text}" if head and text else head or text
        ident = self.request_id(request_id) if request_id else ""
        suffix = f" (request id {ident})" if ident else ""
        return cut(body, MAX_MESSAGE - len(suffix)) + suffix


def _alternation(secrets: set[str], *, whole_token: bool) -> re.Pattern[str] | None:
    if not secrets:
        return None
    # Longest first, so that a secret is removed whole before a shorter one inside it matches.
    body = "|".join(re.escape(secret) for secret in sorted(secrets, key=len, reverse=True))
    if whole_token:
        body = rf"(?<![A-Za-z0-9])(?:{body})(?![A-Za-z0-9])"
    return re.compile(body, re.IGNORECASE)


#: For text from a provider without configured secrets: the key-shape rules still apply.
NO_SECRETS: Final = Redactor()
