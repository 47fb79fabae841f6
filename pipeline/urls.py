"""What a source URL may contain before FFmpeg or a log line sees it.

FFmpeg writes an RTSP URL into its requests as it is given, so a CR/LF in the
URL becomes a second, forged request, to any host and port; a newline in a file
path forges a log line. And URL parsers disagree on a password that holds a raw
``@``, ``/``, ``?`` or ``#``: ``rtsp://admin:Pa@127.0.0.1:554/TAIL@10.9.9.9/s``
is a camera at 127.0.0.1 to FFmpeg and Python, but looks like one at 10.9.9.9
to a reader, and the password's tail travels in the request path. So:

* :func:`url_problem` refuses control characters (C0, DEL, C1) anywhere, spaces
  in network URLs, and any ``@`` outside the userinfo, with a message that says
  to percent-encode (``%40`` for ``@``, ``%2F`` for ``/``);
* :func:`protocol_whitelist` is the list of FFmpeg protocols a scheme needs,
  passed as FFmpeg's ``protocol_whitelist`` so a URL (or a redirect, or a
  playlist inside a file) can reach nothing else;
* :data:`FILE_FORMAT_DENYLIST` names the demuxers a file may not be opened
  with: playlist and description formats (``hls``, ``dash``, ``concat``,
  ``sdp``, ``rtsp``...) whose content names other files or hosts to open, and
  capture devices. The file source passes every other demuxer FFmpeg has as its
  ``format_whitelist``; an http(s) source the same list plus ``hls``, which
  its protocol whitelist keeps on the network;
* :data:`STREAM_FORMATS` names the one demuxer each of the other network and
  device schemes may use (MPEG-TS over UDP and SRT, RTP, video4linux2).
"""

from __future__ import annotations

import re

__all__ = [
    "FILE_FORMAT_DENYLIST",
    "PROTOCOL_WHITELISTS",
    "STREAM_FORMATS",
    "protocol_whitelist",
    "url_problem",
]

# C0 controls, DEL and C1 controls.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

# FFmpeg protocols each scheme needs, and nothing more. RTSP opens its control
# connection over tcp (tls for rtsps) and, with transport: udp, its media over
# rtp/udp; a file needs the file protocol only (no playlist may point at http).
# An HLS playlist's segments and keys are opened with its URL's list, so a playlist
# fetched over http(s) can name http(s) segments (crypto: AES-128 segments) but
# never a local file; https is http over tls over tcp (FFmpeg needs no "http" for
# it, so a redirect from https to plain http fails). SRT is libsrt's own UDP; a
# webcam is a device the video4linux2 demuxer opens itself, with no protocol.
PROTOCOL_WHITELISTS: dict[str, str] = {
    "file": "file",
    "rtsp": "rtsp,rtp,udp,tcp",
    "rtsps": "rtsps,rtsp,rtp,udp,tcp,tls",
    "http": "http,tcp,crypto",
    "https": "https,tls,tcp,crypto",
    "udp": "udp",
    "rtp": "rtp,udp",
    "srt": "srt",
    "v4l2": "file",
}


# Demuxers a file source may not use: their content names other files or hosts for
# FFmpeg to open (playlists, descriptions, scripts), or they are capture devices. A
# file is probed by content, so clip.mp4 holding an HLS playlist or an SDP
# description would otherwise be read as one. Every other demuxer is allowed.
FILE_FORMAT_DENYLIST = frozenset(
    {
        "hls", "dash", "concat", "sdp", "rtsp", "rtp", "sap", "imf", "webm_dash_manifest",
        "avisynth", "vapoursynth", "lavfi",
        "alsa", "fbdev", "kmsgrab", "oss", "video4linux2", "v4l2", "x11grab", "xcbgrab", "pulse",
        "jack", "openal", "sndio", "decklink", "android_camera", "dshow", "gdigrab", "vfwcap",
        "avfoundation", "libcdio", "libdc1394", "iec61883",
    }
)  # fmt: skip


# The demuxer of each stream scheme that is not probed among the file formats:
# ``format_whitelist`` for the first two, the forced input format for a webcam
# (a device cannot be probed). RTP carries MPEG-TS (payload type 33).
STREAM_FORMATS: dict[str, str] = {
    "udp": "mpegts",
    "srt": "mpegts",
    "rtp": "rtp",
    "v4l2": "video4linux2",
}


def protocol_whitelist(scheme: str) -> str:
    """FFmpeg's ``protocol_whitelist`` for a source scheme (``file`` for plain paths)."""
    return PROTOCOL_WHITELISTS[scheme]


def _show(char: str) -> str:
    return repr(char)[1:-1]


def url_problem(url: str) -> str | None:
    """Why ``url`` may not be used as a source, or None. Never echoes the userinfo."""
    control = _CONTROL.search(url)
    if control:
        return (
            f"the URL contains a control character ({_show(control.group())}) at position "
            f"{control.start()}; remove it (percent-encode it if it is really part of the URL)"
        )
    scheme = _SCHEME.match(url)
    if scheme is None:
        return None  # a plain file path: any other character is a file name's business
    rest = url[scheme.end() :]
    if " " in rest:
        return "the URL contains a space; percent-encode it as %20"
    # The authority ends at the first '/', '?' or '#'; userinfo is what precedes its '@'.
    end = len(rest)
    for sep in "/?#":
        pos = rest.find(sep)
        if pos != -1:
            end = min(end, pos)
    authority, tail = rest[:end], rest[end:]
    if "@" in tail:
        return (
            "the URL has an '@' after the host; if the password contains '@', '/', '?' or '#', "
            "percent-encode them (%40, %2F, %3F, %23)"
        )
    if authority.count("@") > 1:
        return "the URL's user or password contains a raw '@'; percent-encode it as %40"
    return None
