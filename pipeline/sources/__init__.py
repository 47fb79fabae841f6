"""Sources: where frames come from (files, test patterns, cameras, webcams, network streams, WHIP).

``schemes`` is the registry the config and the API ask; ``base`` the :class:`Source`
every kind derives from; ``decode`` the one PyAV open/decode loop files and streams
share; ``live`` the reconnecting supervisor every live FFmpeg stream shares; then
one module per kind (``file``, ``pattern``, ``rtsp``, ``stream``, ``whip``). See
docs/sources.md.
"""
