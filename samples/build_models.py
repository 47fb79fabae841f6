"""Builds the small ONNX graphs the project ships as sample models.

``squares`` finds the brightest square in a frame and answers in YOLO layout,
exactly, with no training: it thresholds the image, takes the extent of the
bright pixels and returns one box. The test-pattern source draws such a
square, so the demo and the tests can check boxes to the pixel.

    python samples/build_models.py          # rewrites samples/models/*/model.onnx
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent


def square_detector(
    height: int = 320,
    width: int = 320,
    layout: Literal["yolov8", "yolov5"] = "yolov8",
    threshold: float = 0.9,
) -> onnx.ModelProto:
    """A graph ``images[N,3,H,W] (0..1)`` → one box of the pixels brighter than ``threshold``.

    Output ``[N, 5, 1]`` (yolov8: cx, cy, w, h, score) or ``[N, 1, 6]`` (yolov5: cx, cy,
    w, h, objectness, class score). Score is 1 when a bright region exists, else 0.
    """
    xs = np.arange(width, dtype=np.float32)
    ys = np.arange(height, dtype=np.float32)
    inits = [
        numpy_helper.from_array(xs + 1, "xs_plus1"),
        numpy_helper.from_array(width - xs, "w_minus_xs"),
        numpy_helper.from_array(ys + 1, "ys_plus1"),
        numpy_helper.from_array(height - ys, "h_minus_ys"),
        numpy_helper.from_array(np.array(threshold, dtype=np.float32), "thr"),
        numpy_helper.from_array(np.array(width, dtype=np.float32), "W"),
        numpy_helper.from_array(np.array(height, dtype=np.float32), "H"),
        numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "ax1"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "ax2"),
    ]
    n = helper.make_node
    nodes = [
        n("ReduceMin", ["images"], ["dark"], axes=[1], keepdims=0),  # [N,H,W]
        n("Greater", ["dark", "thr"], ["bright_b"]),
        n("Cast", ["bright_b"], ["bright"], to=TensorProto.FLOAT),
        n("ReduceMax", ["bright"], ["cols"], axes=[1], keepdims=0),  # [N,W]
        n("ReduceMax", ["bright"], ["rows"], axes=[2], keepdims=0),  # [N,H]
        n("Mul", ["cols", "xs_plus1"], ["c_end"]),
        n("ReduceMax", ["c_end"], ["x2"], axes=[1], keepdims=1),  # [N,1]
        n("Mul", ["cols", "w_minus_xs"], ["c_start"]),
        n("ReduceMax", ["c_start"], ["w_minus_x1"], axes=[1], keepdims=1),
        n("Sub", ["W", "w_minus_x1"], ["x1"]),
        n("Mul", ["rows", "ys_plus1"], ["r_end"]),
        n("ReduceMax", ["r_end"], ["y2"], axes=[1], keepdims=1),
        n("Mul", ["rows", "h_minus_ys"], ["r_start"]),
        n("ReduceMax", ["r_start"], ["h_minus_y1"], axes=[1], keepdims=1),
        n("Sub", ["H", "h_minus_y1"], ["y1"]),
        n("ReduceMax", ["cols"], ["score"], axes=[1], keepdims=1),
        n("Add", ["x1", "x2"], ["xsum"]),
        n("Mul", ["xsum", "half"], ["cx"]),
        n("Add", ["y1", "y2"], ["ysum"]),
        n("Mul", ["ysum", "half"], ["cy"]),
        n("Sub", ["x2", "x1"], ["bw"]),
        n("Sub", ["y2", "y1"], ["bh"]),
    ]
    if layout == "yolov8":
        nodes.append(n("Concat", ["cx", "cy", "bw", "bh", "score"], ["rows5"], axis=1))  # [N,5]
        nodes.append(n("Unsqueeze", ["rows5", "ax2"], ["output0"]))  # [N,5,1]
        out_shape: list[str | int] = ["N", 5, 1]
    else:
        nodes.append(n("Concat", ["cx", "cy", "bw", "bh", "score", "score"], ["rows6"], axis=1))
        nodes.append(n("Unsqueeze", ["rows6", "ax1"], ["output0"]))  # [N,1,6]
        out_shape = ["N", 1, 6]
    used = {name for node in nodes for name in node.input}
    graph = helper.make_graph(
        nodes,
        f"squares_{layout}",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, height, width])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, out_shape)],
        initializer=[t for t in inits if t.name in used],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> int:
    target = HERE / "models" / "squares" / "model.onnx"
    onnx.save(square_detector(), target)
    print(f"wrote {target.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
