"""circuit-tracer's own frontend page, made to run offline: its CDN libraries replaced by local npm packages.

circuit-tracer 0.5.0's ``frontend/assets/index.html`` loads six scripts from CDNs (:data:`STAND_INS`). Each is
replaced by local copies of npm packages (``make ct-frontend-libs`` installs them into
``.cache/circuit-tracer-frontend``, see :data:`NPM_PACKAGES`), or dropped where it has no part in drawing a graph:

- ``d3.js``: ``d3@7.9.0`` and ``d3-collection@1.0.7`` (d3 v7 has no ``d3.nest``, which jetpack's ``d3.nestBy``
  calls);
- ``jetpack_2024-07-20.js``: ``d3-jetpack@2.3.0``'s ``build/d3-jetpack.cjs``, a UMD bundle, loaded through a
  two-line AMD ``define`` that hands it the global d3 (its browser-global branch replaces ``window.d3`` by an
  empty object before reading d3 from it, and its ``d3v7+jetpack.js`` bundle patches a second copy of
  d3-selection, not the one ``d3.select`` returns: ``appendMany is not a function``);
- ``dagre.min.js`` and ``pako.min.js``: the same versions from npm (``dagre@0.8.5``, ``pako@2.1.0``);
- ``npy_v0.js``: ``npyjs@0.6.0`` (an ES module, through an import map; the page calls ``npyjs.parse`` only for
  feature examples, which a detjac graph has none of);
- ``hotserver-client-ws.js``: dropped (the authors' live-reload client for development, not on npm).
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / ".cache" / "circuit-tracer-frontend" / "node_modules"
NPM_PACKAGES = ("d3@7.9.0", "d3-collection@1.0.7", "d3-jetpack@2.3.0", "dagre@0.8.5", "pako@2.1.0", "npyjs@0.6.0")
CDN = "https://transformer-circuits.pub/2025/attribution-graphs/static_js/lib/"
FILES = {"d3.js": "d3/dist/d3.min.js", "d3-collection.js": "d3-collection/dist/d3-collection.min.js",
         "d3-jetpack.js": "d3-jetpack/build/d3-jetpack.cjs", "dagre.js": "dagre/dist/dagre.min.js",
         "pako.js": "pako/dist/pako.min.js", "npyjs/index.js": "npyjs/index.js"}
GLUE = {  # small scripts of our own, between the packages
    "amd-d3.js": "window.define = (deps, factory) => factory(window.d3, ...deps.slice(1).map(() => window.d3));\n"
                 "window.define.amd = true;\n",
    "amd-off.js": "delete window.define;\n"  # dagre and pako then set their globals
                  # the 2024 jetpack's conventions() return c.drawAxis(sel); npm's has d3.drawAxis(c)
                  "const conventions = d3.conventions;\n"
                  "d3.conventions = (o) => { const c = conventions(o); "
                  "c.drawAxis = (sel) => d3.drawAxis({...c, svg: sel || c.svg}); return c; };\n",
    "fetch.js": "export default window.fetch.bind(window);\n",  # npyjs imports cross-fetch
}
LOCAL = "<script src='./lib/{}'></script>"
STAND_INS = {  # the page's script URL -> what stands in for it
    CDN + "hotserver-client-ws.js": "",
    CDN + "d3.js": LOCAL.format("d3.js") + LOCAL.format("d3-collection.js"),
    CDN + "jetpack_2024-07-20.js": "".join(LOCAL.format(f) for f in ("amd-d3.js", "d3-jetpack.js", "amd-off.js")),
    CDN + "npy_v0.js": '<script type="importmap">{"imports": {"npyjs": "./lib/npyjs/index.js", "cross-fetch": '
                       '"./lib/fetch.js"}}</script><script type="module">import Npy from "npyjs"; '
                       "window.npyjs = new Npy();</script>",
    "https://unpkg.com/dagre@0.8.5/dist/dagre.min.js": LOCAL.format("dagre.js"),
    "https://unpkg.com/pako@2.1.0/dist/pako.min.js": LOCAL.format("pako.js"),
}


def libs_missing() -> str | None:
    """What is lacking to run circuit-tracer's page offline (None: nothing)."""
    try:
        from circuit_tracer.frontend.local_server import DEFAULT_FRONTEND_DIR  # noqa: F401
    except ImportError:
        return "circuit-tracer 0.5.0 (pip install --no-deps circuit-tracer==0.5.0)"
    missing = [path for path in FILES.values() if not (LIBS / path).is_file()]
    return f"the npm packages standing in for its CDN scripts ({', '.join(missing)}): make ct-frontend-libs" \
        if missing else None


def offline_frontend(out: Path) -> Path:
    """A copy of circuit-tracer's frontend in ``out`` whose page loads only local files."""
    from circuit_tracer.frontend.local_server import DEFAULT_FRONTEND_DIR

    shutil.copytree(str(DEFAULT_FRONTEND_DIR), out)
    html = (out / "index.html").read_text()
    for url, local in STAND_INS.items():
        tag = f"<script src='{url}'></script>"
        assert tag in html, f"circuit-tracer's page no longer loads {url}"
        html = html.replace(tag, local)
    assert "://" not in "".join(line for line in html.splitlines() if "<script" in line)
    (out / "index.html").write_text(html)
    for name, package_file in FILES.items():
        (out / "lib" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(LIBS / package_file, out / "lib" / name)
    for name, text in GLUE.items():
        (out / "lib" / name).write_text(text)
    return out
