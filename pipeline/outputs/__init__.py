"""What leaves vidpipe besides messages: live views, annotated recordings and event clips.

``Outputs`` (manager.py) is the runtime's one entry point; ``FrameRelay`` (relay.py) the
latest-frame-only fan-out live views read; ``VideoFileWriter`` (video_file.py) the
annotated recording; ``ClipRecorder`` (clips.py) event clips cut from the camera's
packets; ``WhepServer`` (whep.py) WebRTC egress.
"""
