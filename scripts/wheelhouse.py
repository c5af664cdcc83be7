"""Builds a wheelhouse: every wheel `scripts/setup.sh` installs, for a named Python and platform, so
that a compute node without network installs with `scripts/setup.sh --wheelhouse DIR`.

    python3 scripts/wheelhouse.py DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64] [--no-torch]

Run it where the package registry is reachable and DeepSpeed builds (torch installed, as `make setup`
leaves it). DeepSpeed ships only a source distribution, so it is built here without prebuilt ops: a
pure-Python wheel for any Python 3, whose ops compile just in time on the node. Everything else is
resolved by pip for the target and downloaded as binary wheels.

`--no-torch` is for nodes that already have a (CUDA) torch: the rest is resolved against a
placeholder torch of `--torch-version` that declares no dependencies, so no torch wheel (several GB
with its CUDA wheels) is downloaded, nor nvidia-* or triton.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# As scripts/setup.sh installs them: the torch it pins, the DeepSpeed range it accepts, and the
# build backend that its editable install (without build isolation) needs in the target Python.
TORCH_VERSION = "2.13.0"
DEEPSPEED = Requirement("deepspeed>=0.19,<0.20")
BUILD_BACKEND = ["setuptools>=64", "wheel"]
# The placeholder's local version label: only the placeholder matches the pin, so pip never looks
# at a real torch, whose metadata can cost downloading the whole wheel.
PLACEHOLDER_LABEL = "present"
PLATFORM = re.compile(r"(manylinux_2_(?P<glibc>\d+)|manylinux\d+|linux)_(?P<arch>[a-z0-9_]+)")
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
# pip evaluates markers for the Python running it, not the target's: what it missed is added to
# the requirements for another round, this many at most.
RESOLVE_ROUNDS = 3


def main() -> None:
    args = _parse_arguments()
    wheelhouse = args.directory.resolve()
    wheelhouse.mkdir(parents=True, exist_ok=True)
    target = target_options(args.python_version, args.platform)
    environment = marker_environment(args.python_version, args.platform)
    deepspeed = build_deepspeed_wheel(wheelhouse)
    requirements = [*project_requirements(), *BUILD_BACKEND]
    with tempfile.TemporaryDirectory() as scratch:
        if args.no_torch:
            placeholder = write_placeholder_torch(Path(scratch), args.torch_version)
            requirements.append(f"torch=={args.torch_version}+{PLACEHOLDER_LABEL}")
            target_resolve = [*target, "--find-links", str(placeholder.parent)]
        else:
            requirements.append(f"torch=={args.torch_version}")
            target_resolve = target
        wanted = resolve(requirements, deepspeed, target_resolve, environment, Path(scratch))
    if args.no_torch:
        del wanted["torch"]
    del wanted["deepspeed"]
    download(sorted(wanted.values()), target, wheelhouse)
    _print_summary(wheelhouse, args.python_version)


def _parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path, help="where the wheels go (created if missing)")
    parser.add_argument("--python-version", help="the target Python, e.g. 3.12 (default: this interpreter's)")
    parser.add_argument(
        "--platform",
        help="the target's platform tag, e.g. manylinux_2_28_x86_64: wheels for that glibc or older "
        "(default: this machine's)",
    )
    parser.add_argument("--no-torch", action="store_true", help="leave torch out: the node already has one")
    parser.add_argument(
        "--torch-version",
        default=TORCH_VERSION,
        help=f"the torch downloaded, or with --no-torch the node's, which the rest must suit (default {TORCH_VERSION})",
    )
    args = parser.parse_args()
    if args.platform and not PLATFORM.fullmatch(args.platform):
        parser.error(f"--platform {args.platform}: only Linux tags such as manylinux_2_28_x86_64 are supported")
    return args


def build_deepspeed_wheel(wheelhouse: Path) -> Path:
    """DeepSpeed's wheel, pinned to the version installed here when setup.sh accepts it, built
    without ops and without pip's cache (a cached build may hold ops compiled for this machine)."""
    try:
        installed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    requirement = f"deepspeed=={installed}" if installed and DEEPSPEED.specifier.contains(installed) else str(DEEPSPEED)
    print(f"wheelhouse: building {requirement} without prebuilt ops", flush=True)
    for stale in wheelhouse.glob("deepspeed-*.whl"):
        stale.unlink()
    options = ["--quiet", "--no-cache-dir", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheelhouse)]
    _pip(["wheel", *options, requirement], env={**os.environ, "DS_BUILD_OPS": "0"})
    (wheel,) = wheelhouse.glob("deepspeed-*.whl")
    if not wheel.name.endswith("-py3-none-any.whl"):
        sys.exit(f"wheelhouse: {wheel.name} holds compiled ops; DS_BUILD_OPS=0 should have left them out")
    return wheel


def project_requirements() -> list[str]:
    """setup.py's install_requires and dev extra, read without running it. torch and DeepSpeed are
    left out: the caller decides where each comes from."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    setup = next(
        node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup"
    )
    wanted = {"install_requires", "extras_require"}
    arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in setup.keywords if keyword.arg in wanted}
    requirements = [*arguments["install_requires"], *arguments["extras_require"]["dev"]]
    return [text for text in requirements if canonicalize_name(Requirement(text).name) not in {"torch", "deepspeed"}]


def write_placeholder_torch(directory: Path, version: str) -> Path:
    """A wheel named torch that needs nothing, standing for the torch a node already has."""
    name = f"torch-{version}+{PLACEHOLDER_LABEL}"
    metadata = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}+{PLACEHOLDER_LABEL}\n"
    path = directory / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}.dist-info/METADATA", metadata)
        wheel.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{name}.dist-info/RECORD", "")
    return path


def resolve(
    requirements: list[str], deepspeed: Path, target: list[str], environment: dict[str, str], scratch: Path
) -> dict[str, str]:
    """{distribution: wheel URL} for everything `requirements` and DeepSpeed's wheel need on the
    target. pip resolves; a walk of the result with markers evaluated for the target drops what only
    pip's own Python needs and finds what pip skipped, which goes back to pip for another round."""
    roots = [*requirements, "deepspeed"]
    report = scratch / "report.json"
    # --target: pip 23 accepts platform options for an install only there; it also ignores what is installed.
    options = ["--dry-run", "--quiet", "--report", str(report), "--target", str(scratch / "target"), *target]
    for _ in range(RESOLVE_ROUNDS):
        print(f"wheelhouse: resolving {len(roots)} requirements", flush=True)
        _pip(["install", *options, *requirements, str(deepspeed)])
        resolved = {
            canonicalize_name(item["metadata"]["name"]): item for item in json.loads(report.read_text())["install"]
        }
        wanted, skipped = _walk(roots, resolved, environment)
        if not skipped:
            return wanted
        print(f"wheelhouse: the target also needs {', '.join(skipped)}", flush=True)
        requirements, roots = [*requirements, *skipped], [*roots, *skipped]
    sys.exit(f"wheelhouse: still unresolved for the target after {RESOLVE_ROUNDS} rounds: {', '.join(skipped)}")


def _walk(roots: list[str], resolved: dict[str, dict], environment: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The resolved distributions reachable from `roots` on the target ({name: URL}), and the
    requirements that apply there but that pip left unmet, without their markers (which pip would
    evaluate for its own Python again)."""
    pending = [Requirement(root) for root in roots]
    wanted: dict[str, str] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    skipped: set[str] = set()
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        item = resolved.get(name)
        if item is None or not requirement.specifier.contains(item["metadata"]["version"], prereleases=True):
            skipped.add(f"{requirement.name}{requirement.specifier}")
            continue
        if (name, frozenset(requirement.extras)) in visited:
            continue
        visited.add((name, frozenset(requirement.extras)))
        wanted[name] = item["download_info"]["url"]
        for text in item["metadata"].get("requires_dist") or []:
            dependency = Requirement(text)
            extras = {"", *requirement.extras}
            if dependency.marker is None or any(
                dependency.marker.evaluate({**environment, "extra": e}) for e in extras
            ):
                pending.append(dependency)
    return wanted, sorted(skipped)


def download(urls: list[str], target: list[str], wheelhouse: Path) -> None:
    """The resolved wheels by URL: exactly the files pip chose, from its cache where they are."""
    print(f"wheelhouse: downloading {len(urls)} wheels", flush=True)
    _pip(["download", "--quiet", "--no-deps", "--dest", str(wheelhouse), *target, *urls])


def target_options(python_version: str | None, platform: str | None) -> list[str]:
    """pip's options for binary wheels of the target. A manylinux tag stands for every older glibc's
    tags too, as pip on that machine would accept them."""
    options = ["--only-binary=:all:"]
    if python_version:
        options += ["--python-version", python_version, "--implementation", "cp"]
    if platform:
        options += [item for tag in platform_tags(platform) for item in ("--platform", tag)]
    return options


def platform_tags(platform: str) -> list[str]:
    match = PLATFORM.fullmatch(platform)
    if match["glibc"] is None:
        return [platform]
    glibc, arch = int(match["glibc"]), match["arch"]
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    legacy = [f"{alias}_{arch}" for minor, alias in LEGACY_MANYLINUX.items() if minor <= glibc]
    return [*tags, *legacy, f"linux_{arch}"]


def marker_environment(python_version: str | None, platform: str | None) -> dict[str, str]:
    """The values of PEP 508 markers on the target: this interpreter's, with the target's Python and
    platform laid over them."""
    environment = default_environment()
    if python_version:
        release = (*Version(python_version).release, 0, 0)
        environment["python_version"] = f"{release[0]}.{release[1]}"
        environment["python_full_version"] = ".".join(str(part) for part in release[:3])
        environment["implementation_name"] = "cpython"
        environment["platform_python_implementation"] = "CPython"
    if platform:
        environment["platform_machine"] = PLATFORM.fullmatch(platform)["arch"]
        environment |= {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix"}
    return environment


def _pip(arguments: list[str], env: dict[str, str] | None = None) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", *arguments], env=env, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"wheelhouse: pip {arguments[0]} failed (exit {result.returncode}); its message is above")


def _print_summary(wheelhouse: Path, python_version: str | None) -> None:
    wheels = sorted(wheelhouse.glob("*.whl"))
    mib = sum(wheel.stat().st_size for wheel in wheels) / 2**20
    python = f"PYTHON=python{python_version} " if python_version else ""
    print(f"wheelhouse: {wheelhouse} holds {len(wheels)} wheels, {mib:.1f} MiB")
    print(f"wheelhouse: install from it without network: {python}scripts/setup.sh --wheelhouse {wheelhouse}")


if __name__ == "__main__":
    main()
