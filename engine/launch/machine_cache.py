"""What only torch and DeepSpeed can tell about this machine, kept for the rest of the boot, so
`python -m engine validate` answers without importing either.

Asking torch whether there is a GPU, whether it runs bf16, and DeepSpeed whether it can build an op,
means importing them: seconds, more than the rest of checking a config. The answers cannot change
while the machine is up with the same software and the same devices in view, so every process that
asks (a launch's pre-flight, `plan`, the first `validate`) writes them to
$XDG_CACHE_HOME/dsengine/machine.json (else ~/.cache/dsengine/machine.json) and `validate` reads them.

Why it cannot go stale: the file holds one key, and an answer is read only where the key is this
process's own. The key is the file's format, the kernel's boot id (/proc/sys/kernel/random/boot_id,
new at every boot: a GPU added or a driver changed needs a reboot), the Python environment
(sys.prefix), the installed torch and DeepSpeed versions (their distributions' metadata, read
without importing them), and CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, which choose the devices a
process sees. A machine without a boot id caches nothing. An entry adds its own setting where its
answer reads more of the environment (the ops pre-flight: the op list, PATH, the compiler, torch's
extension folder and CUDA install, the arch list; HOME and XDG_CACHE_HOME, which place torch's
default extension folder, place this file too). The pre-flight keeps only a clean answer, so every
refusal is the live check's own; what a stored clean answer cannot see (a compiler uninstalled or
torch's extension folder emptied mid-boot) the launch's live pre-flight refuses before it builds.

A file that cannot be read or written (a read-only home) is only a cache miss.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
_FORMAT = 1  # of the entries; a change makes every stored file a miss


def cache_path() -> Path:
    """machine.json under $XDG_CACHE_HOME/dsengine, else ~/.cache/dsengine (as the token cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsengine" / "machine.json"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def machine_key() -> dict[str, Any] | None:
    """What every cached answer depends on, or None where the kernel gives no boot id."""
    try:
        boot_id = _BOOT_ID.read_text().strip()
    except OSError:
        return None
    return {
        "format": _FORMAT,
        "boot_id": boot_id,
        "prefix": sys.prefix,
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
        **{name: os.environ.get(name) for name in _DEVICE_ENV},
    }


def _read() -> dict[str, Any]:
    try:
        stored = json.loads(cache_path().read_text())
    except (OSError, RuntimeError, ValueError):  # RuntimeError: no home folder to find
        return {}
    return stored if isinstance(stored, dict) else {}


def _slot(entry: str, setting: Any) -> str:
    return f"{entry} {json.dumps(setting, sort_keys=True)}"


def recall(entry: str, setting: Any = None) -> Any:
    """The answer stored for `entry` asked under `setting` (JSON) in this boot's environment, else None."""
    key = machine_key()
    stored = _read()
    if key is None or stored.get("key") != key or not isinstance(stored.get("entries"), dict):
        return None
    return stored["entries"].get(_slot(entry, setting))


def remember(entry: str, value: Any, setting: Any = None) -> None:
    """Store `value` (JSON) as the answer for `entry` asked under `setting`. Processes of one launch
    write at once: each replaces the file whole, so a reader sees one writer's file, never a torn one
    (an answer another writer added meanwhile may be lost: a later miss asks again)."""
    key = machine_key()
    if key is None:
        return
    stored = _read()
    entries = stored["entries"] if stored.get("key") == key and isinstance(stored.get("entries"), dict) else {}
    if entries.get(_slot(entry, setting)) == value:
        return
    entries[_slot(entry, setting)] = value
    try:
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, written = tempfile.mkstemp(dir=path.parent, prefix=".machine.")
    except (OSError, RuntimeError):  # RuntimeError: no home folder to find
        return
    try:
        with os.fdopen(descriptor, "w") as out:
            json.dump({"key": key, "entries": entries}, out)
        os.replace(written, path)
    except OSError:
        Path(written).unlink(missing_ok=True)
