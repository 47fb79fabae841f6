"""Sources: where frames come from (files, test patterns, RTSP cameras, WHIP publishers).

``schemes`` is the registry the config and the API ask; ``base`` the :class:`Source`
every kind derives from; ``decode`` the one PyAV open/decode loop files and cameras
share; then one module per kind. See docs/sources.md.
"""
