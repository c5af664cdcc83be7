"""A private sshd on loopback addresses, so the pdsh/ssh launch route runs for real on one machine.

It listens on 127.0.0.1 and 127.0.0.2 (two "nodes") on a free port, accepts one key made for the
test, and touches nothing of the machine's own ssh set-up: the client options that point at the
key and skip host-key prompts travel in PDSH_SSH_ARGS_APPEND, which pdsh and the launcher's
pre-flight both honour.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.launch import free_port

SSHD = Path("/usr/sbin/sshd")
NODES = ("127.0.0.1", "127.0.0.2")


def sshd_available() -> str | None:
    """Why the ssh route cannot run here, or None when it can."""
    if not SSHD.is_file() or shutil.which("pdsh") is None or shutil.which("ssh-keygen") is None:
        return "needs Debian's openssh-server and pdsh (.ci/run installs them)"
    if os.geteuid() != 0:
        return "sshd on loopback needs root (privilege separation directory and host keys)"
    return None


@dataclass(frozen=True)
class Sshd:
    port: int  # for launch.sh --ssh-port
    client_options: str  # key and host-key settings, for PDSH_SSH_ARGS_APPEND


@contextmanager
def loopback_sshd(directory: Path) -> Iterator[Sshd]:
    directory.mkdir(parents=True, exist_ok=True)
    for key in ("host_key", "client_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / key)], check=True, timeout=120
        )
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())
    port = free_port()
    config = directory / "sshd_config"
    config.write_text(
        "".join(f"ListenAddress {node}\n" for node in NODES)
        + f"Port {port}\nHostKey {directory / 'host_key'}\nAuthorizedKeysFile {directory / 'authorized_keys'}\n"
        f"PidFile {directory / 'sshd.pid'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    log = (directory / "sshd.log").open("w")
    options = (
        f"-i {directory / 'client_key'} -o StrictHostKeyChecking=no "
        f"-o UserKnownHostsFile={directory / 'known_hosts'} -o LogLevel=ERROR"
    )
    with log, subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stderr=log) as server:
        try:
            _wait_for_login(port, options)
            yield Sshd(port, options)
        finally:
            server.terminate()


def _wait_for_login(port: int, options: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        login = ["ssh", "-n", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-p", str(port), *options.split()]
        probe = subprocess.run([*login, NODES[1], "true"], capture_output=True, text=True, timeout=10)
        if probe.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test sshd did not accept a login: {probe.stderr.strip()}")
        time.sleep(0.3)
