"""The one PyAV open/decode loop that files and RTSP cameras share, hardware decoding included.

::

    sources:
      - id: gate
        url: rtsp://10.0.0.5/stream1
        decode: auto        # auto: NVDEC when PyAV and FFmpeg support it, else software
                            # cpu: always software; cuda: NVDEC or fail

:func:`open_with_hwaccel` opens the container, with PyAV's CUDA hardware acceleration
when asked (``av.open(url, hwaccel=HWAccel("cuda"))``, PyAV ≥ 14); FFmpeg falls back
to software per stream when the codec or profile is not supported, and frames arrive
as ordinary ``VideoFrame`` objects either way.

:class:`AvSource` opens (:meth:`AvSource.open`), iterates decoded frames
(:meth:`AvSource.frames`) and hands each to the graph (:meth:`AvSource.emit_frame`);
every FFmpeg error becomes a :class:`SourceError` whose ``kind`` names the cause and
whose text has the URL's credentials redacted.

Per frame the CPU path writes the image twice: swscale converts YUV to RGB into a
frame FFmpeg allocates (:func:`copy_rgb`), and that frame's pixels are copied into
the source's pooled buffer. PyAV has no call that converts into memory the caller
owns, so the copy is what keeps the frame pool (and its bound on memory) in charge.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

import numpy as np

from pipeline.redact import redact_text
from pipeline.sources.base import SourceError, ThreadedSource
from pipeline.urls import FILE_FORMAT_DENYLIST, STREAM_FORMATS, protocol_whitelist

log = logging.getLogger("vidpipe.source")

__all__ = [
    "AvSource",
    "DecodeMode",
    "copy_rgb",
    "ffmpeg_error_kind",
    "ffmpeg_reason",
    "file_formats",
    "frame_rate",
    "hwaccel_support",
    "jpeg_size",
    "open_with_hwaccel",
]

DecodeMode = Literal["auto", "cpu", "cuda"]

# Bytes FFmpeg may read while it probes a stream at open (its own default, said
# explicitly): probing decodes frames too, under the source's max_pixels.
PROBE_BYTES = 5_000_000
# Microseconds of stream FFmpeg may probe when a source does not set less (its default).
PROBE_US = 5_000_000


# -- FFmpeg errors ---------------------------------------------------------------------------


def ffmpeg_reason(exc: BaseException, url: str = "") -> str:
    """An FFmpeg error as one short phrase, with ``url``'s credentials redacted from it."""
    text = getattr(exc, "strerror", None) or str(exc) or exc.__class__.__name__
    return redact_text(str(text).strip().rstrip("."), url)


def ffmpeg_error_kind(exc: BaseException) -> str:
    """What an FFmpeg (or socket) error means, in one word: :attr:`SourceError.kind`."""
    import av

    if isinstance(exc, av.error.ConnectionRefusedError):
        return "refused"
    if getattr(exc, "errno", None) in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    if isinstance(exc, av.error.HTTPUnauthorizedError):
        return "unauthorized"
    if isinstance(exc, av.error.HTTPForbiddenError):
        return "forbidden"
    if isinstance(exc, (av.error.HTTPNotFoundError, FileNotFoundError)):
        return "not_found"
    # PyAV interrupts a blocking call that outlived its timeout with ExitError.
    if isinstance(exc, (av.error.ExitError, av.error.TimeoutError)):
        return "timeout"
    if isinstance(exc, av.error.InvalidDataError):
        return "invalid_data"
    if isinstance(exc, av.error.EOFError):
        return "end_of_stream"
    if getattr(exc, "errno", None) == errno.EIO:
        return "io_error"  # also what FFmpeg's udp:// read gives when nothing arrived in time
    return "error"


# -- hardware decoding -----------------------------------------------------------------------


def hwaccel_support() -> tuple[bool, str]:
    """Whether PyAV can decode with CUDA here: ``(True, "")`` or ``(False, reason)``."""
    try:
        import av
    except ImportError:
        return False, "PyAV is not installed"
    try:
        from av.codec import hwaccel
    except ImportError:
        return False, f"PyAV {getattr(av, '__version__', '?')} has no hardware acceleration (needs ≥ 14)"
    if not hasattr(hwaccel, "HWAccel"):
        return False, f"PyAV {getattr(av, '__version__', '?')} has no av.codec.hwaccel.HWAccel"
    available = getattr(hwaccel, "hwdevices_available", None)
    if callable(available):
        try:
            devices = list(available())
        except Exception as exc:
            return False, f"cannot list FFmpeg hardware devices: {exc}"
        if "cuda" not in devices:
            return False, f"this FFmpeg build has no CUDA hwaccel (it has: {', '.join(devices) or 'none'})"
    return True, ""


class NoHardwareDecoder(RuntimeError):
    """``decode: cuda`` where NVDEC cannot run; it will not start working while the process runs."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"decode: cuda is not possible here ({reason}); it needs an NVIDIA GPU, its driver and "
            "an FFmpeg with CUDA: set decode: auto to fall back to the CPU, or decode: cpu"
        )


# Set once a CUDA open failed where a software open of the same URL worked: stop trying.
_hw_broken: str | None = None


def open_with_hwaccel(
    url: str,
    options: dict[str, str] | None = None,
    timeout: float | tuple[float, float] | None = None,
    decode: DecodeMode = "auto",
    container_options: dict[str, str] | None = None,
    input_format: str | None = None,
    source: str = "",
) -> tuple[Any, str]:
    """Open ``url`` for decoding; returns ``(container, "cuda" | "software")``.

    ``options`` go to the container and its streams, ``container_options`` to the
    container only (``protocol_whitelist``, ``format_whitelist``). ``auto`` tries
    the CUDA hwaccel and falls back to software with one log line; ``cuda`` raises
    :class:`NoHardwareDecoder` instead of falling back; ``cpu`` never tries. Errors opening
    the URL itself propagate unchanged (the caller's message names the source).
    ``input_format`` forces a demuxer (a device cannot be probed).
    """
    import av

    global _hw_broken
    options = dict(options or {})
    kwargs: dict[str, Any] = {
        "options": options,
        "container_options": dict(container_options or {}),
        "timeout": timeout,
        "format": input_format,
    }
    if decode == "cpu":
        return av.open(url, **kwargs), "software"
    supported, reason = hwaccel_support()
    who = f"source {source}: " if source else ""
    if not supported:
        if decode == "cuda":
            raise NoHardwareDecoder(reason)
        log.info("%shardware decoding unavailable (%s); decoding in software", who, reason)
        return av.open(url, **kwargs), "software"
    from av.codec.hwaccel import HWAccel

    if _hw_broken is not None and decode == "auto":
        return av.open(url, **kwargs), "software"
    try:
        accel = HWAccel(device_type="cuda", allow_software_fallback=decode != "cuda")
        return av.open(url, hwaccel=accel, **kwargs), "cuda"
    except (FileNotFoundError, ConnectionError, TimeoutError):
        raise  # the URL itself is the problem; a software open would fail the same way
    except Exception as exc:
        # FFmpeg creates the CUDA device when the decoder opens, so a machine without a
        # usable GPU fails here (e.g. "Operation not permitted") -- but so does a bad URL,
        # a wrong password or a damaged file. A software open tells the two apart: if it
        # fails too, its error (about the stream) is the one to report.
        container = av.open(url, **kwargs)
        if decode == "cuda":
            container.close()
            raise NoHardwareDecoder(
                f"FFmpeg could not start the CUDA decoder: {ffmpeg_reason(exc, url)}"
            ) from None
        _hw_broken = ffmpeg_reason(exc, url)
        log.info(
            "%shardware decoding failed to start (%s); decoding in software, and every source "
            "with decode: auto from now on",
            who,
            _hw_broken,
        )
        return container, "software"


# -- what a file may be ----------------------------------------------------------------------


@functools.cache
def file_formats() -> str:
    """FFmpeg's ``format_whitelist`` for files: every demuxer but :data:`FILE_FORMAT_DENYLIST`."""
    import av

    names: set[str] = set()
    for name in av.formats_available:
        try:
            if not av.ContainerFormat(name).is_input:
                continue
        except ValueError:
            continue
        # A demuxer has several names ("mov,mp4,m4a,..."): all of them, or none.
        parts = set(name.split(","))
        if not parts & FILE_FORMAT_DENYLIST:
            names |= parts
    return ",".join(sorted(names))


def jpeg_size(data: bytes) -> tuple[int, int]:
    """A JPEG's ``(width, height)`` from its frame header; ``(0, 0)`` when it has none.

    Walks the marker segments up to the start of the scan (a start-of-frame marker's
    bytes may appear inside entropy-coded data, so the data is never searched).
    """
    pos = 2 if data[:2] == b"\xff\xd8" else len(data)
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        # SOF0..SOF15, but not DHT (C4), JPG (C8) or DAC (CC).
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) and pos + 9 <= len(data):
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            return width, height
        if marker == 0xDA or length < 2:  # start of scan: no frame header before it
            break
        pos += 2 + length
    return 0, 0


# -- frames ----------------------------------------------------------------------------------


def frame_rate(stream: Any) -> float:
    """A video stream's average frame rate; 25 when the container does not say."""
    return float(stream.average_rate) if stream.average_rate else 25.0


def copy_rgb(frame: Any, out: np.ndarray) -> None:
    """Write ``frame`` (any pixel format, on the CPU or the GPU) into ``out`` as H×W×3 RGB.

    swscale converts into a new frame (skipped when the frame already is RGB); its
    rows are padded to ``line_size``, so they are copied through a strided view.
    """
    rgb = frame.reformat(format="rgb24")
    plane = rgb.planes[0]
    view = np.ndarray((rgb.height, rgb.width, 3), np.uint8, buffer=plane, strides=(plane.line_size, 3, 1))
    np.copyto(out, view)


class AvSource(ThreadedSource):
    """A stream FFmpeg demuxes and decodes through PyAV: the base of files and cameras."""

    # What decodes it once open: "cuda" (NVDEC) or "software".
    decoder = "software"
    # FFmpeg's decoder threads: frame threads are fastest but hold one frame back each.
    thread_type: ClassVar[str] = "AUTO"
    # A live stream skips a damaged packet (the next keyframe repairs the picture).
    skip_bad_packets: ClassVar[bool] = False
    # Demuxed packets go to the context's packet_listener (event clips); None costs nothing.
    gives_packets = True

    def open_options(self) -> dict[str, str]:
        if self.config.scheme == "https":
            # FFmpeg does not check certificates unless asked; the system's CAs decide.
            return {"tls_verify": "1" if self.config.tls_verify else "0"}
        return {}

    def open_timeout(self) -> float | tuple[float, float] | None:
        # A local file never hangs; anything over a network may, and PyAV's interrupt
        # ends a blocking open or read after these many seconds.
        if self.config.scheme == "file":
            return None
        return (self.config.open_timeout, self.config.read_timeout)

    def input_format(self) -> str | None:
        """The demuxer to use without probing (a webcam's); None probes the content."""
        return None

    def container_options(self) -> dict[str, str]:
        """What FFmpeg may reach from this URL: the scheme's protocols and demuxers."""
        scheme = self.config.scheme
        options = {"protocol_whitelist": protocol_whitelist(scheme)}
        if scheme == "file":
            options["format_whitelist"] = file_formats()
        elif scheme in ("http", "https"):
            # Everything a file may be, and HLS: its segments stay on http(s).
            options["format_whitelist"] = file_formats() + ",hls"
        elif scheme in STREAM_FORMATS:
            options["format_whitelist"] = STREAM_FORMATS[scheme]
        return options

    def decoder_limits(self) -> dict[str, str]:
        """What bounds FFmpeg's work before vidpipe sees a frame: probing and picture size.

        ``max_pixels`` goes to the decoders probing uses here and to the stream's own
        decoder in :meth:`video_stream`: FFmpeg refuses a larger picture before it
        allocates it, so a stream that switches to 16000x16000 costs nothing.
        """
        return {
            "probesize": str(PROBE_BYTES),
            "analyzeduration": str(PROBE_US),
            "max_pixels": str(self.config.max_pixels),
        }

    def open(self) -> Any:
        """Open the stream; raises :class:`SourceError` (with ``kind``) when it cannot."""
        import av

        limits = self.decoder_limits()
        # A source may probe less than the default, never past the pixel cap.
        options = {**limits, **self.open_options(), "max_pixels": limits["max_pixels"]}
        try:
            container, self.decoder = open_with_hwaccel(
                self.url,
                options,
                self.open_timeout(),
                self.config.decode,
                self.container_options(),
                self.input_format(),
                source=self.id,
            )
        except av.FFmpegError as exc:
            kind = ffmpeg_error_kind(exc)
            reason = ffmpeg_reason(exc, self.url)
            if kind == "not_found" and isinstance(exc, FileNotFoundError):
                raise SourceError(self.id, f"file not found: {self.display_url}", kind) from None
            raise SourceError(self.id, f"cannot open {self.display_url}: {reason}", kind, reason) from None
        except OSError as exc:  # a socket error PyAV did not translate
            reason = ffmpeg_reason(exc, self.url)
            raise SourceError(
                self.id, f"cannot open {self.display_url}: {reason}", ffmpeg_error_kind(exc), reason
            ) from None
        except NoHardwareDecoder as exc:  # decode: cuda asked for, not possible here
            raise SourceError(self.id, redact_text(str(exc), self.url), "no_gpu") from None
        return container

    def video_stream(self, container: Any) -> Any:
        """The container's first video stream, set up for decoding."""
        if not container.streams.video:
            raise SourceError(self.id, f"{self.display_url} has no video stream", "no_video")
        stream = container.streams.video[0]
        # The size the container declares, before the decoder allocates anything for it.
        codec = stream.codec_context
        if codec.width and codec.height:
            self.check_frame_size(codec.width, codec.height)
        # The decoder opens at the first packet; from then on it refuses larger pictures.
        codec.options = {**codec.options, "max_pixels": str(self.config.max_pixels)}
        stream.thread_type = self.thread_type
        return stream

    def frames(
        self, container: Any, stream: Any, cancelled: Callable[[], bool] | None = None
    ) -> Iterator[tuple[Any, float | None]]:
        """Each decoded frame of ``stream`` with its timestamp in seconds (None if it has none).

        Ends at the end of the stream, when the source is stopping or when
        ``cancelled()`` says so (checked at every packet, so a stream that never
        decodes still ends); a read or decode error raises :class:`SourceError` (a
        bad packet is skipped with :attr:`skip_bad_packets`). A picture over
        ``max_pixels``, refused by the decoder, raises kind ``too_large``.
        """
        import av

        time_base = float(stream.time_base) if stream.time_base else 0.0
        try:
            for packet in container.demux(stream):
                if self.stopping or (cancelled is not None and cancelled()):
                    return
                if self.packet_listener is not None:
                    self.packet_listener.on_packet(packet, stream)
                try:
                    decoded = packet.decode()
                except av.FFmpegError as exc:
                    self._check_refused_size(stream, packet)
                    if not self.skip_bad_packets:
                        raise
                    log.debug("source %s: skipped a packet: %s", self.id, ffmpeg_reason(exc, self.url))
                    continue
                # Frame threads drop a refused picture without an error; the context
                # keeps its size.
                self._check_refused_size(stream, None)
                for frame in decoded:
                    seconds = float(frame.pts) * time_base if frame.pts is not None and time_base else None
                    yield frame, seconds
            self._check_refused_size(stream, None)
        except av.FFmpegError as exc:
            reason = ffmpeg_reason(exc, self.url)
            raise SourceError(
                self.id, f"cannot decode {self.display_url}: {reason}", ffmpeg_error_kind(exc), reason
            ) from None

    def _check_refused_size(self, stream: Any, packet: Any | None) -> None:
        """After a decode error: raise ``too_large`` if the decoder refused the picture's size.

        H.264 and HEVC decoders keep the refused size in the codec context; MJPEG resets
        it to 0x0, and the size is read from the JPEG's own header instead.
        """
        codec = stream.codec_context
        width, height = codec.width, codec.height
        if packet is not None and not (width and height) and codec.name in ("mjpeg", "jpegls"):
            width, height = jpeg_size(bytes(packet))
        self.check_frame_size(width, height)

    def emit_frame(self, frame: Any, pts: float, capture_ts: float | None = None) -> bool:
        """Hand a decoded frame to the graph (see :meth:`Source.emit`)."""
        listener = self.packet_listener
        if listener is not None and frame.pts is not None and frame.time_base:
            listener.on_frame_time(float(frame.pts * frame.time_base), pts + self._pts_offset)
        return self.emit(pts, (frame.height, frame.width, 3), lambda out: copy_rgb(frame, out), capture_ts)
