"""Helpers for the real-browser test: a throwaway JupyterLab server and headless Chromium.

``lab_server(root)`` starts ``jupyter lab`` on a free localhost port with a known token, its own
config, data, runtime and settings directories under ``root`` (so the user's ~/.jupyter is never
read or written), no browser, no update checks, and yields its base URL; on exit it stops the
server (SIGTERM, which shuts its kernels down) and waits for it. ``launch_chromium(p)`` starts
Debian's /usr/bin/chromium through Playwright with the flags a container needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "qerl-browser-test"
# JupyterLab user settings for a predictable page: every cell rendered (no windowing, so a widget
# scrolled out of view is still in the DOM) and no "news" notification over the notebook.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lab_server(root: Path, env: dict | None = None, startup_timeout: float = 90.0):
    port = free_port()
    home = root / ".jupyter-home"
    for sub in ("config", "data", "runtime", "settings", "workspaces"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    for plugin, values in SETTINGS.items():
        path = home / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    full_env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
                "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
                "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), **(env or {})}
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.open_browser=False",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI and containers run as root
    log = open(root / "jupyter-lab.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{(root / 'jupyter-lab.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"jupyter lab did not answer in {startup_timeout:.0f} s:\n"
                                   f"{(root / 'jupyter-lab.log').read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # our own process (its own session): it stops its kernels
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
