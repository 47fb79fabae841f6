"""Credentials out of everything vidpipe shows: logs, API answers, metric labels, errors.

Camera and broker URLs carry passwords (``rtsp://user:secret@10.0.0.7/stream1``),
and many cameras and CDNs take them in the query instead
(``http://cam/video.cgi?user=admin&pwd=secret``, ``?token=...``, SRT's ``passphrase=``).
Two functions, used everywhere a URL or a message about one leaves the process:

* :func:`redact_url` hides a URL's user info and the values of credential query
  keys: ``rtsp://***@10.0.0.7/stream1``, ``http://cam/video.cgi?user=***&pwd=***``;
* :func:`redact_text` scrubs free text (an FFmpeg error, which often echoes the URL
  it failed on) of one URL's credentials and of the user info and credential
  query values of any URL in it.

Passwords are often written unescaped, with ``@ / : ? #`` in them, which URL parsers
misread (``urlsplit`` ends the host at the first ``/``). So the user info is taken
as everything between ``scheme://`` and the *last* ``@`` -- it may hide more than
the credentials (a path with an ``@``), never less.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

__all__ = ["QUERY_SECRET_KEYS", "redact_text", "redact_url"]

_URL_USERINFO_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)(.*)@", re.DOTALL)
# A URL inside text ends at white space or a quote; its user info, at the last '@' before that.
_TEXT_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s'\"<>]*@")
# Pieces of a password this short would blank ordinary words in a message.
_MIN_PIECE = 4
_MASK = "***"
# Query keys whose values are credentials, alone or as the end of a longer key
# (``api_key``, ``access_token``, ``X-Amz-Signature``), in any case.
# ``loginuse``/``loginpas``: the CGI of many low-cost cameras (Foscam and its clones).
QUERY_SECRET_KEYS = (
    "user", "username", "usr", "pass", "passwd", "password", "passphrase", "pwd", "token",
    "key", "apikey", "secret", "auth", "sig", "signature", "credential", "credentials",
    "loginuse", "loginpas",
)  # fmt: skip
# Of those, the ones that name someone rather than hold a secret: masked in URLs, but
# not hunted through the rest of a message (an "admin" there is usually just a word).
_QUERY_USER_KEYS = frozenset({"user", "username", "usr", "loginuse"})
_QUERY_SECRET_RE = re.compile(
    r"([?&;](?:[A-Za-z0-9_.-]*[_.-])?(" + "|".join(QUERY_SECRET_KEYS) + r")=)([^&;#\s'\"<>]*)",
    re.IGNORECASE,
)
# Credentials in a URL's path, as many DVRs and NVRs take them (XMEye, some Dahua
# firmware): ``rtsp://nvr:554/user=admin_password=S3cret_channel=1_stream=0.sdp``. The
# value ends at the ``_`` that starts the next pair, or where a path segment does.
PATH_SECRET_KEYS = ("user", "username", "password", "passwd", "pwd", "pass")
_PATH_SECRET_RE = re.compile(
    r"([/_](" + "|".join(PATH_SECRET_KEYS) + r")=)([^_&;/?#\s'\"<>]*)",
    re.IGNORECASE,
)


def _redact_query(text: str) -> str:
    def masked(m: re.Match[str]) -> str:
        return m.group(1) + _MASK if m.group(3) else m.group(0)

    return _PATH_SECRET_RE.sub(masked, _QUERY_SECRET_RE.sub(masked, text))


def redact_url(url: str) -> str:
    """Hide credentials in a URL (``rtsp://user:pass@host`` → ``rtsp://***@host``,
    ``?user=admin&pwd=x`` → ``?user=***&pwd=***``)."""
    return _redact_query(_URL_USERINFO_RE.sub(r"\1***@", url, count=1))


def _userinfo(url: str) -> str:
    match = _URL_USERINFO_RE.match(url)
    return match.group(2) if match else ""


def _query_secrets(url: str) -> list[str]:
    """The values of ``url``'s credential query keys, user names aside."""
    found = [m for r in (_QUERY_SECRET_RE, _PATH_SECRET_RE) for m in r.finditer(url)]
    return [m.group(3) for m in found if m.group(3) and m.group(2).lower() not in _QUERY_USER_KEYS]


def _secrets(url: str) -> list[str]:
    """What of ``url`` must not be shown, longest first: the URL, its user info, the passwords."""
    userinfo = _userinfo(url)
    passwords = _query_secrets(url)
    if not userinfo and not passwords and redact_url(url) == url:
        return []
    found = {url, unquote(url)}
    if userinfo:
        found.update((userinfo, unquote(userinfo)))
        passwords.append(userinfo.partition(":")[2])
    # As written, decoded, and encoded (a tool may re-encode what it echoes).
    forms = [form for pw in passwords for form in (pw, unquote(pw), quote(unquote(pw), safe=""))]
    for secret in forms:
        # A password with URL delimiters in it may reach a message in pieces (a parser
        # that stopped at '/' shows the rest as a path), so its pieces go too.
        pieces = [secret, *re.split(r"[@/:?#%\s]+", secret)]
        found.update(p for p in pieces if len(p) >= _MIN_PIECE)
    return sorted((s for s in found if s), key=len, reverse=True)


def redact_text(text: str, url: str = "") -> str:
    """``text`` without ``url``'s credentials (raw or percent-decoded) or any URL's user info.

    Where ``url`` itself appears it is replaced by its :func:`redact_url` form, so the
    message still says which stream failed.
    """
    if url:
        shown = redact_url(url)
        for secret in _secrets(url):
            text = text.replace(secret, shown if secret in (url, unquote(url)) else _MASK)
    return _redact_query(_TEXT_USERINFO_RE.sub(r"\1***@", text))
