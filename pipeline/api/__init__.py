"""The HTTP server: metrics, health, the sources API, WHIP ingest and the dashboard.

::

    http:
      listen: 127.0.0.1:8080     # host:port; port 0 picks a free one
      token: null                # bearer token; required (16+ characters) off loopback
      max_connections: 256       # open connections at once (at most half the open-file limit)
      max_connections_per_client: 64   # open connections from one client address
      header_timeout: 10.0       # seconds to send a request's headers
      keepalive_timeout: 15.0    # seconds an idle keep-alive connection stays open
      file_roots: []             # folders POST /v1/sources may open files in; none by default
      source_schemes: [file, test, rtsp, rtsps, whip, http, https, udp, rtp, srt]  # not v4l2

``vidpipe run CONFIG --http HOST:PORT`` serves it too (the token may come from
``VIDPIPE_HTTP_TOKEN``). Endpoints (docs/api.md has examples), each in the module
of its concern:

=========================================  ===============================================  ==============
``GET /healthz``, ``GET /readyz``          liveness / readiness (never need the token)      ``probes``
``GET /metrics``                           Prometheus text                                  ``probes``
``GET /v1/sources``                        every source (``pipeline.stats.SourceReport``)   ``sources``
``POST /v1/sources``                       add a source (JSON, same keys as YAML)           ``sources``
``DELETE /v1/sources/{id}``                stop and remove a source                         ``sources``
``GET /v1/sources/{id}/snapshot.jpg``      latest published frame, annotated                ``views``
``GET /v1/sources/{id}/stream.mjpeg``      live annotated view, multipart JPEG (``?fps=``)  ``views``
``GET /v1/stats``                          per-source fps/latency/drops, model batching     ``stats``
``GET /v1/fleet``                          in a fleet: workers, sources (owner, since)      ``fleet``
``GET /v1/models``                         the model repository's status                    ``models``
``POST /v1/models/{name}/reload``          swap in a model's new config and files (JSON)    ``models``
``DELETE /v1/models/{name}``               unload a model no stage uses                     ``models``
``POST /whip/{id}``                        WHIP: SDP offer in, answer out                   ``webrtc``
``DELETE /whip/{id}/{session}``            WHIP: end a session                              ``webrtc``
``POST /whep/{id}``                        WHEP: live annotated view over WebRTC            ``webrtc``
``DELETE /whep/{id}/{session}``            WHEP: end a session                              ``webrtc``
``GET /``                                  the dashboard                                    ``dashboard``
=========================================  ===============================================  ==============

With a token configured, every request but ``/healthz``, ``/readyz`` and the
dashboard's static files needs ``Authorization: Bearer <token>`` (``auth``).
Requests that change state are refused with 403 when they come from another site,
token or not, and their bodies must carry their own content type (``cross_site``,
``bodies``). ``server`` wires them together; ``listen`` checks where it may bind.
docs/security.md has the whole picture.
"""

from pipeline.api.listen import ApiConfigError, check_http_config, is_loopback, parse_listen
from pipeline.api.server import ApiServer

__all__ = ["ApiConfigError", "ApiServer", "check_http_config", "is_loopback", "parse_listen"]
