"""DeepSpeed hostfiles, checked before anything launches.

The lines are DeepSpeed's (`host slots=N`, `#` comments); which hosts and slots a launch uses
comes from DeepSpeed's own `--include` / `--exclude` / `--num_nodes` resolution, so the world size
checked here is the one the launcher will start. What is added is the error a user can act on:
the file and line of a malformed entry, a duplicate host, a host with zero slots.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

_ENTRY = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


class HostfileError(ValueError):
    """A hostfile problem, naming the file and line."""


def read_hostfile(path: Path) -> OrderedDict[str, int]:
    """Host -> slots, in file order."""
    if path.is_dir():
        raise HostfileError(f"hostfile {path} is a directory; give the file of `host slots=N` lines")
    if not path.is_file():
        raise HostfileError(f"hostfile {path} does not exist")
    hosts: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _ENTRY.match(line)
        where = f"{path}:{number}"
        if match is None:
            raise HostfileError(f"{where}: {raw.strip()!r} is not 'HOST slots=N'")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise HostfileError(f"{where}: host {host!r} is listed twice; give each host one line")
        if slots == 0:
            raise HostfileError(f"{where}: host {host!r} has 0 slots; give it at least 1 or remove the line")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"hostfile {path} lists no hosts")
    return hosts


def active_hosts(
    hosts: OrderedDict[str, int], include: str = "", exclude: str = "", num_nodes: int = -1
) -> OrderedDict[str, list[int]]:
    """Host -> slot indices the deepspeed launcher will use, resolved by DeepSpeed's own code."""
    if (include or exclude) and num_nodes > 0:
        raise HostfileError("--num_nodes cannot be combined with --include/--exclude (as in deepspeed)")
    try:
        active = parse_inclusion_exclusion(hosts, include, exclude)
    except ValueError as error:
        raise HostfileError(f"--include/--exclude: {error}") from None
    return apply_num_nodes_and_gpus(active, num_nodes, -1)


def ssh_problems(hosts: list[str], ssh_port: int | None = None, timeout_s: int = 10) -> list[str]:
    """One line per host that does not answer a non-interactive ssh, the way pdsh will reach it.

    DeepSpeed checks only the first host and only with plain `ssh`; pdsh then hangs on or fails
    at any other host. This checks every host in parallel with the options pdsh adds from
    PDSH_SSH_ARGS_APPEND (keys, known-hosts files), so a pass here means the launch can connect.
    """
    command = ["ssh", "-n", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout_s}"]
    if ssh_port is not None:
        command += ["-p", str(ssh_port)]
    command += shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))

    def probe(host: str) -> str | None:
        try:
            result = subprocess.run([*command, host, "true"], capture_output=True, text=True, timeout=timeout_s + 5)
        except subprocess.TimeoutExpired:
            return f"host {host!r} did not answer ssh within {timeout_s + 5} s"
        if result.returncode == 0:
            return None
        reason = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        return f"host {host!r} does not answer a non-interactive ssh: {reason}"

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return [problem for problem in pool.map(probe, hosts) if problem is not None]
