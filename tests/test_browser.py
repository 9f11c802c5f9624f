"""A user's session in a real browser: JupyterLab + headless Chromium drive notebook 03's AQN panel.

The test starts JupyterLab on a free localhost port (known token, its own config directories, no
browser), opens a copy of ``notebooks/03_aqn_exploration.ipynb`` whose ``parameters`` cell says
``SMOKE = True``, runs every cell from the Run menu, waits for the kernel to go idle and the panel
to render, drags the ``sigma_start`` slider, checks that the sigma readout and the schedule plot
both change, and presses "measure at this sigma" until the probe's table (entropy, distinct
samples, accuracy) appears. A screenshot of the panel goes to ``docs/results/browser_notebook3.png`` and a
full-page one to the test's tmp dir.

Needs Debian's Chromium at /usr/bin/chromium (``apt-get install -y chromium``) and Playwright for
Python (``pip install playwright``; its own browser download is never used). Skips, saying which
is missing, when either is absent.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.browser.jupyter import CHROMIUM, TOKEN, lab_server, launch_chromium

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "03_aqn_exploration.ipynb"
SCREENSHOT = ROOT / "docs" / "results" / "browser_notebook3.png"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium"),
]


def _smoke_copy(dst: Path) -> Path:
    """The notebook with SMOKE = True in its parameters cell and no stored outputs."""
    nb = json.loads(NOTEBOOK.read_text())
    params = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    src = "".join(params[0]["source"])
    assert "SMOKE = False" in src
    params[0]["source"] = src.replace("SMOKE = False", "SMOKE = True")
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    path = dst / NOTEBOOK.name
    path.write_text(json.dumps(nb, indent=1))
    return path


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


def test_aqn_panel_in_jupyterlab(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install playwright")
    pytest.importorskip("jupyterlab")
    pytest.importorskip("ipywidgets")
    root = tmp_path / "lab"
    root.mkdir()
    nb_path = _smoke_copy(root)
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    with lab_server(root, env=env) as base, sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        page = None
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{nb_path.name}?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            # the kernel is started and connected: the status bar names it and says Idle
            page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=90_000)
            page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle")).first.wait_for(timeout=90_000)

            _run_all(page)
            readout = page.locator(".qerl-sigma-readout").first
            readout.wait_for(state="attached", timeout=120_000)      # the panel rendered
            _wait_idle_and_done(page, timeout_ms=180_000)           # and every cell ran
            readout.scroll_into_view_if_needed()
            body = page.locator(".jp-Notebook").inner_text()
            assert "Traceback" not in body, body[-2000:]
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
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp_path / "browser_notebook3.png", SCREENSHOT)
        except Exception:
            if page is not None:  # what the browser showed, for the failure report
                page.screenshot(path=str(tmp_path / "failure.png"))
                print(f"screenshot of the failure: {tmp_path / 'failure.png'}")
            raise
        finally:
            browser.close()
    print(f"browser test: readout {before_text!r} -> {after_text!r} in {time.perf_counter() - start:.0f} s")
