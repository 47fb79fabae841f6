"""Shared fixtures: a real nats-server per test, sample clips, schema validation, CLI runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pipeline.messages import detections_schema
from pipeline.nats_server import EmbeddedNats

# A test run started in the background by a shell without job control (`make test &` in a
# script, a CI runner) inherits SIGINT ignored, and so would every vidpipe it starts: the
# tests that press Ctrl-C on one would see nothing happen. A handler here is reset to the
# default in each child, so the children get a Ctrl-C as a terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ARTIFACTS = ROOT / "test-artifacts"

# The slow tier: `make unit` leaves these out, `make test` runs them. A test belongs here
# when it takes more than about a second on an idle 2-core machine: it starts a server
# per test (RTSP, Triton, Prometheus, an image), runs `vidpipe` in a subprocess, or runs
# a real model over a whole clip. ALL marks a whole module (its fixture is the slow part).
ALL = frozenset({"*"})
SLOW: dict[str, frozenset[str] | set[str]] = {
    "tests/deploy/test_image.py": ALL,
    "tests/deploy/test_ops_stack.py": ALL,
    "tests/inference/test_openvino.py": {
        "test_a_piece_that_fails_leaves_the_requests_free_for_the_next_batch",
        "test_default_precision_reads_the_same_text_and_boxes_as_f32",
        "test_static_shapes_run_a_batch_as_pieces_with_the_answers_of_single_runs",
        "test_text_boxes_are_the_same_normalised_in_the_model_or_on_the_host",
    },
    "tests/inference/test_triton.py": ALL,
    "tests/pipeline/test_api.py": {
        "test_refuses_to_listen_publicly_without_a_token",
    },
    "tests/pipeline/test_bad_input.py": ALL,
    "tests/pipeline/test_cli.py": ALL,
    "tests/pipeline/test_cli_tune.py": ALL,
    "tests/pipeline/test_config.py": {
        "test_bad_source_flag_is_a_usage_error",
        "test_every_shipped_config_validates",
        "test_exposed_http_without_token_is_refused_before_start",
        "test_validate_exits_2_with_file_line_errors_and_no_traceback",
        "test_validate_good_file_exits_0",
        "test_validate_missing_file_exits_2",
    },
    "tests/pipeline/test_dashboard.py": ALL,
    "tests/pipeline/test_embed.py": {
        "test_the_documented_example_runs_as_written",
    },
    "tests/pipeline/test_end_to_end.py": ALL,
    "tests/pipeline/test_first_hour.py": ALL,
    "tests/pipeline/test_fleet.py": ALL,
    "tests/pipeline/test_hostile.py": {
        "test_deep_nesting_is_refused_with_a_config_error",
    },
    "tests/pipeline/test_hostile_api.py": {
        "test_open_file_limit_no_flood_no_busy_loop",
        "test_short_token_off_loopback_is_refused",
    },
    "tests/pipeline/test_hostile_sources.py": {
        "test_a_frame_over_max_pixels_fails_the_source_before_any_buffer",
        "test_allow_redirects_lets_ffmpeg_follow_the_camera",
        "test_config_refuses_a_file_path_with_a_newline",
        "test_source_flag_refuses_a_crlf_url_with_exit_2",
        "test_source_flag_refuses_a_raw_at_in_the_password",
    },
    "tests/pipeline/test_inputs.py": {
        "test_https_checks_the_certificate_unless_told_not_to",
        "test_mpegts_pushed_over_udp_and_rtp_arrives_in_order",
    },
    "tests/pipeline/test_live_view.py": {
        "test_lines_and_zones_are_drawn_on_the_snapshot_mjpeg_and_whep",
        "test_mjpeg_viewer_gets_frames_and_one_that_never_reads_does_not_slow_the_pipeline",
    },
    "tests/pipeline/test_models_add.py": ALL,
    "tests/pipeline/test_ocr.py": ALL,
    "tests/pipeline/test_reliability.py": {
        "test_core_mode_rides_out_a_broker_outage_and_counts_what_it_drops",
        "test_jetstream_keeps_every_run_of_a_source",
        "test_jetstream_mode_loses_and_duplicates_nothing_across_a_broker_kill",
        "test_second_signal_forces_exit",
        "test_sigterm_drains_in_flight_frames_and_exits_0",
    },
    "tests/pipeline/test_rtsp.py": ALL,
    "tests/pipeline/test_tracking.py": {
        "test_reinfer_interval_classifies_a_track_when_new_moved_or_every_n_frames",
    },
    "tests/pipeline/test_zones.py": {
        "test_a_square_crossing_a_line_each_way_gives_two_crossings_and_matching_events",
        "test_summary_counts_frames_not_events",
    },
    "tests/test_soak.py": ALL,
    "tests/inference/test_quantize.py": {
        "test_quantize_refuses_bad_arguments_and_unreadable_sources",
    },
    "tests/pipeline/test_hostile_webrtc.py": {
        "test_pending_sessions_expire_and_count_against_their_address",
    },
    "tests/pipeline/test_metrics.py": {
        "test_an_overloaded_source_is_named_with_its_drop_rate_and_bottleneck_once_per_interval",
        "test_the_dashboard_shows_an_overloaded_source_as_the_log_says_it",
    },
    "tests/pipeline/test_outputs.py": {
        "test_clips_from_udp_mpegts_whose_timestamps_go_back_are_written_and_play",
        "test_an_event_in_the_first_frame_of_an_rtsp_stream_has_its_clip",
        "test_a_killed_run_leaves_a_recording_that_plays_to_the_kill_and_the_next_run_keeps_it",
        "test_a_source_that_stops_while_a_clip_records_leaves_every_file_playable",
        "test_the_clip_ring_is_bounded_in_bytes_at_any_bitrate_and_a_stop_releases_it",
        "test_each_line_crossing_makes_a_clip_announced_with_its_line_and_direction",
    },
    "tests/pipeline/test_hostile_streams.py": ALL,
    "tests/pipeline/test_hostile_probes.py": ALL,
    "tests/test_bench_capacity.py": {"test_capacity_bench_counts_a_file_the_same_on_every_run"},
    "tests/pipeline/test_auto_interval.py": {
        "test_a_pipeline_with_interval_auto_detects_the_same_frames_whatever_is_in_flight",
    },
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module, _, name = item.nodeid.partition("::")
        slow = SLOW.get(module, ())
        if slow is ALL or name.split("[")[0] in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream on a free loopback port."""
    server = EmbeddedNats(store_dir=str(tmp_path / "js")).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def sample_models() -> Path:
    return ROOT / "samples" / "models"


# A light graph (the squares detector only): live test sources never fall behind it.
SQUARES = """\
pipeline: demo
models: {models}
stages:
  - {{name: objects, type: infer, model: squares}}
"""


@pytest.fixture
def squares_config(tmp_path: Path, sample_models: Path) -> Path:
    path = tmp_path / "squares.yaml"
    path.write_text(SQUARES.format(models=sample_models))
    return path


@pytest.fixture(scope="session")
def demo_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from samples.make_clip import write_clip

    return write_clip(tmp_path_factory.mktemp("clips") / "demo.mp4", frames=45, fps=15)


def validate_message(message: dict[str, Any]) -> None:
    jsonschema.validate(message, detections_schema())


class Collector:
    """A separate nats-py subscriber that keeps every message it receives."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.subjects: list[str] = []
        self.nc: Any = None

    async def start(self, url: str, subject: str = "vidpipe.>") -> Collector:
        import nats

        self.nc = await nats.connect(url)

        async def on_msg(msg: Any) -> None:
            self.subjects.append(msg.subject)
            self.messages.append(json.loads(msg.data))

        await self.nc.subscribe(subject, cb=on_msg)
        await self.nc.flush()
        return self

    async def wait_for(self, count: int, timeout: float = 30.0) -> None:
        """Until at least ``count`` messages arrived; fails the test after ``timeout`` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while len(self.messages) < count:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{len(self.messages)} of {count} messages after {timeout}s")
            await asyncio.sleep(0.05)

    def by_source(self, source: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["source"] == source]

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        await c.close()


def run_cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``vidpipe`` as a user would, in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=full_env,
    )
