"""Secret-free forms of URLs and node lists, for everything that shows one.

Every place that prints, logs or raises with a server address goes through
:func:`redact_url` (one URL), :func:`redact_nodes` (a cluster's node list) or
:func:`redact_text` (free text that may embed URLs). They hide every form of
credentials redis-py accepts in a URL:

* userinfo: ``redis://user:pw@host``, ``redis://:pw@host``, ``rediss://...``,
  ``unix://user:pw@/path/redis.sock``;
* query arguments: ``?password=pw``, ``?username=u&password=pw``, and any
  other argument whose name says it carries a secret (``ssl_password``,
  ``token``, ``secret``...);
* the same in a scheme-less node (``user:pw@host:port``).

User names stay visible (they are not secrets and identify the ACL user);
passwords become ``***``. The redacted form keeps the host, port, path and
other query arguments, so an error still says where it was going.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

MASK = "***"
_SECRET_ARG = re.compile(r"pass|secret|token|credential|auth", re.IGNORECASE)
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def _redact_netloc(netloc: str) -> str:
    if "@" not in netloc:
        return netloc
    userinfo, _, hostport = netloc.rpartition("@")
    user, has_password, _ = userinfo.partition(":")
    return f"{user}:{MASK}@{hostport}" if has_password else f"{user}@{hostport}"


def _redact_query(query: str) -> str:
    if not query:
        return query
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(_SECRET_ARG.search(k) for k, _ in pairs):
        return query
    return urlencode([(k, MASK if _SECRET_ARG.search(k) else v) for k, v in pairs],
                     safe="*/:")


def redact_url(url: str) -> str:
    """``url`` with every password and secret query argument replaced by ``***``.

    Accepts full URLs (``redis://``, ``rediss://``, ``unix://``, ``http(s)://``)
    and scheme-less ``[user[:password]@]host:port`` nodes. Never raises: text
    that does not parse as a URL is returned masked entirely if it contains an
    ``@`` (it might hold a password), unchanged otherwise.
    """
    try:
        if "://" not in url:
            if "@" not in url:
                return url
            return _redact_netloc(url)  # a bare node: user:pw@host:port
        parts = urlsplit(url)
        query = _redact_query(parts.query)
        out = f"{parts.scheme}://{_redact_netloc(parts.netloc)}{parts.path}"
        out += f"?{query}" if query else ""
        # A '#' in a query password starts the fragment: the fragment may be its tail.
        return out + (f"#{MASK}" if parts.fragment else "")
    except ValueError:
        return MASK if "@" in url or "pass" in url.lower() else url


def split_password(url: str) -> tuple[str, str | None]:
    """``(url without its password, the password)``; ``(url, None)`` when it has none.

    Takes the userinfo's password (``redis://user:pw@host`` becomes
    ``redis://user@host``, ``unix://:pw@/path.sock`` becomes
    ``unix:///path.sock``) and a ``password`` query argument, which redis-py
    prefers when both are given; the user name and every other part stay as
    given. Other secret query arguments (``ssl_password``...) stay:
    :func:`redact_url` still hides them. ValueError if ``url`` does not parse.
    """
    parts = urlsplit(url)
    netloc, password = parts.netloc, None
    userinfo, at, hostport = netloc.rpartition("@")
    user, has_password, secret = userinfo.partition(":")
    if at and has_password:
        password = unquote(secret)
        netloc = f"{user}@{hostport}" if user else hostport
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    kept = [(k, v) for k, v in pairs if k != "password"]
    if len(kept) < len(pairs):
        password = next(v for k, v in pairs if k == "password")  # redis-py: the first
    if password is None:
        return url, None
    query = urlencode(kept)
    out = f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
    return out + (f"#{parts.fragment}" if parts.fragment else ""), password


def redact_nodes(nodes: Iterable[str]) -> list[str]:
    """Each cluster node of ``nodes`` through :func:`redact_url`."""
    return [redact_url(n) for n in nodes]


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
