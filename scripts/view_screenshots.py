"""The screenshots of ``detjac view`` in the docs: a store of the shipped default model, shown in headless Chromium.

Runs ``detjac run default`` on a few dictionary prompts with every layer's output, attention and
MLP Jacobians (``--layers all --components layer,attn,mlp``), serves it with ``detjac view``, and
saves the corpus page, a prompt's page with one token picked, and its layers tab; then ``detjac graph`` of one
prompt shown with ``detjac view graph.json``, the most probable logit picked (what drives it). Needs Debian's
chromium and chromedriver and selenium (``tests/view_helpers.py``). CPU only, about a minute.

    .venv/bin/python scripts/view_screenshots.py                  # writes docs/view-*.png
    .venv/bin/python scripts/view_screenshots.py --out /tmp/shots --store /tmp/dictionary.zarr   # kept, reused
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from view_helpers import Served, detjac, new_driver  # noqa: E402

PROMPTS = [
    "Bread, n. An article of food made from flour or meal by",
    "Oak, n. (Bot.) Any tree or shrub of the genus Quercus. The oaks have",
    "Whale, n. (Zool.) Any aquatic mammal of the order",
    "Harp, n. (Mus.) A stringed instrument played with the",
    "Copper, n. (Chem.) A common metal of a reddish",
    "<script>alert(1)</script> is shown as text, n. A",
]


def shoot(driver, url: str, ready: str, path: Path, width: int = 1400) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.set_window_size(width, 1000)
    driver.get(url)
    WebDriverWait(driver, 300).until(lambda d: d.find_elements(By.CSS_SELECTOR, ready))
    time.sleep(0.5)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(height + 20, 2600))
    time.sleep(0.3)
    if not driver.save_screenshot(str(path)):
        raise SystemExit(f"Could not write {path}.")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--store", type=Path, default=None, help="Write the store here (kept), or reuse it.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="detjac-view-shots-"))
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    store = args.store or folder / "dictionary.zarr"
    if not store.exists():
        subprocess.run(detjac("run", "default", str(folder / "prompts.txt"), "--out", str(store), "--layers", "all",
                              "--components", "layer,attn,mlp"), check=True)
    served = Served(store)
    driver = new_driver()
    try:
        from detjac.store import open_store

        pid = next(p.id for p in open_store(store) if p.prompt.startswith("Oak"))
        shoot(driver, served.url, "#corpus tbody tr", args.out / "view-corpus.png")
        shoot(driver, served.url + f"#/prompt/{pid}/operator/10", '#decoded[data-token="10"] tbody tr',
              args.out / "view-prompt.png")
        shoot(driver, served.url + f"#/prompt/{pid}/layers/layer", "#layers-heatmap rect", args.out / "view-layers.png")
    finally:
        served.stop()
    try:
        graph_shot(driver, folder, args.out / "view-graph.png")
    finally:
        driver.quit()


def graph_shot(driver, folder: Path, path: Path) -> None:
    """``detjac graph`` of "Copper, n. A" on the default model, shown by ``detjac view copper.json`` with the most
    probable logit picked (its drivers drawn, the rest faded); saved as a 256-colour PNG."""
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    graph = folder / "copper.json"
    subprocess.run(detjac("graph", "-p", "Copper, n. A", "--out", str(graph), "--max-nodes", "200"), check=True)
    served = Served(graph)
    try:
        driver.set_window_size(1400, 1350)
        driver.get(served.url)
        picks = WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#logit-bar .logit-pick"))
        picks[0].click()
        time.sleep(0.5)
        driver.save_screenshot(str(path))
    finally:
        served.stop()
    Image.open(path).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
