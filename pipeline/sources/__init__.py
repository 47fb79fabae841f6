"""Sources: where frames come from (files, test patterns, cameras, webcams, network streams, WHIP).

``schemes`` is the table of URL schemes the config and the API ask; ``registry``
the classes serving each scheme, which the runtime asks; ``base`` the
:class:`Source` every kind derives from; ``decode`` the one PyAV open/decode loop
files and streams share; ``live`` the reconnecting supervisor every live FFmpeg
stream shares; then one module per kind (``file``, ``pattern``, ``rtsp``,
``stream``, ``whip``). What a URL names (its path, device, WHIP name, derived id)
is :mod:`pipeline.urls`'s. See docs/sources.md.
"""
