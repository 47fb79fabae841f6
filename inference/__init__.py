"""vidpipe's inference layer: model repository, dynamic batcher, backends, pre/post-processing.

Usable on its own; it never imports :mod:`pipeline`.
"""
