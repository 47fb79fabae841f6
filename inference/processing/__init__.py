"""Batched pre/post-processing for the model kinds vidpipe serves.

Images go in as H×W×3 uint8 RGB and results come out in source-image pixels.
The modules own one concept each: ``resize`` (geometry and normalisation into
the batch tensor), ``nms``, ``yolo``, ``classify``, ``db`` (text detection),
``ctc`` (text recognition), ``crop`` (second-stage crops), ``base`` (the
:class:`~inference.processing.base.Task` contract every kind implements) and
``tasks`` (the concrete task per ``task.kind`` and
:func:`~inference.processing.tasks.create_task`).

The package re-exports nothing: importing one module (``crop`` for a cascade)
does not import the others, and no module imports its own package back.
"""
