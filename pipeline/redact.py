"""Credentials out of everything vidpipe shows: logs, API answers, metric labels, errors.

Camera and broker URLs carry passwords (``rtsp://user:secret@10.0.0.7/stream1``).
Two functions, used everywhere a URL or a message about one leaves the process:

* :func:`redact_url` hides a URL's user info: ``rtsp://***@10.0.0.7/stream1``;
* :func:`redact_text` scrubs free text (an FFmpeg error, which often echoes the URL
  it failed on) of one URL's credentials and of the user info of any URL in it.

Passwords are often written unescaped, with ``@ / : ? #`` in them, which URL parsers
misread (``urlsplit`` ends the host at the first ``/``). So the user info is taken
as everything between ``scheme://`` and the *last* ``@`` -- it may hide more than
the credentials (a path with an ``@``), never less.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

__all__ = ["redact_text", "redact_url"]

_URL_USERINFO_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)(.*)@", re.DOTALL)
# A URL inside text ends at white space or a quote; its user info, at the last '@' before that.
_TEXT_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s'\"<>]*@")
# Pieces of a password this short would blank ordinary words in a message.
_MIN_PIECE = 4
_MASK = "***"


def redact_url(url: str) -> str:
    """Hide credentials in a URL (``rtsp://user:pass@host`` → ``rtsp://***@host``)."""
    return _URL_USERINFO_RE.sub(r"\1***@", url, count=1)


def _userinfo(url: str) -> str:
    match = _URL_USERINFO_RE.match(url)
    return match.group(2) if match else ""


def _secrets(url: str) -> list[str]:
    """What of ``url`` must not be shown, longest first: the URL, its user info, the password."""
    userinfo = _userinfo(url)
    if not userinfo:
        return []
    password = userinfo.partition(":")[2]
    found = {url, unquote(url), userinfo, unquote(userinfo)}
    # As written, decoded, and encoded (a tool may re-encode what it echoes).
    for secret in (password, unquote(password), quote(unquote(password), safe="")):
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
    return _TEXT_USERINFO_RE.sub(r"\1***@", text)
