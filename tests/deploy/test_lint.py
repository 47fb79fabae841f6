"""Static checks with the tools operators use: hadolint on both Dockerfiles,
kubernetes-validate on every manifest, and the lock file covering every dependency.

The GPU image cannot be built without an NVIDIA base image and a GPU, so lint is what it
gets; the CPU image is also built and run (test_image.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.conftest import ROOT

DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.gpu"]
HADOLINT = Path(sys.executable).parent / "hadolint"
IGNORE_RE = re.compile(r"^#\s*hadolint\s+(?:global\s+)?ignore=(\S+)")
PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path: Path) -> None:
    """No finding at any level (style included); every rule a file ignores is listed below."""
    result = subprocess.run(
        [str(HADOLINT), "--failure-threshold", "style", "--no-color", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_ignored_hadolint_rule_is_explained(path: Path) -> None:
    """An ignore directive sits under a comment that names each rule it ignores and says why."""
    lines = path.read_text(encoding="utf-8").splitlines()
    ignores = [(n, m.group(1)) for n, line in enumerate(lines) if (m := IGNORE_RE.match(line))]
    for n, rules in ignores:
        comment: list[str] = []
        for line in reversed(lines[:n]):
            if not line.startswith("#") or IGNORE_RE.match(line):
                break
            comment.append(line)
        text = " ".join(comment)
        for rule in rules.split(","):
            assert rule in text, f"{path.name}:{n + 1}: ignores {rule} without a comment saying why"
            assert len(text) > len(rule) + 40, f"{path.name}:{n + 1}: the reason for {rule} is too short"


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object under docker/ (k8s/ and whatever is added beside it)."""
    found = []
    for path in sorted((ROOT / "docker").rglob("*.y*ml")):
        if path.suffix not in (".yaml", ".yml"):
            continue
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc and "metadata" in doc:
                found.append((f"{path.relative_to(ROOT)}:{doc['kind']}/{doc['metadata'].get('name')}", doc))
    return found


MANIFESTS = manifests()


def test_manifests_are_found() -> None:
    kinds = {doc["kind"] for _, doc in MANIFESTS}
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler", "Secret"} <= kinds


@pytest.mark.parametrize(
    "doc",
    [doc for _, doc in MANIFESTS if doc["kind"] != "Kustomization"],
    ids=[name for name, doc in MANIFESTS if doc["kind"] != "Kustomization"],
)
def test_manifest_validates_against_kubernetes_schema(doc: dict[str, Any]) -> None:
    """Strict: a misspelt field fails instead of being dropped silently by the API server."""
    version = kubernetes_validate.latest_version()
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_kubernetes_validate_rejects_a_broken_manifest() -> None:
    """The check above can fail: a string where the schema wants an integer is caught."""
    doc = next(doc for _, doc in MANIFESTS if doc["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def requirement_names(requirements: list[str]) -> set[str]:
    return {normalise(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]) for req in requirements}


def test_lock_pins_every_dependency() -> None:
    """constraints.txt pins each dependency of the package, its test extra and the samples group.

    It fails after a dependency is added to pyproject.toml without running `make lock`,
    which would leave the new package unpinned in CI and in the image.
    """
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    project = pyproject["project"]
    wanted = [
        *project["dependencies"],
        *project["optional-dependencies"]["test"],
        *pyproject["dependency-groups"]["samples"],
    ]
    pinned = {
        normalise(m.group(1))
        for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines()
        if (m := PIN_RE.match(line))
    }
    missing = sorted(requirement_names(wanted) - pinned)
    assert not missing, f"not in constraints.txt: {missing}; run `make lock`"


def test_runtime_dependencies_leave_out_tests_samples_and_the_gui_opencv() -> None:
    """A plain install gets headless OpenCV and none of what only the tests or the samples use."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    runtime = requirement_names(pyproject["project"]["dependencies"])
    assert "opencv-python-headless" in runtime
    assert runtime.isdisjoint({"opencv-python", "jsonschema", "rapidocr-onnxruntime"}), runtime
    assert "jsonschema" in requirement_names(pyproject["project"]["optional-dependencies"]["test"])
    assert requirement_names(pyproject["dependency-groups"]["samples"]) == {"rapidocr-onnxruntime"}


# What every Debian/Ubuntu base (the slim image included) has: the C and C++ runtimes, zlib.
BASE_LIBRARIES = ("linux-vdso", "ld-linux", "libc.", "libm.", "libmvec.", "libdl.", "libpthread.",
                  "librt.", "libstdc++.", "libgcc_s.", "libz.")  # fmt: skip


def test_opencv_needs_no_system_package() -> None:
    """The Makefile's demo and the images install no system package: the cv2 imported here
    is the headless build, whose extension links nothing outside its wheel but the base
    libraries (the GUI build links libGL, GLib and X11, which the slim image lacks)."""
    import cv2

    libraries = sorted(Path(cv2.__file__).parent.glob("cv2*.so"))
    assert libraries, f"no cv2 extension next to {cv2.__file__}"
    ldd = subprocess.run(["ldd", str(libraries[0])], capture_output=True, text=True, timeout=60, check=True)
    wheel = str(Path(cv2.__file__).parent.parent)
    system = [
        Path(line.split()[0]).name
        for line in ldd.stdout.splitlines()
        if line.strip() and wheel not in line and not Path(line.split()[0]).name.startswith(BASE_LIBRARIES)
    ]
    assert not system, f"cv2 links system libraries the slim image lacks: {system}"
