"""How long does ``detjac view`` take to open a store of 1,000 prompts? From the command to the drawn corpus page.

A synthetic store (``detjac.store.testing``: d_model 8, 4 tokens per prompt; the corpus page
reads only the prompts' attributes, so their size does not matter) of ``--prompts`` prompts is
written once (or reused with ``--store``). Then, each ``--repeat`` times:

1. ``detjac view STORE`` is started in a fresh process; *listening* is when it prints its URL;
2. a headless Chromium (selenium, Debian's chromium and chromedriver) opens the URL; *drawn* is
   when the corpus table holds every prompt, counted from the command's start (so it includes
   Python's start-up, the imports, reading every prompt's attributes and drawing the table);
3. the page is reloaded: *reopened* is the time to draw it again from the running server
   (prompts already read are kept, so only new ones are read).

The corpus payload alone (``Pages.data("corpus")`` of a new store handle, in this process; median of
``--repeat``) is timed too, with the ratio of its time to ``open_store(...).prompt_ids()``'s
(listing the folder). The machine's other work shows in the figures: run it on a quiet one. Prints a table and
writes ``benchmarks/results/view_open.json``.

    .venv/bin/python -m benchmarks.view_open                 # ~1 minute (writing the store: ~40 s)
    .venv/bin/python -m benchmarks.view_open --store /tmp/big.zarr --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from detjac.store import open_store
from detjac.store.testing import make_store
from detjac.view.headless import detjac_command, new_driver
from detjac.view.pages import Pages

ROOT = Path(__file__).resolve().parent.parent


def open_once(driver, store: Path, n: int) -> dict[str, float]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def drawn(d):
        return len(d.find_elements(By.CSS_SELECTOR, "#corpus tbody tr")) == n

    start = time.perf_counter()
    process = subprocess.Popen(detjac_command("view", str(store)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        line = process.stdout.readline()
        listening = time.perf_counter() - start
        url = line.split(" at ")[1].split(" ")[0]
        driver.get(url)
        WebDriverWait(driver, 120, poll_frequency=0.02).until(drawn)
        shown = time.perf_counter() - start
        again = time.perf_counter()
        driver.refresh()
        WebDriverWait(driver, 120, poll_frequency=0.02).until(drawn)
        return {"listening_s": listening, "drawn_s": shown, "reopened_s": time.perf_counter() - again}
    finally:
        process.terminate()
        process.communicate(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--store", type=Path, default=None, help="Reuse (or write once) the store here.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "view_open.json")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="detjac-view-bench-"))
    store = args.store or folder / "corpus.zarr"
    if not store.exists():
        started = time.perf_counter()
        make_store(store, prompts=args.prompts)
        print(f"wrote {args.prompts} prompts to {store} in {time.perf_counter() - started:.1f} s")
    n = len(open_store(store))
    listed, payload = [], []
    for _ in range(args.repeat):  # each a new store handle and new pages: nothing kept from the last time
        started = time.perf_counter()
        ids = open_store(store).prompt_ids()
        listed.append(time.perf_counter() - started)
        started = time.perf_counter()
        rows = Pages(open_store(store)).data("corpus")["prompts"]
        payload.append(time.perf_counter() - started)
        assert len(rows) == len(ids) == n
    listed, payload = statistics.median(listed), statistics.median(payload)
    driver = new_driver()
    try:
        runs = [open_once(driver, store, n) for _ in range(args.repeat)]
    finally:
        driver.quit()
    result = {"prompts": n, "repeat": args.repeat, "runs": runs,
              "median": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
              "corpus_payload_s": payload, "prompt_ids_s": listed, "payload_over_listing": payload / listed}
    print(f"{n} prompts; median of {args.repeat} fresh `detjac view` processes:")
    for key, value in result["median"].items():
        print(f"  {key:<12} {value:6.2f} s")
    print(f"corpus payload alone {payload:.2f} s ({payload / listed:.0f}x listing the prompts, {listed * 1e3:.1f} ms)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
