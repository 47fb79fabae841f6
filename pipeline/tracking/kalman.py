"""A constant-velocity Kalman filter over boxes, as SORT and ByteTrack use it.

The state is ``[cx, cy, a, h, vcx, vcy, va, vh]`` (centre, aspect ratio w/h,
height and their velocities); noise scales with the box height, so a far
(small) object and a near (large) one are equally sure of themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Noise per unit of box height (the values SORT/DeepSORT/ByteTrack share).
_STD_POSITION = 1.0 / 20
_STD_VELOCITY = 1.0 / 160


def xyxy_to_xyah(box: np.ndarray) -> np.ndarray:
    x1, y1, x2, y2 = (float(v) for v in box)
    w, h = x2 - x1, max(y2 - y1, 1e-6)
    return np.array([x1 + w / 2, y1 + h / 2, w / h, h])


def xyah_to_xyxy(state: np.ndarray) -> np.ndarray:
    cx, cy, a, h = (float(v) for v in state[:4])
    w = a * h
    return np.array([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])


_F = np.eye(8)
_F[:4, 4:] = np.eye(4)  # x' = x + v (one frame)
_H = np.eye(4, 8)


@dataclass(slots=True)
class KalmanBox:
    """One box's filter: ``predict`` one frame ahead, ``update`` with a measured box."""

    mean: np.ndarray
    covariance: np.ndarray

    @classmethod
    def start(cls, box: np.ndarray) -> KalmanBox:
        """A filter at ``box`` (x1, y1, x2, y2) with unknown velocity."""
        z = xyxy_to_xyah(box)
        h = z[3]
        std = [2 * _STD_POSITION * h, 2 * _STD_POSITION * h, 1e-2, 2 * _STD_POSITION * h,
               10 * _STD_VELOCITY * h, 10 * _STD_VELOCITY * h, 1e-5, 10 * _STD_VELOCITY * h]  # fmt: skip
        return cls(np.r_[z, np.zeros(4)], np.diag(np.square(std)))

    def predict(self) -> None:
        h = self.mean[3]
        std = [_STD_POSITION * h, _STD_POSITION * h, 1e-2, _STD_POSITION * h,
               _STD_VELOCITY * h, _STD_VELOCITY * h, 1e-5, _STD_VELOCITY * h]  # fmt: skip
        self.mean = _F @ self.mean
        self.covariance = _F @ self.covariance @ _F.T + np.diag(np.square(std))
        self.mean[3] = max(self.mean[3], 1e-3)  # a box never shrinks through zero height

    def update(self, box: np.ndarray) -> None:
        h = self.mean[3]
        std = [_STD_POSITION * h, _STD_POSITION * h, 1e-1, _STD_POSITION * h]
        innovation_cov = _H @ self.covariance @ _H.T + np.diag(np.square(std))
        gain = np.linalg.solve(innovation_cov, _H @ self.covariance).T
        self.mean = self.mean + gain @ (xyxy_to_xyah(box) - _H @ self.mean)
        self.covariance = self.covariance - gain @ innovation_cov @ gain.T

    def catch_up(self, box: np.ndarray, velocity: tuple[float, float]) -> None:
        """After frames without a measurement: take the centre's ``velocity`` (px per frame) measured
        elsewhere, and the aspect ratio of ``box``, the measurement just applied with :meth:`update`.

        After frames the detector skipped, one update moves the velocity only part of
        the way to the displacement between the two detections (the gain is small once
        the filter has settled), and the aspect ratio, whose noise is tiny, hardly at
        all: a track started on an object half in view stays narrow. Its predictions
        would lag the object for several detections.
        """
        self.mean[4], self.mean[5] = velocity
        self.mean[2] = xyxy_to_xyah(box)[2]

    def box(self) -> np.ndarray:
        """The current estimate as x1, y1, x2, y2."""
        return xyah_to_xyxy(self.mean)
