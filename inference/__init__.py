"""vidpipe's inference layer: model repository, dynamic batcher, backends, pre/post-processing.

Usable on its own; it never imports :mod:`pipeline`.
"""

import sys

# OpenVINO (on every ``import openvino``) and NNCF send usage telemetry to Google Analytics
# unless their telemetry package is missing: each event forks the process from a thread
# (multiprocessing) to post it, writes ~/intel/, and the fork inherits the event loop's
# signal wake-up fd, so a Ctrl-C that lands in the child reached vidpipe twice (a "forced
# exit"). vidpipe connects to nothing it was not configured to: mark the package missing,
# which both libraries take as "send nothing" (their own fallback). A program that imported
# it already, before vidpipe, keeps it.
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
