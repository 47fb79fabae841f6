"""Multi-object tracking maths: boxes in, track ids out; no pipeline types.

``kalman.py`` the constant-velocity Kalman filter, ``assignment.py`` IoU and
Hungarian matching, ``bytetrack.py`` the ByteTrack-class tracker,
``iou.py`` the greedy IoU tracker. ``pipeline/stages/track.py`` feeds them.
"""
