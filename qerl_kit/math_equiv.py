"""math-verify on two bare answers (``math_verify_equal``), bounded: the prediction goes through
math-verify's LaTeX parser only, under timeouts, in a helper subprocess off the main thread.

What reaches sympy: the gold (dataset text) is parsed with math-verify's defaults. The prediction (model
text) is parsed with ``LatexExtractionConfig`` alone: latex2sympy2_extended builds sympy objects from
the LaTeX grammar (sympy's ``Number`` turns each digit string into a number through ``sympify``).
math-verify's expression extraction (``ExprExtractionConfig``), which hands text such as ``9**9**9``
to sympy's ``parse_expr`` (an ``eval``-based parser), is off for it. Answers longer than
``MAX_ANSWER_CHARS`` are never handed to math-verify. Split out of ``qerl_kit.rewards`` (docs/rewards.md).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import select
import subprocess
import sys
import threading

logger = logging.getLogger("qerl_kit.rewards")

MAX_ANSWER_CHARS = 1000  # longer predicted \boxed{} contents score 0.0; longer golds never reach math-verify
PARSING_TIMEOUT = 2      # seconds, per math-verify parse call
VERIFY_TIMEOUT = 2       # seconds, per math-verify comparison

# math-verify runs in the calling thread when that is the main thread (signal.alarm timeouts work)
# and in a helper subprocess otherwise; the worker enforces the same timeouts in its main thread
# and the parent adds a hard deadline on top (killing the worker if it is exceeded).
_WORKER_SRC = r"""
import json, sys
from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException
LATEX_ONLY = [LatexExtractionConfig()]
sys.stdout.write('{"ready": true}\n'); sys.stdout.flush()
for line in sys.stdin:
    q = json.loads(line)
    try:
        g = parse(q["g"], parsing_timeout=q["pt"])
        ok = bool(g) and verify(g, parse(q["p"], extraction_config=LATEX_ONLY, parsing_timeout=q["pt"]),
                                timeout_seconds=q["vt"])
        out = {"gold": bool(g), "ok": bool(ok)}
    except (Exception, TimeoutException) as e:
        out = {"gold": True, "ok": False}
    sys.stdout.write(json.dumps(out) + "\n"); sys.stdout.flush()
"""
_worker_lock = threading.Lock()
_worker: subprocess.Popen | None = None
_worker_state = {"broken": False, "atexit": False}


def _kill_worker() -> None:
    global _worker
    if _worker is not None:
        try:
            _worker.kill()
            _worker.wait(timeout=5)
        except Exception:
            pass
        _worker = None


def _readline(proc: subprocess.Popen, timeout: float) -> dict | None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    return json.loads(line) if line else None


def _worker_deadline(pt: int, vt: int) -> float:
    # verify() compares up to 2x2 parsed candidates, each under its own timeout
    return 2 * pt + 4 * vt + 5.0


def _verify_in_worker(gold: str, pred: str, pt: int, vt: int) -> tuple[bool, bool] | None:
    """(gold_parsed, equivalent) from the worker; None when the worker is unavailable."""
    global _worker
    with _worker_lock:
        if _worker_state["broken"]:
            return None
        try:
            if _worker is None or _worker.poll() is not None:
                _worker = subprocess.Popen([sys.executable, "-c", _WORKER_SRC], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                if not _worker_state["atexit"]:
                    _worker_state["atexit"] = True
                    atexit.register(_kill_worker)
                if _readline(_worker, 120.0) is None:
                    _worker_state["broken"] = True
                    raise RuntimeError("math-verify worker did not start")
            _worker.stdin.write(json.dumps({"g": gold, "p": pred, "pt": pt, "vt": vt}) + "\n")
            _worker.stdin.flush()
            out = _readline(_worker, _worker_deadline(pt, vt))
            if out is None:  # deadline passed or worker died: kill it, score 0
                _kill_worker()
                return True, False
            return bool(out["gold"]), bool(out["ok"])
        except Exception:
            logger.warning("math-verify worker failed; falling back to string comparison", exc_info=True)
            _kill_worker()
            return None


def _import_math_verify():
    try:
        import math_verify
        from math_verify.errors import TimeoutException
    except ImportError as e:
        raise ImportError("math_reward needs math-verify: `pip install math-verify` "
                          "(or `pip install qerl_kit[rewards]`)") from e
    return math_verify, TimeoutException


def math_verify_equal(gold: str, pred: str, parsing_timeout: int = PARSING_TIMEOUT,
                       verify_timeout: int = VERIFY_TIMEOUT) -> tuple[bool, bool] | None:
    """math-verify on two bare answers. Returns (gold_parsed, equivalent), or None when it could not
    run at all (worker unavailable in a non-main thread). Answers longer than ``MAX_ANSWER_CHARS``
    are not handed to math-verify: such a gold counts as unparsed, such a prediction as not equal."""
    if len(gold) > MAX_ANSWER_CHARS:
        return False, False
    if len(pred) > MAX_ANSWER_CHARS:
        return True, False
    mv, timeout_exc = _import_math_verify()
    g_src, p_src = "$\\boxed{" + gold + "}$", "$\\boxed{" + pred + "}$"
    pt, vt = max(1, math.ceil(parsing_timeout)), max(1, math.ceil(verify_timeout))
    if os.name == "posix" and threading.current_thread() is not threading.main_thread():
        return _verify_in_worker(g_src, p_src, pt, vt)
    try:
        g = mv.parse(g_src, parsing_timeout=pt)
        if not g:
            return False, False
        pred = mv.parse(p_src, extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=pt)  # no parse_expr
        return True, bool(mv.verify(g, pred, timeout_seconds=vt))
    except (Exception, timeout_exc):  # TimeoutException is a BaseException
        logger.debug("math-verify failed", exc_info=True)
        return True, False
