"""The screenshots of ``detjac view`` in the docs: a store of the shipped default model, shown in headless Chromium.

Runs ``detjac run default`` on a few dictionary prompts with every layer's output, attention and
MLP Jacobians (``--layers all --components layer,attn,mlp``), serves it with ``detjac view``, and
saves the corpus page, a prompt's page with one token picked, and its layers tab; then ``detjac graph`` of one
prompt shown with ``detjac view graph.json``, the most probable logit picked (what drives it). Needs Debian's
chromium and chromedriver and selenium (``detjac.view.headless``). CPU only, about a minute.

With ``--heads-model MODEL --heads-prompt TEXT``, only the attention heads' screenshots instead: ``detjac graph
--heads N`` (without ``--heads`` where this detjac's ``graph`` has no such option: the heads panel then says so),
``detjac attention`` of the head the heads panel ranks first (``--layer``/``--head`` when none is ranked), written
beside the graph as ``graph.qk.L{l}.H{h}.json`` so that ``detjac view`` finds it; then the heads panel
(``view-heads.png``) and that head's attention page (``view-attention.png``). SmolLM2-135M takes a few minutes.

With ``--target-graph GRAPH``, only the target's screenshots of that graph (e.g. ``detjac graph ... --target
"' Paris' - ' the'" --aside-first``): its target panel (``view-target.png``) and the top of the heads' direct effects
(``view-head-effects.png``).

With ``--neuron-graph GRAPH --neuron-index INDEX --neuron L_N``, only the neuron page of neuron N of layer L
(``view-neuron.png``), picked in the search box of ``detjac view GRAPH --neurons INDEX``.

    .venv/bin/python -m scripts.view_screenshots                  # writes docs/view-*.png
    .venv/bin/python -m scripts.view_screenshots --out /tmp/shots --store /tmp/dictionary.zarr   # kept, reused
    .venv/bin/python -m scripts.view_screenshots --heads-model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --heads-prompt "The capital of France is"                 # writes docs/view-heads.png, view-attention.png
    .venv/bin/python -m scripts.view_screenshots --target-graph paris-the.json   # view-target.png, ...
    .venv/bin/python -m scripts.view_screenshots --neuron-graph france.json --neuron-index smol-neurons.zarr \\
        --neuron 29_864                                            # writes docs/view-neuron.png
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from detjac.view.headless import Served, new_driver
from detjac.view.headless import detjac_command as detjac

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "Bread, n. An article of food made from flour or meal by",
    "Oak, n. (Bot.) Any tree or shrub of the genus Quercus. The oaks have",
    "Whale, n. (Zool.) Any aquatic mammal of the order",
    "Harp, n. (Mus.) A stringed instrument played with the",
    "Copper, n. (Chem.) A common metal of a reddish",
    "<script>alert(1)</script> is shown as text, n. A",
]


def shoot(driver, url: str, ready: str, path: Path, width: int = 1400, element: str | None = None) -> None:
    """Save the page at ``url`` once ``ready`` is there: whole (up to 2,600 pixels high), or only ``element``."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.set_window_size(width, 1000)
    driver.get(url)
    WebDriverWait(driver, 300).until(lambda d: d.find_elements(By.CSS_SELECTOR, ready))
    time.sleep(0.5)
    if element is not None:
        found = driver.find_element(By.CSS_SELECTOR, element)
        driver.set_window_size(width, min(int(found.size["height"]) + 140, 2600))
        driver.execute_script("arguments[0].scrollIntoView()", found)
    else:
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
    parser.add_argument("--heads-model", default=None, help="Only the heads' screenshots, of this model.")
    parser.add_argument("--heads-prompt", default="The capital of France is")
    parser.add_argument("--heads", type=int, default=500, help="Links loaded by detjac graph --heads.")
    parser.add_argument("--layer", type=int, default=20, help="The head shown when none is ranked.")
    parser.add_argument("--head", type=int, default=4)
    parser.add_argument("--work", type=Path, default=None, help="Keep the heads' graph and attention files here.")
    parser.add_argument("--target-graph", type=Path, default=None, help="Only the target's screenshots: this "
                        "graph JSON's target panel and heads' direct effects.")
    parser.add_argument("--neuron-graph", type=Path, default=None, help="Only the neuron page's screenshot: this "
                        "graph JSON, with --neuron-index and --neuron.")
    parser.add_argument("--neuron-index", type=Path, default=None, help="The graph's neuron index (detjac neurons).")
    parser.add_argument("--neuron", default=None, help="The neuron shown, LAYER_INDEX (e.g. 29_864).")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.neuron_graph is not None:
        if args.neuron_index is None or args.neuron is None:
            parser.error("--neuron-graph needs --neuron-index and --neuron")
        neuron_shot(args)
        return
    if args.heads_model is not None:
        heads_shots(args)
        return
    if args.target_graph is not None:
        target_shots(args.target_graph, args.out)
        return
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
    _quantized(path)
    print(f"wrote {path}")


def heads_shots(args: argparse.Namespace) -> None:
    """The heads panel and the top head's attention page of ``args.heads_model`` on ``args.heads_prompt``."""
    from detjac.view import GraphFile
    from detjac.view.attention_file import page_key, read_attention

    folder = args.work or Path(tempfile.mkdtemp(prefix="detjac-heads-shots-"))
    folder.mkdir(parents=True, exist_ok=True)
    graph = folder / "graph.json"
    if not graph.exists():
        helped = subprocess.run(detjac("graph", "--help"), capture_output=True, text=True, check=True).stdout
        heads = ["--heads", str(args.heads)] if "--heads" in helped else []
        subprocess.run(detjac("graph", args.heads_model, "-p", args.heads_prompt, "--out", str(graph), *heads),
                       check=True)
    rows = GraphFile(graph).data("graph")["metadata"]["heads"]["rows"]
    layer, head = (rows[0]["layer"], rows[0]["head"]) if rows else (args.layer, args.head)
    qk = folder / f"graph.qk.L{layer}.H{head}.json"
    if not qk.exists():
        subprocess.run(detjac("attention", args.heads_model, "-p", args.heads_prompt, "--layer", str(layer),
                              "--head", str(head), "--out", str(qk)), check=True)
    served = Served(graph)
    driver = new_driver()
    try:
        found = read_attention(qk)
        key = page_key(found["layer"], found["head"], found["query_position"])
        shoot(driver, served.url + f"#/{key}", "#terms tbody tr", args.out / "view-attention.png")  # first: light
        shoot(driver, served.url, "#heads-panel", args.out / "view-heads.png", element="#heads-panel")
    finally:
        driver.quit()
        served.stop()
    _quantized(args.out / "view-heads.png", args.out / "view-attention.png")


def target_shots(graph: Path, out: Path) -> None:
    """The target panel of ``graph`` and the top of its heads' direct effects (sorted by |effect|, as shown)."""
    from selenium.webdriver.common.by import By

    served = Served(graph)
    driver = new_driver()
    try:
        shoot(driver, served.url, "#contributions-table tbody tr", out / "view-target.png", element="#target-panel")
        driver.set_window_size(1400, 820)
        title = driver.find_element(By.CSS_SELECTOR, "#head-effects-title")
        driver.execute_script("arguments[0].scrollIntoView()", title)
        time.sleep(0.5)
        if not driver.save_screenshot(str(out / "view-head-effects.png")):
            raise SystemExit(f"Could not write {out / 'view-head-effects.png'}.")
    finally:
        driver.quit()
        served.stop()
    _quantized(out / "view-target.png", out / "view-head-effects.png")
    print(f"wrote {out / 'view-head-effects.png'}")


def _quantized(*paths: Path) -> None:
    """Each PNG rewritten in 256 colours, as every screenshot of the docs is."""
    from PIL import Image

    for path in paths:
        Image.open(path).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)


def neuron_shot(args: argparse.Namespace) -> None:
    """The neuron page of ``args.neuron`` (``LAYER_INDEX``) of the graph ``args.neuron_graph`` shown with the index
    ``args.neuron_index`` (``detjac view GRAPH --neurons INDEX``, the neuron picked in the search box)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    layer, neuron = (int(v) for v in args.neuron.split("_")[:2])
    served = Served(args.neuron_graph, "--neurons", str(args.neuron_index))
    driver = new_driver()
    path = args.out / "view-neuron.png"
    try:
        driver.set_window_size(1400, 1000)
        driver.get(served.url)
        WebDriverWait(driver, 120).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#neuron-search button"))
        driver.execute_script("document.getElementById('neuron-layer').value = arguments[0];"
                              "document.getElementById('neuron-index').value = arguments[1];", layer, neuron)
        driver.find_element(By.CSS_SELECTOR, "#neuron-search button").click()
        WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#neuron-positive tbody tr"))
        page = driver.find_element(By.CSS_SELECTOR, "#neuron-page")
        driver.set_window_size(1400, min(int(page.size["height"]) + 140, 2600))
        driver.execute_script("arguments[0].scrollIntoView()", page)
        time.sleep(0.5)
        page.screenshot(str(path))
    finally:
        driver.quit()
        served.stop()
    _quantized(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
