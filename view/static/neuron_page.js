// detjac view: neuron pages (`detjac view ... --neurons neurons.zarr`). A click on a graph's neuron, or the search
// box (layer, index) in the header, shows the neuron's page below the main page: its top contexts of each sign (the
// token highlighted, a few tokens around it), its histogram, its logit effects. Opened from a graph's node, the page
// leads with the side the node fires on (its label, contexts and logit effects of that sign first). Every text of the corpus and the
// model (tokens, labels) is set with textContent only (Dom.h), never parsed as markup. A static export
// (`--export DIR --neurons ...`) holds the pages of its graphs' neurons only: its search box offers those.
"use strict";

(() => {
  const {h, svg} = Dom;
  const MODE = document.querySelector('meta[name="detjac-mode"]').content;
  const waiting = new Map();
  const previous = window.detjacData;
  window.detjacData = (key, value, error) => {  // this script's keys, then the page's own
    const w = waiting.get(key);
    if (!w) return previous(key, value, error);
    waiting.delete(key);
    if (error != null) w.reject(new Error(error));
    else w.resolve(value);
  };

  function load(key) {
    return new Promise((resolve, reject) => {
      waiting.set(key, {resolve, reject});
      const s = document.createElement("script");
      s.src = MODE === "static" ? "data/" + key.split("/").join(".") + ".js"
        : "api/" + key.split("/").map(encodeURIComponent).join("/") + "?js";
      const done = () => {
        s.remove();
        if (waiting.has(key)) {
          waiting.delete(key);
          reject(new Error(MODE === "static" ? `This snapshot has no page for ${key}.`
            : `No answer from detjac view for ${key}.`));
        }
      };
      s.onerror = done;
      s.onload = done;
      document.head.appendChild(s);
    });
  }

  const section = h("section", {id: "neuron-page", class: "neuron-page", hidden: true});
  document.body.insertBefore(section, document.querySelector("footer"));

  const fmt = (v) => (v == null ? "" : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(2)
    : v.toFixed(3));

  function contextRow(c) {
    return h("tr", {},
      h("td", {class: "num"}, fmt(c.value)),
      h("td", {class: "num"}, String(c.line)),
      h("td", {class: "context mono"}, c.before.join(""), h("mark", {}, c.token), c.after.join("")));
  }

  function contexts(title, rows, id) {
    return h("div", {class: "neuron-contexts"}, h("h4", {}, title),
      rows.length ? h("table", {id}, h("thead", {}, h("tr", {}, h("th", {}, "value"), h("th", {}, "line"),
        h("th", {}, "context"))), h("tbody", {}, rows.map(contextRow)))
        : h("p", {class: "note"}, "none in the corpus"));
  }

  function histogram(hist) {  // bars of log(1 + count), one per bin between the edges
    const W = 520, H = 90, n = hist.counts.length, bw = W / n;
    const top = Math.max(1, ...hist.counts.map((c) => Math.log1p(c)));
    const g = svg("svg", {id: "neuron-histogram", width: W, height: H + 16, role: "img",
      "aria-label": "histogram of the neuron's values"});
    hist.counts.forEach((c, i) => {
      const bh = (H * Math.log1p(c)) / top;
      const lo = i === 0 ? "-inf" : hist.edges[i - 1], hi = i === n - 1 ? "inf" : hist.edges[i];
      const bar = svg("rect", {x: i * bw, y: H - bh, width: Math.max(1, bw - 1), height: bh, class: "bar"});
      bar.append(svg("title", {}, `[${lo}, ${hi}): ${c}`));
      g.append(bar);
    });
    g.append(svg("text", {x: 0, y: H + 13, class: "axis"}, "-1e3"), svg("text", {x: W / 2 - 4, y: H + 13,
      class: "axis"}, "0"), svg("text", {x: W - 24, y: H + 13, class: "axis"}, "1e3"));
    return g;
  }

  function writes(title, rows, id) {
    return h("div", {class: "neuron-writes"}, h("h4", {}, title),
      h("ol", {id}, rows.map(([t, v]) => h("li", {}, h("span", {class: "mono"}, JSON.stringify(t)), " ", fmt(v)))));
  }

  // `activation`: the value of the graph node the page is opened from (null from the search box). A negative one
  // leads with the negative side: its label, contexts and the tokens its write vector lowers come first.
  function render(p, activation) {
    const negative = activation != null && activation < 0;
    const sides = [contexts("top positive contexts", p.contexts.positive, "neuron-positive"),
      contexts("top negative contexts", p.contexts.negative, "neuron-negative")];
    const effects = [writes("its write vector raises", p.writes.raises, "neuron-raises"),
      writes("its write vector lowers", p.writes.lowers, "neuron-lowers")];
    if (negative) { sides.reverse(); effects.reverse(); }
    section.replaceChildren(
      h("h3", {id: "neuron-title"}, `neuron ${p.layer}.${p.neuron}`),
      h("p", {id: "neuron-clerp", class: "text", "data-side": negative ? "negative" : "positive"},
        negative ? p.clerp_negative : p.clerp),
      activation == null ? null : h("p", {class: "note", id: "neuron-side"}, negative
        ? `The graph's node fires negatively here (activation ${fmt(activation)}): its negative side first (a ` +
          "negative activation raises the tokens its write vector lowers)."
        : `The graph's node fires positively here (activation ${fmt(activation)}): its positive side first.`),
      h("p", {class: "note", id: "neuron-stats"},
        `positive at ${(100 * p.frequency).toFixed(1)}% of ${p.tokens} tokens (negative ${
          (100 * p.negative_share).toFixed(1)}%), mean ${fmt(p.mean)}, sd ${fmt(p.std)}; quantiles (bins) 1% ${
          p.quantiles["1%"]}, 50% ${p.quantiles["50%"]}, 99% ${p.quantiles["99%"]}`),
      histogram(p.histogram),
      h("div", {class: "neuron-columns"}, sides),
      h("div", {class: "neuron-columns"}, effects));
    section.dataset.shown = `${p.layer}.${p.neuron}`;  // the neuron shown, once its page is drawn
    section.hidden = false;
  }

  function show(layer, index, activation = null) {
    section.hidden = false;
    section.replaceChildren(h("p", {class: "note"}, `Loading neuron ${layer}.${index}…`));
    load(`neuron/${layer}/${index}`).then((p) => render(p, activation),
      (e) => section.replaceChildren(h("p", {class: "error", id: "neuron-error"}, e.message)));
  }

  // The search box: layer and index in the server; in a snapshot, a list of the neurons it holds, and why.
  function searchForm(info) {
    if (info.only) {
      const pick = h("select", {id: "neuron-pick", "aria-label": "neuron"},
        info.only.map(([l, i]) => h("option", {value: `${l}/${i}`}, `${l}.${i}`)));
      const form = h("form", {id: "neuron-search", class: "neuron-search"}, "neuron ", pick, " ",
        h("button", {type: "submit"}, "show"), " ", h("span", {class: "note", id: "neuron-only"},
          `this snapshot holds the pages of its graph's ${info.only.length} neurons only`));
      form.addEventListener("submit", (e) => {
        e.preventDefault();
        show(...pick.value.split("/"));
      });
      return form;
    }
    const layer = h("input", {id: "neuron-layer", type: "number", min: 0, max: info.layers - 1, value: 0,
      "aria-label": "layer"});
    const index = h("input", {id: "neuron-index", type: "number", min: 0, max: info.neurons - 1, value: 0,
      "aria-label": "neuron index"});
    const form = h("form", {id: "neuron-search", class: "neuron-search"}, "neuron ", layer, ".", index, " ",
      h("button", {type: "submit"}, "show"));
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      show(layer.value, index.value);
    });
    return form;
  }

  // Started once the page's corpus says there are neuron pages (app.js: an event, and an attribute for a script that
  // runs later), so nothing is asked for otherwise (a snapshot without them has no file to miss).
  let started = false;
  if (document.documentElement.dataset.neurons) start();
  else document.addEventListener("detjac-neurons", start);

  function start() {
    if (started) return;
    started = true;
    load("neurons").then((info) => {
      document.getElementById("top").append(searchForm(info));
      document.addEventListener("click", (e) => {  // a graph's neuron: its id is layer_index_position
        const node = e.target.closest && e.target.closest("g.node-neuron");
        const m = node && /^(\d+)_(\d+)_(\d+)$/.exec(node.dataset.id || "");
        const value = node && node.dataset.activation !== undefined && node.dataset.activation !== ""
          ? Number(node.dataset.activation) : null;
        if (m) show(m[1], m[2], Number.isFinite(value) ? value : null);
      });
    }, (e) => section.replaceChildren(h("p", {class: "error", id: "neuron-error"}, e.message)));
  }
})();
