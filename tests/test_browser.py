"""A user's session in a real browser: JupyterLab + headless Chromium drive notebook 03's AQN panel
and notebook 04's training dashboard.

The test starts JupyterLab on a free localhost port (known token, its own config directories, no
browser), opens a copy of ``notebooks/03_aqn_exploration.ipynb`` whose ``parameters`` cell says
``SMOKE = True``, runs every cell from the Run menu, waits for the kernel to go idle and the panel
to render, drags the ``sigma_start`` slider, checks that the sigma readout and the schedule plot
both change, and presses "measure at this sigma" until the probe's table (entropy, distinct
samples, accuracy) appears. For 04 it runs a chunk from the "run chunk" button (disabled while it
runs), checks that the plot and the table change, presses stop while idle (a no-op: the next chunk
still trains) and stops a running chunk. Screenshots of the panels go to the test's tmp dir, and
to ``docs/images/browser_notebook{3,4}.png`` only with ``QERL_UPDATE_SCREENSHOTS=1`` (a default
test run never rewrites tracked files).

Needs Debian's Chromium at /usr/bin/chromium (``apt-get install -y chromium``) and Playwright for
Python (``pip install playwright``; its own browser download is never used). Skips, saying which
is missing, when either is absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.browser.jupyter import CHROMIUM, TOKEN, lab_server, launch_chromium

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "03_aqn_exploration.ipynb"
DASHBOARD_NOTEBOOK = ROOT / "notebooks" / "04_grpo_loop.ipynb"
SCREENSHOTS = ROOT / "docs" / "images"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium"),
]


def _smoke_copy(dst: Path, notebook: Path = NOTEBOOK) -> Path:
    """The notebook with SMOKE = True in its parameters cell and no stored outputs."""
    nb = json.loads(notebook.read_text())
    params = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    src = "".join(params[0]["source"])
    assert "SMOKE = False" in src
    params[0]["source"] = src.replace("SMOKE = False", "SMOKE = True")
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    nb.get("metadata", {}).pop("widgets", None)  # saved widget state: the test renders its own
    path = dst / notebook.name
    path.write_text(json.dumps(nb, indent=1))
    return path


def _keep_screenshot(src: Path, name: str) -> None:
    """Copy a screenshot into docs/images only when asked (QERL_UPDATE_SCREENSHOTS=1)."""
    if os.environ.get("QERL_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, SCREENSHOTS / name)


@contextlib.contextmanager
def _notebook_session(tmp_path: Path, notebook: Path):
    """JupyterLab serving a SMOKE copy of ``notebook``, a Chromium page on it, every cell run;
    yields the page. On a failure, a screenshot of what the browser showed goes to tmp_path."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install playwright")
    pytest.importorskip("jupyterlab")
    pytest.importorskip("ipywidgets")
    root = tmp_path / "lab"
    root.mkdir()
    nb_path = _smoke_copy(root, notebook)
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with lab_server(root, env=env) as base, sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        page = None
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{nb_path.name}?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=90_000)
            page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle")).first.wait_for(timeout=90_000)
            _run_all(page)
            yield page
        except Exception:
            if page is not None:
                page.screenshot(path=str(tmp_path / "failure.png"))
                print(f"screenshot of the failure: {tmp_path / 'failure.png'}")
            raise
        finally:
            browser.close()


def _schedule_start(readout: str) -> float:
    """sigma_start from the readout's "(schedule 1.0e-02 -> 5.0e-04)"."""
    match = re.search(r"schedule ([0-9.e+-]+) ->", readout)
    assert match, readout
    return float(match.group(1))


def _click_menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=menu).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def _started(page) -> bool:
    prompts = page.eval_on_selector_all(".jp-InputArea-prompt", "els => els.map(e => e.textContent)")
    return any(any(ch.isdigit() or ch == "*" for ch in t) for t in prompts)


def _run_all(page) -> None:
    """Run > Run All Cells; if no cell started within 20 s, the same command from the palette."""
    page.locator(".jp-Notebook").first.click()
    _click_menu(page, "Run", "Run All Cells")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _started(page):
            return
        time.sleep(0.5)
    page.keyboard.press("Control+Shift+C")
    page.keyboard.type("Run All Cells")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-InputArea-prompt')].some(e => /[0-9*]/.test(e.textContent))",
        timeout=30_000)


def _wait_idle_and_done(page, timeout_ms: int) -> None:
    """Kernel idle and no cell queued or running ("[*]")."""
    page.wait_for_function(
        """() => {
            const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
            const idle = ind ? ind.getAttribute('data-status') === 'idle' : false;
            const prompts = [...document.querySelectorAll('.jp-InputArea-prompt')].map(e => e.textContent);
            return idle && prompts.length > 0 && !prompts.some(t => t.includes('*'));
        }""", timeout=timeout_ms)


def _traceback_of(body: str) -> str:
    """The notebook's text from its first traceback on (what the failure message needs to show)."""
    i = body.find("Traceback")
    return body[max(0, i - 300):i + 4000]


def test_aqn_panel_in_jupyterlab(tmp_path):
    start = time.perf_counter()
    with _notebook_session(tmp_path, NOTEBOOK) as page:
        readout = page.locator(".qerl-sigma-readout").first
        readout.wait_for(state="attached", timeout=120_000)      # the panel rendered
        _wait_idle_and_done(page, timeout_ms=180_000)           # and every cell ran
        readout.scroll_into_view_if_needed()
        body = page.locator(".jp-Notebook").inner_text()
        assert "Traceback" not in body, _traceback_of(body)
        assert page.locator(".qerl-schedule-plot img").count() >= 1

        before_text = readout.inner_text()
        before_src = page.locator(".qerl-schedule-plot img").first.get_attribute("src")
        assert "sigma = " in before_text and before_src.startswith("data:image/png")

        # drag the sigma_start slider's handle to the right, as a user would
        slider = page.locator(".widget-slider", has=page.locator("label", has_text="sigma_start")).first
        slider.scroll_into_view_if_needed()
        handle = slider.locator(".noUi-handle").first
        box = handle.bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.move(x, y)
        page.mouse.down()
        page.mouse.move(x + 30, y, steps=8)
        page.mouse.up()

        page.wait_for_function(
            "([sel, old]) => { const e = document.querySelector(sel); return e && e.innerText !== old; }",
            arg=[".qerl-sigma-readout", before_text], timeout=30_000)
        after_text = readout.inner_text()
        page.wait_for_function(
            "([sel, old]) => { const e = document.querySelector(sel); return e && e.getAttribute('src') !== old; }",
            arg=[".qerl-schedule-plot img", before_src], timeout=30_000)
        after_src = page.locator(".qerl-schedule-plot img").first.get_attribute("src")
        assert after_text != before_text and "sigma = " in after_text
        assert _schedule_start(after_text) > _schedule_start(before_text)  # the dragged slider's value
        assert after_src != before_src and after_src.startswith("data:image/png")

        # and the probe: the tiny model's entropy and diversity at the marked step's sigma
        panel = page.locator(".jp-OutputArea-output", has=page.locator(".qerl-sigma-readout")).first
        panel.locator("button", has_text="measure").first.click()
        table = panel.locator("table", has_text="entropy").first
        table.wait_for(timeout=120_000)
        assert "distinct" in table.inner_text()

        panel.scroll_into_view_if_needed()
        page.screenshot(path=str(tmp_path / "browser_notebook3_page.png"), full_page=False)
        panel.screenshot(path=str(tmp_path / "browser_notebook3.png"))
        _keep_screenshot(tmp_path / "browser_notebook3.png", "browser_notebook3.png")
    print(f"browser test: readout {before_text!r} -> {after_text!r} in {time.perf_counter() - start:.0f} s")


def _dashboard_state(panel) -> tuple[str, str]:
    """(the plot's image data, the table's text) of the dashboard's output area."""
    return (panel.locator("img.qerl-plot").first.get_attribute("src") or "",
            panel.locator("table", has_text="reward").first.inner_text())


def _wait_changed(page, panel, before: tuple[str, str], timeout_ms: int) -> tuple[str, str]:
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        now = _dashboard_state(panel)
        if now[0] != before[0] and now[1] != before[1]:
            return now
        time.sleep(0.5)
    raise AssertionError("the dashboard's plot and table did not both change")


def test_training_dashboard_in_jupyterlab(tmp_path):
    start = time.perf_counter()
    with _notebook_session(tmp_path, DASHBOARD_NOTEBOOK) as page:
        run = page.locator("button", has_text="run chunk").first
        run.wait_for(state="attached", timeout=180_000)           # the dashboard rendered
        _wait_idle_and_done(page, timeout_ms=400_000)             # and every cell ran
        body = page.locator(".jp-Notebook").inner_text()
        assert "Traceback" not in body, _traceback_of(body)
        panel = page.locator(".jp-OutputArea-output", has=page.locator("button", has_text="run chunk")).first
        panel.scroll_into_view_if_needed()
        before = _dashboard_state(panel)
        assert before[0].startswith("data:image/png") and "reward" in before[1]

        # a short chunk from the button: disabled while it trains, then plot and table move on
        steps = panel.locator(".widget-text", has=page.locator("label", has_text="steps")).locator("input").first
        steps.fill("2")
        steps.press("Enter")
        temp = panel.locator(".widget-slider", has=page.locator("label", has_text="temperature")).first
        handle = temp.locator(".noUi-handle").first
        box = handle.bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.move(x, y)
        page.mouse.down()
        page.mouse.move(x + 25, y, steps=6)                       # a hotter temperature for this chunk
        page.mouse.up()
        run.click()
        page.wait_for_function("(b) => b.disabled", arg=run.element_handle(), timeout=10_000)
        after = _wait_changed(page, panel, before, timeout_ms=240_000)
        page.wait_for_function("(b) => !b.disabled", arg=run.element_handle(), timeout=240_000)

        # stop while idle changes nothing: the next chunk still trains
        panel.locator("button", has_text="stop").first.click()
        run.click()
        after2 = _wait_changed(page, panel, after, timeout_ms=240_000)
        page.wait_for_function("(b) => !b.disabled", arg=run.element_handle(), timeout=240_000)
        assert after2 != after
        panel.locator("code", has_text="idle: chunk of 2 steps done").first.wait_for(timeout=60_000)

        panel.scroll_into_view_if_needed()
        panel.screenshot(path=str(tmp_path / "browser_notebook4.png"))
        _keep_screenshot(tmp_path / "browser_notebook4.png", "browser_notebook4.png")
    print(f"browser test 04: two chunks from the button in {time.perf_counter() - start:.0f} s")
